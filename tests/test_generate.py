"""Generation through NUMA-TP: ``numatp.compile(model).generate(...)`` against transformers' eager generate.

Tiny configs (random weights) of GPT-2, Llama (grouped-query attention), Qwen2 (14 query heads in 2 K/V
groups, tied embeddings) and Gemma 3 (one K/V head, sliding-window layers), batch 2 with the first row
left-padded. Segments run uncompiled (``mode="eager"``) except where Inductor itself is the point: what is
checked is the pass, the per-socket KV cache and the runtime. By default every family generates on 2
sockets (fp32; bf16 for Llama) and GPT-2 once through Inductor; 1 and 4 sockets and the other bf16 families
are slow (``-m slow``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import numatp
from numatp import zoo
from numatp.backend import backend_of
from numatp.generate import PROMPT_BUCKET
from numatp.runtime.segments import Segment
from tests.helpers import fresh_dynamo, shared_cpu_topology
from tests.test_families import LAYERS, _model

FAMILIES = ["gpt2", "llama", "qwen2", "gemma3"]

pytestmark = pytest.mark.integration


def _tiny(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if family == "gpt2":
        torch.manual_seed(0)
        return zoo.build("gpt2", tiny=True).to(dtype)
    return _model(family, dtype)


def _prompt(model: torch.nn.Module, batch: int = 2, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, model.config.vocab_size - 5, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :3] = 0   # the first row is left-padded
    return ids, mask


@pytest.mark.parametrize("sockets", [pytest.param(1, marks=pytest.mark.slow), 2,
                                     pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_eager_generate(family, sockets):
    fresh_dynamo()
    model = _tiny(family)
    ids, mask = _prompt(model)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    fast = numatp.compile(model, sockets=shared_cpu_topology(sockets), mode="eager")
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected), f"{family} on {sockets} sockets:\n{got}\n{expected}"
    plans = numatp.plans(fast)
    assert len(plans) == 2   # the prompt and the decode step
    for plan in plans:
        kinds = [b.kind for b in plan.blocks if b.sharded]
        if sockets > 1:
            assert kinds.count("attention") == LAYERS and kinds.count("mlp") == LAYERS, plan.blocks


@pytest.mark.parametrize("family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_bf16_greedy_tokens_equal_eager_for_16_tokens_or_up_to_a_tie(family):
    # random tiny weights in bf16 give exact ties between the two best logits now and then (Gemma 3 here,
    # at its 12th token: 0.4707 and 0.4707); a row may part from eager only at such a tie
    fresh_dynamo()
    model = _tiny(family, torch.bfloat16)
    ids, mask = _prompt(model)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert got.shape == expected.shape
    for row in range(got.shape[0]):
        differ = (got[row] != expected[row]).nonzero()
        if len(differ) == 0:
            continue
        at = int(differ[0])
        full = torch.cat([mask[row], torch.ones(at - ids.shape[1], dtype=mask.dtype)])
        with torch.no_grad():
            logits = model(input_ids=expected[row:row + 1, :at], attention_mask=full[None]).logits[0, -1].float()
        a, b = logits[expected[row, at]], logits[got[row, at]]
        ulp = 2.0 ** (torch.floor(torch.log2(logits.max().abs())) - 7)   # one bf16 step at the top logit
        assert (a - b).abs() <= ulp, (f"{family} bf16 row {row} parts from eager at position {at} without a tie: "
                                      f"logits {a.item()} (eager's token) vs {b.item()}")


def test_gpt2_through_inductor_equals_eager_and_compiles_once_per_shape():
    # 32 tokens: one program for the prompt, one for every decode step; a second generation of the same
    # shapes compiles nothing and starts from a clean cache
    fresh_dynamo()
    model = _tiny("gpt2")
    ids, mask = _prompt(model, batch=1, length=6)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2))
    backend = backend_of(fast)
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    built = sum(len(g.variants) for g in backend.graphs)
    assert (len(backend.graphs), built) == (2, 2)
    compiled = backend.compiler.compiled
    again = fast.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(again, expected)
    assert sum(len(g.variants) for g in backend.graphs) == built and backend.compiler.compiled == compiled
    # batch 1 decode: B = S = 1 must not hide the heads from the pass; 2 reductions per layer plus the
    # vocabulary-parallel embedding's
    decode = backend.plans[1]
    assert all(b.sharded for b in decode.blocks if b.kind in ("attention", "mlp"))
    assert decode.reductions == 2 * LAYERS + 1
    # the prompt's attention is CPU flash attention; the decode step's single query is numatp's kernel
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    decode_attention = torch.ops.numatp.decode_attention.default
    programs = [[n.target for s in p.steps if isinstance(s, Segment) for n in s.gm.graph.nodes]
                for g in backend.graphs for v in g.variants.values() for p in v.executor.programs]
    assert [t.count(flash) for t in programs] == [LAYERS, LAYERS, 0, 0]
    assert [t.count(decode_attention) for t in programs] == [0, 0, LAYERS, LAYERS]


def test_each_socket_holds_only_its_kv_heads_and_the_callers_cache_is_not_written():
    fresh_dynamo()
    model = _tiny("gpt2")
    ids, mask = _prompt(model)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    fast.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    (cache,) = fast.__dict__["_numatp_caches"].values()
    states = backend_of(fast).states
    cfg = model.config
    full = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    lengths = sum(layer.cumulative_length.numel() * layer.cumulative_length.element_size() for layer in cache.layers)
    assert states.nbytes == [full // 2 + lengths] * 2
    for rank in range(2):
        kv = [t for t in states.tensors(rank) if t.dim() == 4]
        assert len(kv) == 2 * LAYERS and all(t.shape[1] == cfg.n_head // 2 for t in kv)
        assert all(t.abs().sum() > 0 for t in kv)   # written by the programs
    # the K/V stay on the sockets; the lengths come back to the caller's cache
    assert all(not layer.keys.any() for layer in cache.layers)
    padded = -(-ids.shape[1] // PROMPT_BUCKET) * PROMPT_BUCKET   # the prompt as it ran, left-padded
    assert all(int(layer.cumulative_length) == padded + 3 for layer in cache.layers)
    # every socket's weights and cache copies keep a C++ reference besides their Python objects, so a
    # compiled segment dropping its own never takes the GIL (runtime.segments.keep_cpp_references)
    variants = [v for g in backend_of(fast).graphs for v in g.variants.values() if v.weights]
    assert variants
    for v in variants:
        local = [t for w in v.weights for t in w if isinstance(t, torch.Tensor)]
        assert local and all(t._use_count() >= 2 for t in local)
    assert all(t._use_count() >= 2 for rank in range(2) for t in states.tensors(rank))


def test_a_decode_steps_program_runs_four_layers_a_segment_and_the_prompts_one():
    """A program of at most STEP_ROWS rows (a decode step) ends a segment after every fourth layer, a
    prompt's after every layer; tokens equal eager either way (9 layers: the last segment is shorter)."""
    from numatp.plan.lower import REDUCTIONS_PER_SEGMENT, STEP_REDUCTIONS_PER_SEGMENT, STEP_ROWS
    from tests.hosts_child import tiny_llama

    fresh_dynamo()
    model = tiny_llama(layers=9)
    ids, mask = _prompt(model)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    inside = {}   # rows of the program -> the most reductions one of its segments runs
    for g in backend_of(fast).graphs:
        for v in g.variants.values():
            for prog in v.executor.programs:
                sums = [[n for n in s.gm.graph.nodes if n.target is torch.ops.numatp.socket_all_reduce.default]
                        for s in prog.steps if isinstance(s, Segment)]
                x = next(ns[0].args[0].meta["val"] for ns in sums if ns)   # a reduction's input: rows x hidden
                rows = x.numel() // x.shape[-1]
                inside[rows] = max(inside.get(rows, 0), *map(len, sums))
    assert 2 * PROMPT_BUCKET > STEP_ROWS >= 2
    assert inside == {2: STEP_REDUCTIONS_PER_SEGMENT, 2 * PROMPT_BUCKET: REDUCTIONS_PER_SEGMENT}, inside


def test_sampling_follows_the_same_random_draws_as_eager():
    fresh_dynamo()
    model = _tiny("llama")
    ids, mask = _prompt(model)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
              pad_token_id=0)
    torch.manual_seed(7)
    expected = model.generate(ids, **kw)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    torch.manual_seed(7)
    got = fast.generate(ids, **kw)
    assert torch.equal(got, expected)
    greedy = fast.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert not torch.equal(got, greedy)   # the draws did something


def test_token_loop_runs_on_one_thread_with_numatp_only(monkeypatch):
    # with numatp the loop's ops stay off the sockets' cores (the calling thread's OpenMP team would spin
    # there); a model another compiler runs on this thread keeps its threads; the count comes back after
    gen = importlib.import_module("numatp.generate")   # numatp.generate is also the function

    seen = []
    monkeypatch.setattr(gen, "_warpers", lambda *a: [lambda _, logits: seen.append(torch.get_num_threads()) or logits])
    model = _tiny("gpt2")
    ids, mask = _prompt(model, batch=1)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for compiled, threads in ((fast, 1), (model, 2)):
            seen.clear()
            # generate_timed: numatp.generate itself refuses a model numatp did not compile
            gen.generate_timed(compiled, ids, attention_mask=mask, max_new_tokens=3, do_sample=True, pad_token_id=0)
            assert seen == [threads] * 3 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_eos_ends_a_row_and_pads_it_like_eager():
    fresh_dynamo()
    model = _tiny("qwen2")
    ids, mask = _prompt(model)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = int(free[1, ids.shape[1] + 2])   # the second row's third new token ends it
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=1,
                              eos_token_id=eos)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=1,
                        eos_token_id=eos)
    assert torch.equal(got, expected)
    assert (got[1, ids.shape[1] + 3:] == 1).all()


def test_plain_generate_of_the_model_stays_eager():
    fresh_dynamo()
    model = _tiny("gpt2")
    ids, mask = _prompt(model)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, ids.shape[1] + 3)
    assert backend_of(fast).graphs == []   # nothing reached numatp
    assert "generate" not in model.__dict__ and type(model).generate is not type(fast).generate


def test_generate_refuses_what_it_cannot_do():
    fresh_dynamo()
    model = _tiny("gpt2")
    ids, mask = _prompt(model)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    with pytest.raises(TypeError, match="num_beams"):
        fast.generate(ids, num_beams=4)
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match="pad prompts on the left"):
        fast.generate(ids, attention_mask=right)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        fast.generate(ids, max_new_tokens=model.config.n_positions)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        fast.generate(ids, max_new_tokens=0)
    bert = zoo.build("bert-small", tiny=True)
    with pytest.raises(ValueError, match="cannot generate"):
        numatp.generate(numatp.compile(bert, sockets=shared_cpu_topology(2), mode="eager"), ids)


def _eager_and_numatp(family: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Module]:
    """A fresh tiny ``family`` model's prompt (ids, mask), eager's greedy ``tokens`` after it, and the model
    compiled by numatp on 2 sockets."""
    fresh_dynamo()
    model = _tiny(family)
    ids, mask = _prompt(model)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return ids, mask, expected, numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")


def test_decode_steps_skip_dynamos_guards_after_a_step_that_compiled_nothing(monkeypatch):
    # from the fourth forward on, only the guards that tell the prompt from the decode step run; the
    # tokens stay eager's, and the caller's stance is back after the generation
    ids, mask, expected, fast = _eager_and_numatp("gpt2", 8)
    from torch._dynamo import eval_frame

    entered = []
    real = eval_frame._set_stance
    monkeypatch.setattr(eval_frame, "_set_stance",
                        lambda st: entered.append((st.stance, st.skip_guard_eval_unsafe)) or real(st))
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    assert entered == [("default", True), ("default", False)]   # on from the fourth forward, then back
    assert (eval_frame._stance.stance, eval_frame._stance.skip_guard_eval_unsafe) == ("default", False)
    # a caller's own stance is left alone
    with torch.compiler.set_stance("eager_on_recompile"):
        entered.clear()
        again = fast.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(again, expected) and entered == []


def test_decode_steps_after_two_alike_call_numatps_graph_past_dynamo(monkeypatch):
    # the first two steps under the guard-skip stance (forwards 4 and 5) pass through Dynamo and show that
    # only the token and its positions change; every later step calls numatp's graph itself
    gen = importlib.import_module("numatp.generate")
    ids, mask, expected, fast = _eager_and_numatp("llama", 12)
    replayed = []
    real = gen.Replay.__call__
    monkeypatch.setattr(gen.Replay, "__call__", lambda self, *a: replayed.append(1) or real(self, *a))
    backend = None
    for _ in range(2):   # a second generation replays as the first did
        replayed.clear()
        calls = backend.calls if backend is not None else 0
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        backend = backend_of(fast)
        assert torch.equal(got, expected)
        assert len(replayed) == 12 - 5 and backend.calls - calls == 12   # every step ran numatp's graph


def test_a_decode_step_is_replayed_only_where_two_steps_differ_in_the_token_and_positions_alone():
    gen = importlib.import_module("numatp.generate")

    class Graph:   # stands for a graph of numatp's backend: records what it is called with
        def __call__(self, *args):
            self.got = args
            return [torch.full((1, 1, 4), 7.0)]

    class Backend:
        last_call = None

    graph, other, backend = Graph(), Graph(), Backend()
    weight, cache = torch.zeros(2), torch.zeros(2)

    def two_steps(second=graph, fresh=False, logits_out=True, calls=1, swapped=False):
        replay = gen.Replay()
        for k, g in enumerate((graph, second)):
            ids, pos, logits = torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1, 4)
            extra = torch.zeros(1) if fresh else cache   # an argument made anew at each step, or the same one
            args = (weight, pos, extra, ids) if swapped and k == 1 else (weight, ids, extra, pos)
            backend.last_call = (g, args, [logits if logits_out else logits.clone()])
            replay.observe(backend, calls, (ids, pos), logits)
        return replay

    replay = two_steps()
    assert replay.ready
    ids, pos = torch.ones(1, 1), torch.ones(1, 1)
    logits = replay(ids, pos)
    assert [a is b for a, b in zip(graph.got, (weight, ids, cache, pos))] == [True] * 4
    assert torch.equal(logits, torch.full((1, 1, 4), 7.0))
    assert not two_steps(second=other).ready            # another graph
    assert not two_steps(fresh=True).ready              # an argument other than the token's made anew
    assert not two_steps(logits_out=False).ready        # logits not one of the graph's outputs
    assert not two_steps(calls=2).ready                 # the forward ran two graphs (one would be skipped)
    assert not two_steps(swapped=True).ready            # the inputs at other places
    assert replay.calls == 1


def test_guards_keep_running_where_the_third_forward_compiled():
    # a model that changes guarded state from step to step compiles at every step: every guard stays
    gen = importlib.import_module("numatp.generate")
    from torch._dynamo.utils import counters

    skip = gen._GuardSkip()
    with skip:
        for step in range(6):
            skip.step(step)
            counters["frames"]["ok"] += 1   # this forward compiled a frame
            assert skip._context is None
    with gen._GuardSkip() as skip:
        for step in range(6):
            skip.step(step)
            assert (skip._context is not None) == (step >= 3)
    assert skip._context is None


def test_prompts_of_one_bucket_share_a_program_and_a_forward_past_dynamos_limit_is_an_error(monkeypatch):
    # prompts are left-padded to a multiple of prompt_bucket (the padding is not returned); where Dynamo
    # stops compiling (its recompile limit) and runs the model eagerly, generate says so instead of
    # reading stale per-socket caches
    fresh_dynamo()
    model = _tiny("gpt2")
    monkeypatch.setattr(importlib.import_module("numatp.backend.entry"), "RECOMPILE_LIMIT", 2)
    with torch._dynamo.config.patch(recompile_limit=2):   # this compile's limit: 2 entries
        fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    backend = backend_of(fast)
    for length in (5, 9, 13):
        ids, mask = _prompt(model, batch=1, length=length)
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(got, expected)
    assert sum(len(g.variants) for g in backend.graphs) == 2   # one prompt program (32), one decode program
    ids, mask = _prompt(model, batch=1, length=5)
    with pytest.raises(RuntimeError, match=r"the prompt \(5 tokens\).*ran without numatp.*RECOMPILE_LIMIT"):
        fast.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                      prompt_bucket=1)
    with pytest.raises(ValueError, match="prompt_bucket=0"):
        fast.generate(ids, prompt_bucket=0)


@pytest.mark.parametrize("vocab", [7, 256, 511, 50257])
def test_argmax_is_atens_argmax(vocab):
    # greedy decoding's argmax (blocks' maxima, then the first block and index holding the row's maximum)
    # picks what torch.argmax picks: ties to the first index, NaN as the largest, a maximum in the last
    # (shorter) block, rows of -inf
    from numatp.generate import argmax

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = x[1].round()                      # many ties
    x[2, vocab // 2] = x[2, -1] = 1e9        # a tie between a middle and the last index
    x[3, -1] = 1e9                           # the maximum in the last block
    x[4, vocab // 3] = float("nan")
    x[4, -1] = float("nan")
    x[5] = float("-inf")
    for logits in (x, x.to(torch.bfloat16).float(), x[:1]):
        assert torch.equal(argmax(logits), logits.argmax(-1))
