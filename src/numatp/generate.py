"""Text generation through NUMA-TP: the prefill and every decode step run as socket programs.

``numatp.compile(model).generate(input_ids, max_new_tokens=N)`` (or :func:`generate` on any model
compiled with numatp) follows transformers' ``generate`` for decoder-only models: greedy or sampled
(``temperature``, ``top_k``, ``top_p``, from the model's ``generation_config`` where not given),
``attention_mask`` with left padding, batches, ``eos_token_id`` / ``pad_token_id``; it returns the prompt
followed by the new tokens, as ``generate`` does.

The cache is static (transformers' ``StaticCache`` layout: per layer, keys and values of shape
``(batch, kv_heads, max_len, head_dim)``), so the decode step has the same shapes at every token and
compiles once per (batch, cache length); the prompt runs left-padded to a multiple of ``prompt_bucket``
tokens and compiles once per bucket. The NUMA-TP pass splits
each layer's cache like its K/V projection, and every socket keeps its heads' part in its own memory
(:mod:`numatp.backend.states`), written in place by the decode program and never gathered. Sliding-
window layers get a cache of the full length (the mask keeps the window), since transformers' sliding
layer counts its length in a Python integer that would compile a new program at every token.

Only the last position's logits are computed (``logits_to_keep=1``): the column-parallel LM head
gathers one row per sequence.

Threads and interrupts. One compiled model generates one generation at a time: its caches serve a
generation from prompt to last token, so a ``generate`` from another thread waits for the one in
progress (a server's callers queue; results are each caller's own), and one started from inside a
generation on its own thread (a callback) is an error. An interrupt (KeyboardInterrupt, or any
exception raised in the loop) leaves the model ready for the next call wherever it lands: the socket
workers of a forward it cut short are stopped at their next collective and waited for, Dynamo's stance
is restored, and the next generation resets the caches.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from numatp.backend.registry import backend_of, compiled_by_numatp
from numatp.runtime.group import callers_threads

__all__ = ["Generation", "argmax", "generate", "generate_timed", "static_cache"]

_CACHE_STEP = 64    # cache lengths are rounded up to a multiple: nearby prompt lengths share a decode program
PROMPT_BUCKET = 32  # prompts are left-padded to a multiple: nearby prompt lengths share a prompt program


@dataclass
class Generation:
    """A generation's tokens and where its time went."""

    sequences: torch.Tensor       # (batch, prompt + new tokens), as transformers' generate returns them
    prompt_tokens: int
    new_tokens: int               # decode positions produced (the longest row, EOS padding included)
    prefill_seconds: float        # the prompt's forward pass and the first token: time to first token
    decode_seconds: float         # every later token

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second per sequence after the first (each step makes one token for every row)."""
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else float("nan")


def generate(compiled: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             **kwargs: Any) -> torch.Tensor:
    """``compiled.generate(...)`` for a model compiled by numatp (``numatp.compile``, or
    ``torch.compile(..., backend="numatp")``, before its first call too): see :func:`generate_timed` for
    the arguments. Any other model is an error that says how to compile it (its own ``generate`` runs it
    eagerly)."""
    if not compiled_by_numatp(compiled):
        raise ValueError(f"numatp.generate: this {type(compiled).__name__} was not compiled by numatp, so it would "
                         "generate without it; compile it first: fast = numatp.compile(model) (or "
                         "torch.compile(model, backend='numatp')), then numatp.generate(fast, input_ids, ...) or "
                         "fast.generate(input_ids, ...)")
    return generate_timed(compiled, input_ids, attention_mask, **kwargs).sequences


def generate_timed(compiled: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   max_new_tokens: int | None = None, do_sample: bool | None = None,
                   temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                   eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                   generator: torch.Generator | None = None, max_cache_len: int | None = None,
                   prompt_bucket: int = PROMPT_BUCKET, **unknown: Any) -> Generation:
    """Generate up to ``max_new_tokens`` after ``input_ids`` (batch, prompt) with ``compiled``.

    ``attention_mask`` (batch, prompt): 1 for tokens, 0 for left padding. Sampling draws from
    ``generator`` where given. ``prompt_bucket``: the prompt runs left-padded (masked, as a tokenizer pads
    a batch) to a multiple of this many tokens, so that prompts of nearby lengths run one compiled
    program (1: as given); the padding is not returned. ``max_cache_len``: the static cache's length
    (default: the padded prompt + new tokens, rounded up to a multiple of 64). Options not listed here
    are refused by name.

    Each prompt bucket, batch and cache length is a shape of its own for Dynamo, which stops compiling a
    model after a limit (:func:`numatp.compile` sets its own, ``numatp.backend.entry.RECOMPILE_LIMIT``) and
    runs it eagerly; with numatp that would read stale per-socket caches, so a forward that did not reach
    numatp is an error that says so.
    """
    if unknown:
        raise TypeError(f"numatp generate does not take {sorted(unknown)}; it takes max_new_tokens, do_sample, "
                        "temperature, top_k, top_p, eos_token_id, pad_token_id, generator, max_cache_len, "
                        "prompt_bucket "
                        "(for other options, call the uncompiled model's generate)")
    model = getattr(compiled, "_orig_mod", compiled)
    config = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not (can is not None and can()):
        raise ValueError(f"{type(model).__name__} cannot generate: numatp generates with decoder-only "
                         "transformers models (a *ForCausalLM / *LMHeadModel)")
    gen_cfg = model.generation_config
    def pick(given: Any, name: str, default: Any = None) -> Any:
        configured = getattr(gen_cfg, name, None)
        return given if given is not None else configured if configured is not None else default
    max_new_tokens = pick(max_new_tokens, "max_new_tokens", 20)
    do_sample = bool(pick(do_sample, "do_sample", False))
    eos = pick(eos_token_id, "eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = pick(pad_token_id, "pad_token_id")
    if pad is None:
        pad = eos[0] if eos else 0
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids: expected an integer tensor of shape (batch, prompt), got a "
                         f"{type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids has dtype {input_ids.dtype}: token ids are integers; pass "
                         "input_ids.long() (as a tokenizer returns them)")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: expected (batch, prompt); "
                         "input_ids[None] makes one prompt a batch of 1")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
    batch, prompt = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != (batch, prompt):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {(batch, prompt)}: "
                         "they must match (left padding: 0 where a row has no token)")
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("attention_mask ends with 0 in some row: pad prompts on the left (tokenizer "
                         "padding_side='left'), as generation appends on the right")
    if not isinstance(prompt_bucket, int) or prompt_bucket < 1:
        raise ValueError(f"prompt_bucket={prompt_bucket!r}: must be an integer >= 1 (1 runs prompts as given)")
    need = prompt + max_new_tokens
    padded = -(-prompt // prompt_bucket) * prompt_bucket
    if max_cache_len is not None:
        if max_cache_len < need:
            raise ValueError(f"max_cache_len={max_cache_len}: the prompt ({prompt}) and max_new_tokens "
                             f"({max_new_tokens}) need {need} positions")
        padded = min(padded, max_cache_len - max_new_tokens)   # less padding where the cache is short
        length = max_cache_len
    else:
        length = -(-(padded + max_new_tokens) // _CACHE_STEP) * _CACHE_STEP
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and need > limit:
        raise ValueError(f"prompt {prompt} + max_new_tokens {max_new_tokens} = {need} positions, beyond the "
                         f"model's max_position_embeddings ({limit}): shorten the prompt or generate fewer tokens")
    warp = _warpers(pick(temperature, "temperature"), pick(top_k, "top_k"), pick(top_p, "top_p")) if do_sample else []
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    # with numatp, the token loop's own ops (logits to fp32, argmax, masks) run on this thread alone: a
    # parallel op here wakes this thread's OpenMP team, whose threads then spin for milliseconds on the
    # cores the socket workers compute on (measured: gpt2-medium bf16 decode on 2 virtual sockets, 26 ->
    # 18 ms a token). Another compiler's model computes on this thread: its thread count stays.
    numatp_model = compiled_by_numatp(compiled)
    # None before the first call of torch.compile(..., backend="numatp"): torch makes the backend then
    backend = _backend(compiled) if numatp_model else None
    lock = _generation_lock(compiled)
    # the lock's own with (no Python frame between acquiring and entering it): released wherever an interrupt lands
    with lock[0], _owned(lock), torch.inference_mode(), callers_threads():
        if numatp_model:
            torch.set_num_threads(1)
        cache = _reusable_cache(compiled, model, batch, length, dtype)
        ids = input_ids.clone()
        run_ids, run_mask = ids, attention_mask
        if padded > prompt:   # left padding, masked: the tokens' positions and outputs are the prompt's own
            # (padded with each row's first token, which the embedding has, whatever pad_token_id is)
            run_ids = torch.cat([ids[:, :1].expand(batch, padded - prompt), ids], 1)
            run_mask = torch.cat([attention_mask.new_zeros((batch, padded - prompt)), attention_mask], 1)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[:, :padded] = run_mask
        positions = (run_mask.long().cumsum(-1) - 1).masked_fill(run_mask == 0, 0)
        calls = backend.calls if backend is not None else 0
        # transformers 5 names the cache argument ``cache`` (``past_key_values`` is deprecated there)
        cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        unfinished = torch.ones(batch, dtype=torch.bool)
        finished = False   # whether some row has ended (its later tokens are pad)
        eos_t = torch.tensor(eos, dtype=torch.long)
        sequences = [ids]
        t0 = time.perf_counter()
        decode_start = None
        token = None
        replay = Replay()
        with _GuardSkip() as guards, _DecodeAhead(batch, max_new_tokens - 1) as ahead:
            ahead.attach(backend)
            for step in range(max_new_tokens):
                if step == 1:
                    decode_start = time.perf_counter()
                guards.step(step)
                step_ids = run_ids if step == 0 else token[:, None]  # type: ignore[index]  # step 0 set it
                step_pos = positions if step == 0 else positions[:, -1:] + step
                if replay.ready:
                    step_logits = replay(step_ids, step_pos)
                else:
                    out = compiled(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                   **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
                    step_logits = out.logits
                    if numatp_model:
                        if backend is None:   # the registered backend's first call made it
                            backend = ahead.attach(_backend(compiled))
                        if backend is None or backend.calls == calls:
                            raise RuntimeError(_not_through_numatp(step, prompt, padded, length))
                        if guards.skipping:
                            replay.observe(backend, backend.calls - calls, (step_ids, step_pos), step_logits)
                        calls = backend.calls
                logits = step_logits[:, -1, :].to(torch.float32)
                for w in warp:
                    logits = w(None, logits)
                if do_sample:
                    token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
                    if backend is not None and backend.hosts is not None:   # one draw for every process
                        backend.hosts.broadcast(token)
                else:
                    token = argmax(logits)
                if finished:
                    token = torch.where(unfinished, token, torch.full_like(token, pad))
                sequences.append(token[:, None])
                if eos:
                    unfinished &= ~torch.isin(token, eos_t)
                    finished = not bool(unfinished.all())
                    if not bool(unfinished.any()):
                        break
        end = time.perf_counter()
    first = (decode_start or end) - t0
    return Generation(torch.cat(sequences, 1), prompt, len(sequences) - 1, first,
                      end - decode_start if decode_start is not None else 0.0)


_BLOCK = 256


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``(rows, vocabulary)`` logits: each row's first index of its largest value
    (NaN counting as largest), as ATen's argmax gives it, in less time on one thread. ATen's argmax walks a
    row one value at a time; its ``amax`` is vectorised. So: the maximum of each block of 256 values, the
    first block holding the row's maximum, the first index of it in that block. Measured on one core of a
    Zen 5, fp32: qwen2.5's 151936 logits 78 us by argmax, 25 us so; 8 rows of gpt2's 50257, 204 and 43 us
    (ATen's amax of bf16 is no faster than widening to fp32 first)."""
    rows, vocab = logits.shape
    blocks = vocab // _BLOCK
    if blocks < 2:
        return logits.argmax(-1)
    peaks = logits[:, :blocks * _BLOCK].reshape(rows, blocks, _BLOCK).amax(-1)
    if blocks * _BLOCK < vocab:
        peaks = torch.cat([peaks, logits[:, blocks * _BLOCK:].amax(-1, keepdim=True)], 1)
    # the block's indices (the last, shorter block repeats the last index: its first copy is found first)
    where = (peaks.argmax(-1, keepdim=True) * _BLOCK + torch.arange(_BLOCK)).clamp_(max=vocab - 1)
    return where.gather(1, logits.gather(1, where).argmax(-1, keepdim=True))[:, 0]


def _generation_lock(compiled: Any) -> list[Any]:
    """``[lock, owner]`` of ``compiled``'s generations: a generation from another thread waits for the one
    in progress. The model's caches (and every socket's copy of them) serve one generation from its prompt
    to its last token, so concurrent callers run one after another. A generation started from inside
    another on the same thread (a callback) is an error: it would wait for itself."""
    lock = compiled.__dict__.get("_numatp_generating")
    if lock is None:   # setdefault: two threads' first generations get one lock
        lock = compiled.__dict__.setdefault("_numatp_generating", [threading.Lock(), None])
    if lock[0].locked() and lock[1] == threading.get_ident():
        raise RuntimeError("numatp generate was called from inside a generation of the same model on the same "
                           "thread (a callback of that generation?); it would wait for itself: generate again "
                           "once the generation in progress has returned")
    return lock


@contextlib.contextmanager
def _owned(lock: list[Any]) -> Iterator[None]:
    """Inside ``with lock[0]``: this thread holds the generation lock (an owner left behind by an interrupt
    between the two is ignored once the lock is free)."""
    lock[1] = threading.get_ident()
    try:
        yield
    finally:
        lock[1] = None


class _DecodeAhead(contextlib.ExitStack):
    """Tells numatp's backend, while the prompt and decode programs compile, that ``steps`` decode
    steps of ``rows`` rows follow the prompt: it then chooses each weight's providers for both. A backend
    made by the prompt's own call (``torch.compile(..., backend="numatp")`` before its first call) is
    attached after it, in time for the decode step; leaving the block restores the backend's hint."""

    def __init__(self, rows: int, steps: int):
        super().__init__()
        self.rows, self.steps = rows, steps
        self._attached = False

    def attach(self, backend: Any) -> Any:
        if not self._attached and getattr(backend, "gemm", None) is not None:
            self.enter_context(backend.decode_ahead(self.rows, self.steps))
            self._attached = True
        return backend


def _backend(compiled: Any) -> Any:
    """The numatp backend of ``compiled``, or None where torch has not made it yet (the registered
    backend before the model's first call)."""
    try:
        return backend_of(compiled)
    except ValueError:
        return None


def _not_through_numatp(step: int, prompt: int, padded: int, length: int) -> str:
    import torch._dynamo

    from numatp.backend.options import RECOMPILE_LIMIT

    tokens = f"{prompt} tokens" + (f", padded to {padded}" if padded > prompt else "")
    what = f"the prompt ({tokens})" if step == 0 else f"decode step {step}"
    config = torch._dynamo.config
    own = max(RECOMPILE_LIMIT, config.recompile_limit)
    return (f"numatp generate: {what}, with a cache of {length} positions, ran without numatp: Dynamo ran the "
            "model eagerly, which would read stale per-socket caches. Dynamo compiles a model for a limited "
            f"number of input shapes: {own} per numatp.compile (numatp.backend.entry.RECOMPILE_LIMIT, or "
            f"torch._dynamo.config.recompile_limit where higher), {config.recompile_limit} for "
            "torch.compile(..., backend='numatp') unless given isolate_recompiles=True and recompile_limit=, "
            f"and {config.accumulated_recompile_limit} compiles of one function per process "
            "(torch._dynamo.config.accumulated_recompile_limit); every prompt bucket, batch and cache length "
            "is one: pass the same max_cache_len to every generate, a larger prompt_bucket, or raise the limit")


class Replay:
    """Forwards past Dynamo, once two of them have shown that nothing but the inputs the caller makes anew
    at each call (a decode step's token and positions; the engine's attention mask besides) changes from one
    to the next: numatp's compiled graph called with the arguments Dynamo gave it, those inputs replaced.

    Under the guard-skip stance (:class:`_GuardSkip`) a decode step still passes through Dynamo's entry: its
    frame fetches every parameter and cache tensor of the model and hands them to numatp's graph (hundreds of
    arguments), then builds the model's output around the logits (measured, qwen2.5-0.5b int4 on 2 virtual
    sockets, 64 tokens, the two alternated in one process: 16.49 ms a token through Dynamo, 15.90 with the
    replay). The first two forwards under the stance are observed; where each ran exactly one graph of
    numatp's backend, both the same graph with the same argument objects but for the inputs the caller
    passed (compared by identity, each at the same place), and the logits the model returned are one of
    that graph's outputs (the same object), every later forward calls the graph directly. Anything else
    (another graph, two graphs, an argument made anew at each call, logits computed after the graph) leaves
    every forward to Dynamo. What the frame does besides (its guards, which the stance skips already, and
    Python state a forward would change, which would have failed a guard and kept the stance off) has
    nothing left to do at a forward that passed these checks. A model changed while its forwards are
    replayed (a parameter replaced, an attribute set) is not seen: the replayed graph keeps what it was given.
    """

    def __init__(self) -> None:
        self.ready = False
        self.calls = 0   # forwards replayed
        self._seen: tuple[Any, tuple, tuple[int, ...], int] | None = None   # graph, arguments, inputs', logits' places
        self._args: list[Any] = []

    def observe(self, backend: Any, calls: int, inputs: tuple[torch.Tensor, ...], logits: torch.Tensor) -> None:
        """After a forward that ran through Dynamo under the stance and made ``calls`` calls of numatp's graphs,
        with ``inputs`` the tensors the caller made for it: what numatp's graph got and gave."""
        last = getattr(backend, "last_call", None)
        seen, self._seen = self._seen, None
        if calls != 1 or last is None or not isinstance(last[2], (list, tuple)):
            return
        graph, args, outs = last
        where = tuple(next((k for k, a in enumerate(args) if a is t), -1) for t in inputs)
        o = next((k for k, a in enumerate(outs) if a is logits), -1)
        if -1 in where or o == -1 or len(set(where)) != len(where):
            return
        self._seen = (graph, args, where, o)
        if seen is not None and seen[0] is graph and seen[2:] == (where, o) and len(seen[1]) == len(args) and \
                all(a is b for k, (a, b) in enumerate(zip(seen[1], args)) if k not in where):
            self._args = list(args)
            self.ready = True

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One forward's logits, from numatp's graph called directly with ``inputs`` in place of those observed."""
        assert self._seen is not None
        graph, _, where, o = self._seen
        args = self._args
        for k, t in zip(where, inputs):
            args[k] = t
        self.calls += 1
        return graph(*args)[o]


class _GuardSkip:
    """Dynamo's guards skipped from the fourth forward of a generation on (``torch.compiler.set_stance``
    with ``skip_guard_eval_unsafe``), once the third ran under every guard and compiled nothing.

    A decode step of gpt2-medium is checked against a few thousand guards (every module's attributes,
    every parameter, the cache's tensors) before it runs: 0.8 ms of a 22 ms step on 2 sockets, measured.
    The loop gives every decode step the same objects and shapes (only the token and positions change,
    which Dynamo does not guard on), so after a decode step that passed every guard without compiling
    left the guarded state as it found it, the next steps would pass them too; only the guards that tell
    the compiled entries apart (the prompt from the decode step) still run. Where the third forward
    compiled, the model changes what Dynamo guards from step to step (a Python counter, say), and every
    guard keeps running. Left alone where the caller set a stance of their own.

    The stance is one for the whole process: guards are skipped only while one generation is in progress
    (another starting, on any thread, puts every guard back for both), and the stance numatp set is
    recorded before it is set, so that leaving the block, or the next generation's start where an
    interrupt cut the leaving short, always puts the caller's stance back.
    """

    _SKIP_FROM = 3
    _lock = threading.Lock()
    _live: weakref.WeakSet[_GuardSkip] = weakref.WeakSet()   # generations in progress in this process
    _ours: tuple[Any, Any, Any] | None = None   # (the stance numatp set, the one before, its generation)

    def __init__(self) -> None:
        self._frames: int | None = None
        self._usable = False
        try:
            from torch._dynamo import eval_frame
            from torch._dynamo.utils import counters
        except ImportError:
            self._eval_frame = None
            return
        self._eval_frame = eval_frame
        self._counters = counters

    @property
    def skipping(self) -> bool:
        """Whether this generation's forwards run under the stance now."""
        return self._context is not None

    @property
    def _context(self) -> Any:
        """The stance this generation set, while it is set (None otherwise)."""
        ours = _GuardSkip._ours
        return ours[0] if ours is not None and ours[2] is self else None

    def _compiled(self) -> int:
        return self._counters["frames"]["ok"]

    @classmethod
    def _restore(cls) -> None:
        """Put back the stance from before numatp's (call with ``_lock`` held)."""
        if cls._ours is not None:
            ours, prior, _ = cls._ours
            from torch._dynamo import eval_frame
            if eval_frame._stance is ours:
                eval_frame._set_stance(prior)
            cls._ours = None

    def __enter__(self) -> _GuardSkip:
        ef = self._eval_frame
        with _GuardSkip._lock:
            _GuardSkip._restore()   # another generation's skip ends, as does one an interrupt left on
            _GuardSkip._live.add(self)
            if ef is not None:
                stance = ef._stance
                self._usable = stance.stance == "default" and not stance.skip_guard_eval_unsafe
        return self

    def step(self, step: int) -> None:
        """Call before forward ``step`` (0: the prompt)."""
        if not self._usable:
            return
        if step == self._SKIP_FROM - 1:
            self._frames = self._compiled()
        elif step == self._SKIP_FROM and self._compiled() == self._frames:
            ef = self._eval_frame
            with _GuardSkip._lock:
                if len(_GuardSkip._live) != 1 or _GuardSkip._ours is not None or ef is None:
                    return
                prior = ef._stance
                if prior.stance != "default" or prior.skip_guard_eval_unsafe:
                    return
                ours = ef.DynamoStance("default", True, None)
                _GuardSkip._ours = (ours, prior, self)   # recorded first: whatever happens next, it is undone
                ef._set_stance(ours)

    def __exit__(self, *exc: object) -> None:
        with _GuardSkip._lock:
            _GuardSkip._live.discard(self)
            if self._context is not None:
                _GuardSkip._restore()


def static_cache(model: torch.nn.Module, batch: int, max_len: int, dtype: torch.dtype) -> Any:
    """A transformers ``StaticCache`` for ``model``, allocated now, every layer ``max_len`` long."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    config: Any = model.config   # a transformers model's PretrainedConfig
    cfg = config.get_text_config(decoder=True)
    cache = StaticCache(config=config, max_cache_len=max_len)
    # a sliding-window layer keeps its length in a Python int (a new program per token under torch.compile);
    # a full-length layer holds every position and the model's sliding mask keeps the window
    cache.layers = [StaticLayer(max_cache_len=max_len) if isinstance(layer, StaticLayer) else layer
                    for layer in cache.layers]
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(batch, heads, head_dim, dtype, torch.device("cpu"))
    return cache


def _reusable_cache(compiled: Any, model: torch.nn.Module, batch: int, length: int, dtype: torch.dtype) -> Any:
    """The cache of this (batch, length, dtype), made once per compiled model and reset for each generation:
    the decode program is compiled for its tensors, and the sockets' copies of it are reloaded."""
    caches = compiled.__dict__.setdefault("_numatp_caches", {})
    key = (batch, length, dtype)
    cache = caches.get(key)
    if cache is None:
        cache = caches[key] = static_cache(model, batch, length, dtype)
        return cache
    cache.reset()
    try:
        backend = backend_of(compiled)
    except ValueError:
        return cache   # not run through numatp yet: nothing holds a copy
    backend.reload_states()
    return cache


def _warpers(temperature: float | None, top_k: int | None, top_p: float | None) -> list[Any]:
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    out: list[Any] = []
    if temperature is not None and temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        out.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out
