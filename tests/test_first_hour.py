"""What a new user meets first: one socket default everywhere, one log line per compile, progress lines that
can be turned off, API errors that say what to do, and the README's Use block in one process."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest
import torch

import numatp
from numatp import progress, zoo
from numatp.backend import backend_of, numatp_backend
from numatp.bench.machine import resolve_ranks
from numatp.cli import build_parser
from numatp.topology import NumaNode, Socket, Topology, default_topology, resolve_sockets
from numatp.topology.default import describe
from tests.helpers import assert_close_to_eager, fresh_dynamo

pytestmark = pytest.mark.integration   # compiles on socket groups (eager segments, one under Inductor)


@pytest.fixture(autouse=True)
def _fresh():
    fresh_dynamo()
    yield
    progress.set_progress(None)


def _one_node(cpus: tuple[int, ...]) -> Topology:
    """A one-node machine whose node has ``cpus`` (as detect reads it; not a virtual topology)."""
    return Topology((NumaNode(0, frozenset(cpus), 1 << 30, {0: 10}),), (Socket(0, 0, cpus),), frozenset(cpus),
                    is_virtual=False)


def test_default_rule_on_fixture_topologies(sysfs_root):
    two = Topology.detect(root=sysfs_root("xeon-2s"), allowed_cpus=range(64))
    assert default_topology(two) == two   # 2 nodes with usable CPUs: those, placed
    nps2 = Topology.detect(root=sysfs_root("epyc-2s-nps2"), allowed_cpus=range(32))
    assert default_topology(nps2).num_sockets == 4
    # the same machine with only node 0's CPUs allowed is a one-node machine for this process
    node0 = Topology.detect(root=sysfs_root("xeon-2s"), allowed_cpus=range(16))
    split = default_topology(node0)
    cpus = node0.sockets[0].cpus   # node 0's online CPUs (the fixture has one offline)
    half = -(-len(cpus) // 2)
    assert split.is_virtual and [s.cpus for s in split.sockets] == [cpus[:half], cpus[half:]]
    one_cpu = _one_node((3,))
    assert default_topology(one_cpu) == one_cpu   # one CPU: one socket
    # an int keeps its meaning: the first N sockets, or N virtual ones on a one-node machine
    assert resolve_sockets(1, machine=two).num_sockets == 1 and not resolve_sockets(1, machine=two).is_virtual
    assert resolve_sockets(1, machine=node0) == node0
    assert resolve_sockets(4, machine=node0).num_sockets == 4
    with pytest.raises(ValueError, match=r"sockets=3: this machine has 2 usable sockets"):
        resolve_sockets(3, machine=two)


@pytest.mark.parametrize("machine", ["one-node", "epyc-2s-nps2"])
def test_api_backend_and_cli_resolve_the_same_default(machine, sysfs_root, monkeypatch, cli):
    detected = (_one_node((0, 1)) if machine == "one-node"
                else Topology.detect(root=sysfs_root(machine), allowed_cpus=range(32)))
    monkeypatch.setattr(Topology, "detect", classmethod(lambda cls, *a, **k: detected))
    expected = default_topology(detected)
    assert expected.num_sockets == (2 if machine == "one-node" else 4)
    model = zoo.build("gpt2", tiny=True)
    # numatp.compile resolves its topology at compile time; nothing runs on these (fixture) CPUs
    assert backend_of(numatp.compile(model, mode="eager")).topology == expected
    # the registered backend, as torch.compile's wrapper calls it with no sockets option
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    assert numatp_backend(gm, [torch.randn(2, 4)], options={"mode": "eager"}).backend.topology == expected
    # every command's --sockets defaults to None, which the commands resolve with the same rule
    parser = build_parser()
    for argv in (["demo"], ["generate", "gpt2"], ["bench"], ["explain", "gpt2"], ["calibrate"]):
        assert parser.parse_args(argv).sockets is None, argv
    assert resolve_ranks(None, detected) == expected
    if machine == "one-node":   # explain starts socket workers: a fixture's CPUs cannot host them
        code, out, err = cli("explain", "gpt2", "--tiny", "--seq", "8", "--json")
        assert code == 0, err
        assert json.loads(out)["sockets"] == expected.num_sockets


def _without_root_handlers(monkeypatch):
    """As in a plain script: no logging configured, so numatp's own handler prints (pytest's are put aside)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_line_per_compile_says_the_sockets_and_can_be_silenced(monkeypatch):
    _without_root_handlers(monkeypatch)
    model, ids = zoo.build("gpt2", tiny=True), torch.randint(0, 512, (1, 8))
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)   # progress is on by default where stderr is a terminal
    compiled = numatp.compile(model, sockets=2, mode="eager")
    with torch.inference_mode():
        compiled(input_ids=ids)
        compiled(input_ids=torch.randint(0, 512, (1, 12)))   # a second shape: built, not announced again
    lines = terminal.getvalue().splitlines()
    said = [line for line in lines if line.startswith("numatp: compiling for")]
    topology = backend_of(compiled).topology
    assert said == [f"numatp: compiling for {describe(topology)}. numatp.set_progress(False) silences these lines"]
    assert describe(Topology.virtual(sockets=2, cpus=[0, 1])) == (
        "2 virtual sockets on memory node 0, 1 CPU each (CPUs 0; 1); weights not placed (virtual sockets share "
        "one memory node: no mbind)")
    # the registered backend says it once too, at its first call (when torch hands it its options)
    terminal.seek(0), terminal.truncate()
    registered = torch.compile(model, backend="numatp", options={"mode": "eager"})
    with torch.inference_mode():
        registered(input_ids=ids)
        registered(input_ids=ids)
    said = [line for line in terminal.getvalue().splitlines() if line.startswith("numatp: compiling for")]
    assert len(said) == 1 and "(this machine's default; sockets= chooses)" in said[0]
    # silenced: nothing of numatp's on stderr
    terminal.seek(0), terminal.truncate()
    numatp.set_progress(False)
    with torch.inference_mode():
        numatp.compile(model, sockets=2, mode="eager")(input_ids=ids)
    assert terminal.getvalue() == ""
    # not a terminal: nothing unless asked
    numatp.set_progress(None)
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    numatp.compile(model, sockets=2, mode="eager")
    assert pipe.getvalue() == ""
    with pytest.raises(ValueError, match=r"set_progress\('yes'\): pass True"):
        numatp.set_progress("yes")


def test_progress_lines_say_what_is_built_and_how_long_it_took(monkeypatch, capsys):
    _without_root_handlers(monkeypatch)
    numatp.set_progress(True)   # asked for: printed into a captured (non-terminal) stderr too
    model = zoo.build("gpt2", tiny=True)
    compiled = numatp.compile(model, sockets=2, mode="eager", gemm=numatp.GemmOptions(remeasure=True))
    with torch.inference_mode():
        compiled(input_ids=torch.randint(0, 512, (1, 8)))
    err = capsys.readouterr().err
    assert "numatp: building socket programs for graph 0, inputs (1, 8) int64" in err
    assert re.search(r"numatp: measuring GEMM providers for \d+ shapes on 2 socket\(s\) done in \d+\.\ds", err), err
    assert re.search(r"numatp: graph 0: done in \d+\.\ds", err), err


def test_progress_reaches_a_programs_own_logging_config(caplog):
    # where the program configured logging, numatp's records go to its handlers (here pytest's)
    model = zoo.build("gpt2", tiny=True)
    with caplog.at_level(logging.INFO):
        numatp.compile(model, sockets=2, mode="eager")
    assert [r.getMessage() for r in caplog.records if r.name == "numatp"][0].startswith("numatp: compiling for 2")
    caplog.clear()
    numatp.compile(model, sockets=2, mode="eager")   # root at WARNING and progress off (not a terminal): none
    assert not [r for r in caplog.records if r.name == "numatp"]


def test_api_errors_say_what_to_do():
    model = zoo.build("gpt2", tiny=True)
    ids = torch.randint(0, 512, (1, 8))
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['polcy'\] \(did you mean 'policy'\?\); "
                                        r"it takes sockets, policy, mode, strict_placement, gemm, auto_measure, plan"):
        numatp.compile(model, polcy="auto")
    with pytest.raises(ValueError, match=r"this GPT2LMHeadModel was not compiled by numatp, so it would generate "
                                         r"without it; compile it first: fast = numatp.compile\(model\)"):
        numatp.generate(model, ids)
    with pytest.raises(ValueError, match=r"was not compiled by numatp"):
        numatp.generate(torch.compile(model, backend="eager"), ids)
    fast = numatp.compile(model, sockets=2, mode="eager")
    with pytest.raises(ValueError, match=r"input_ids has dtype torch.float32: token ids are integers"):
        numatp.generate(fast, ids.float())
    with pytest.raises(ValueError, match=r"input_ids has shape \(8,\): expected \(batch, prompt\)"):
        numatp.generate(fast, ids[0])


def test_generate_on_a_fresh_registered_model_runs_through_numatp():
    model = zoo.build("gpt2", tiny=True)
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    registered = torch.compile(model, backend="numatp", options={"sockets": 2, "mode": "eager"})
    got = numatp.generate(registered, ids, max_new_tokens=5, pad_token_id=0)
    expected = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    plans = numatp.plans(registered)
    assert len(plans) == 2 and all(p.sockets == 2 for p in plans)   # the prompt and the decode step
    # the backend the prompt's call made was told of the decode steps, and restored once generation ended
    assert backend_of(registered).decode is None


def test_compiles_of_one_model_class_do_not_use_up_each_others_recompile_limit():
    # Dynamo's recompile limit (8 entries per code object) is shared by every torch.compile of a model
    # class unless a compile isolates its own: 7 compiled-and-run copies of one model, then an 8th
    # generating (a prompt and a decode step) would reach it and run the decode step eagerly
    model = zoo.build("gpt2", tiny=True)
    ids = torch.randint(0, 512, (1, 16))
    limit = torch._dynamo.config.recompile_limit
    with torch.inference_mode():
        for _ in range(limit - 1):
            numatp.compile(model, sockets=2, mode="eager", gemm=False)(input_ids=ids)
    fast = numatp.compile(model, sockets=2, mode="eager", gemm=False)
    got = fast.generate(ids, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(got, model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))



def test_each_numatp_compile_counts_its_own_entries_up_to_its_own_limit():
    from numatp.backend.entry import RECOMPILE_LIMIT

    model = zoo.build("gpt2", tiny=True)
    fast = numatp.compile(model, sockets=2, mode="eager", gemm=False)
    convert = fast.dynamo_ctx.callback._torchdynamo_orig_backend   # Dynamo's frame converter of this compile
    assert convert._recompile_limit == RECOMPILE_LIMIT > torch._dynamo.config.recompile_limit
    assert fast.dynamo_ctx._isolate_recompiles_id >= 0
    with torch._dynamo.config.patch(recompile_limit=100):   # a user's higher global limit is kept
        higher = numatp.compile(model, sockets=2, mode="eager", gemm=False)
    assert higher.dynamo_ctx.callback._torchdynamo_orig_backend._recompile_limit == 100


@pytest.mark.slow
def test_one_compiled_model_generates_more_shapes_than_dynamos_default_limit():
    # every prompt bucket and cache length is a Dynamo entry: six generations of a server's mix of prompt
    # and output lengths make 9, past Dynamo's default of 8; numatp.compile allows its own RECOMPILE_LIMIT
    from numatp.backend.entry import RECOMPILE_LIMIT

    assert torch._dynamo.config.recompile_limit == 8 and RECOMPILE_LIMIT > 9
    torch.manual_seed(0)
    model = zoo.build("gpt2", tiny=True)
    fast = numatp.compile(model, sockets=2, mode="eager", gemm=False)
    for length, new in ((5, 4), (40, 4), (70, 4), (100, 4), (5, 70), (40, 70)):
        ids = torch.randint(5, 500, (1, length), generator=torch.Generator().manual_seed(length))
        got = fast.generate(ids, max_new_tokens=new, pad_token_id=0)
        assert torch.equal(got, model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0))
    assert sum(len(g.variants) for g in backend_of(fast).graphs) == 9


@pytest.mark.slow
def test_distinct_models_of_one_class_and_other_compiles_of_one_model_each_generate():
    # the two cases, on tiny models: six distinct Llamas of one class compiled and generating in one
    # process, all kept; one GPT-2 under torch.compile with numatp's static-cache loop, then numatp at 1
    # and at 2 sockets (each a prompt and a decode entry on the same code objects)
    from numatp.generate import generate_timed
    from tests.test_families import _model

    ids = torch.randint(5, 200, (1, 8), generator=torch.Generator().manual_seed(1))
    kept = []
    for _ in range(6):
        model = _model("llama")
        fast = numatp.compile(model, sockets=2, mode="eager", gemm=False)
        kept.append(fast)
        got = fast.generate(ids, max_new_tokens=3, pad_token_id=0)
        assert torch.equal(got, model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0))
    torch.manual_seed(0)
    gpt2 = zoo.build("gpt2", tiny=True)
    expected = gpt2.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    for compiled in (torch.compile(gpt2, backend="eager"), numatp.compile(gpt2, sockets=1, mode="eager", gemm=False),
                     numatp.compile(gpt2, sockets=2, mode="eager", gemm=False)):
        for _ in range(2):
            assert torch.equal(generate_timed(compiled, ids, max_new_tokens=3, pad_token_id=0).sequences, expected)


@pytest.mark.slow
def test_readme_use_block_runs_top_to_bottom_in_one_process():
    # the README's Use block on a tiny GPT-2 (random weights, 2 layers), Inductor and measured GEMM
    # providers as a user gets them: several compiles of one model class, each run once, then generation
    torch.manual_seed(0)
    model = zoo.build("gpt2", tiny=True)
    input_ids = torch.randint(0, 512, (1, 16))
    mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        expected = model(input_ids).logits
    fast = numatp.compile(model, sockets=None)
    with torch.inference_mode():
        logits = fast(input_ids).logits
    assert_close_to_eager(logits, expected, "default sockets")
    assert numatp.placement_report(fast)["ranks"]
    assert numatp.plans(fast)
    for fast in (numatp.compile(model, policy="auto"), numatp.compile(model, gemm=False),
                 torch.compile(model, backend="numatp", options={"sockets": 2, "policy": "auto", "gemm": True}),
                 numatp.compile(model, plan={"transformer.h.*.attn.c_attn": "replicate",
                                             "transformer.h.0.mlp.c_proj": "replicate"})):
        with torch.inference_mode():
            assert_close_to_eager(fast(input_ids).logits, expected, "a compile of the Use block")
    assert numatp.plans(fast)[0].to_tp_plan()
    fast = numatp.compile(model)
    greedy = model.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    tokens = fast.generate(input_ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(tokens, greedy)
    tokens = fast.generate(input_ids, max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9)
    assert tokens.shape == (1, 32)
    tokens = numatp.generate(fast, input_ids, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(tokens, greedy)
