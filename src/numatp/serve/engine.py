"""Continuous batching over one model compiled by numatp: B slots of one static KV cache, one engine thread.

The :class:`Engine` owns the compiled model: every forward runs on its one thread (HTTP handlers only
:meth:`Engine.submit` requests and read their events), so the socket group never sees two callers.

The cache is transformers' ``StaticCache`` of ``B`` rows and ``cache_len`` positions (at least ``max_len +
chunk``: the extra ``chunk`` lets a sequence of ``max_len`` tokens be re-prefilled after a reset, see below).
It writes every row at the same position (the layers' ``cumulative_length``), so the engine keeps one clock
``t``, the next cache position, and per slot the cache positions it owns: slot ``i`` sees row ``i`` of the (B,
L) attention mask, 1 exactly at the positions its tokens were written to, and its own ``position_ids`` (the
token's place in its sequence). Causality comes from the cache position, the rest from the mask, so rows of
different lengths and ages share every call.

The model sees two input shapes at each of two widths, so four programs are compiled, whatever the
requests:

- a decode step ``(B, 1)``: each active slot's last token at the clock's position; idle slots get a pad
  token that sees only its own position (which nothing else reads);
- a prefill chunk ``(B, chunk)``: joiners' prompts, left-padded (masked) to a multiple of ``chunk`` and
  right-aligned so that several joiners at one step boundary share the calls and finish together; every
  other row carries pad tokens that its mask hides from it afterwards. The clock advances ``chunk`` a call;
- the same two at width 1, ``(1, 1)`` and ``(1, chunk)``, over a cache of the first row alone (a view of
  the same tensors, so on every socket the same copy: :meth:`numatp.backend.states.StateStore.get`),
  for the steps where slot 0 is the only one in use (a request joins the lowest free slot): one stream
  pays for one row, not ``B``.

Joining happens at a step boundary. When the joiners' chunks do not fit in the positions left: if every
active sequence finishes within ``chunk`` more steps (and the cache), joins wait for them (the cache
drains); otherwise the cache is reset now (clock 0) and each active sequence is re-prefilled from its
prompt and the tokens it has generated so far (recompute preemption; its greedy tokens are those of a run
without the reset, up to rounding), together with the joiners. A clock that reaches the end of the cache
with slots active resets the same way. A request's prompt + ``max_tokens`` is at most ``max_len``, so after a reset
its re-prefill (padded by at most ``chunk - 1``) and its remaining tokens always fit.

Sampling is per request (temperature, top_p, a ``torch.Generator`` seeded by the request's seed), greedy
at temperature 0. A request leaves at EOS, ``max_tokens`` or :meth:`Request.cancel` (a stop string, a
client gone); its slot is free at the next step boundary.
"""

from __future__ import annotations

import collections
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from numatp.backend.registry import backend_of, compiled_by_numatp
from numatp.generate import Replay, _warpers, argmax, static_cache
from numatp.runtime.group import callers_threads
from numatp.serve.metrics import Metrics

__all__ = ["Engine", "QueueFull", "Request", "RequestError"]

log = logging.getLogger("numatp")

SOLO_JOIN_SHARE = 2
"""A join of at most ``max_batch // SOLO_JOIN_SHARE`` sequences (at least 1) prefills each alone, at width
1 over its own row of the cache (the same clock positions for each), instead of all together at width
``max_batch``, where every slot's row is computed, joining or not. Measured, gpt2-medium bf16, 2 virtual
sockets, 8 slots, a 128-token prompt: one call at width 1 took 99 ms, at width 8 464 ms."""

LONG_CHUNK = 4
"""Chunks per long prefill call: a prompt of this many chunks or more runs them this many at a time (the
same positions and rows, in fewer calls of more rows each). Measured, gpt2-medium bf16, 2 virtual
sockets, a 128-token prompt alone at width 1: 4 calls of (1, 32) took 226 ms, where one call of 128
tokens takes about 90 ms (``numatp generate``'s first token). 1 turns long calls off."""


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full: retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class RequestError(ValueError):
    """A request the engine cannot serve as given (``param`` names the field)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(eq=False)
class Request:
    """One sequence to generate. ``on_event`` is called on the engine thread with ``("token", id)`` for each
    token, then once with ``("done", reason)`` (``"stop"``: EOS; ``"length"``: max_tokens; ``"cancelled"``)
    or ``("error", message)``; it must not block."""

    prompt: list[int]
    max_tokens: int
    on_event: Callable[[str, Any], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _cancelled: bool = False
    _generator: torch.Generator | None = None
    _warp: list[Any] = field(default_factory=list)
    _last_token_at: float | None = None

    def cancel(self) -> None:
        """Leave at the next step boundary (thread-safe); its slot is freed, and ``("done", "cancelled")`` is
        sent unless it finished first."""
        self._cancelled = True


@dataclass
class _Slot:
    request: Request
    next_pos: int        # the position_id of the next token fed (= tokens so far - 1 after the prefill)
    last: int            # the token to feed at the next decode step


class Engine:
    """Continuous batching over ``compiled`` (a model compiled by ``numatp.compile``, or any compiled model
    for testing) with ``max_batch`` slots, a context of ``max_len`` tokens per request (prompt + new tokens),
    prefill chunks of ``chunk`` tokens, a cache of ``cache_len`` positions (default ``max_len + chunk``; more
    means fewer resets: every join advances the shared clock by its padded prompt) and at most
    ``max_queue`` requests waiting beyond the free slots. With ``skip_guards``, the forwards skip Dynamo's
    guards after the warm-up and then run numatp's graphs past Dynamo (:class:`numatp.generate.Replay`):
    the model must not be changed while the engine serves it (the replayed graphs would not see it).
    :meth:`start` compiles the programs and starts the engine thread; :meth:`stop` ends it."""

    def __init__(self, compiled: Any, *, max_batch: int = 8, max_len: int = 1024, chunk: int = 32,
                 cache_len: int | None = None, max_queue: int = 64, eos_token_ids: list[int] | None = None,
                 pad_token_id: int | None = None, metrics: Metrics | None = None, skip_guards: bool = False):
        for name, value in (("max_batch", max_batch), ("max_len", max_len), ("chunk", chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r}: must be >= 0")
        self.compiled = compiled
        self.model = getattr(compiled, "_orig_mod", compiled)
        config = self.model.config
        self.vocab_size = int(config.get_text_config(decoder=True).vocab_size)
        limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
        if limit is not None and max_len > limit:
            raise ValueError(f"max_len={max_len}: the model has {limit} positions (max_position_embeddings); "
                             f"pass --max-len {limit} or less")
        self.max_batch, self.max_len, self.chunk, self.max_queue = max_batch, max_len, chunk, max_queue
        # a prompt of LONG_CHUNK chunks or more runs its first ones LONG_CHUNK at a time (one call of
        # LONG_CHUNK x chunk positions): the same positions and rows computed, in fewer, larger calls
        self.long_chunk = LONG_CHUNK * chunk if LONG_CHUNK > 1 and LONG_CHUNK * chunk <= max_len else None
        self.cache_len = cache_len if cache_len is not None else max_len + chunk
        if self.cache_len < max_len + chunk:
            raise ValueError(f"cache_len={cache_len}: must be at least max_len + chunk ({max_len + chunk}), so that a "
                             "sequence of max_len tokens can be prefilled again after a reset")
        gen = self.model.generation_config
        eos = eos_token_ids if eos_token_ids is not None else gen.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        pad = pad_token_id if pad_token_id is not None else gen.pad_token_id
        self.pad = int(pad if pad is not None and 0 <= pad < self.vocab_size else 0)
        self.metrics = metrics or Metrics()
        self.dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        self._numatp = compiled_by_numatp(compiled)
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: collections.deque[Request] = collections.deque()   # submitted, not yet seen by the engine
        self._waiting: collections.deque[Request] = collections.deque()  # seen, waiting for a slot
        self._slots: list[_Slot | None] = [None] * max_batch
        self._running = False
        self._accepting = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.forwards = 0
        self.widths: collections.Counter[int] = collections.Counter()   # forwards per batch width
        self.lengths: collections.Counter[int] = collections.Counter()   # forwards per call length (1: a step)
        self.alone: collections.Counter[int] = collections.Counter()   # prefills run alone at width 1, per slot
        # Dynamo's guards skipped after the warm-up (see _warm_up): off by default, since with it on, a
        # forward now and then ran without numatp in the test suite, a process that compiles and collects
        # many models of the same classes (not understood yet); `numatp serve`, whose process compiles
        # this one model alone, turns it on
        self.skip_guards = skip_guards
        self._skip_guards = False
        # with the guards skipped, each call shape (width, length, the row a width-1 call runs over) is replayed
        # past Dynamo once two of its forwards have shown that only the ids, mask and positions change
        self._replays: dict[tuple[int, int, int], Replay] = {}
        self._replayed_before = 0   # forwards replayed by replays since dropped
        self.resets = 0

    # ---- the callers' side (any thread) -------------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        """Queue ``request`` (validated here); :class:`QueueFull` past the free slots and the queue,
        :class:`RequestError` for a request that cannot be served."""
        n = len(request.prompt)
        if n == 0:
            raise RequestError("the prompt is empty: give at least one token", "prompt")
        bad = next((x for x in request.prompt if not 0 <= x < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the model's vocabulary (0..{self.vocab_size - 1})",
                               "prompt")
        if request.max_tokens < 1:
            raise RequestError(f"max_tokens={request.max_tokens}: must be >= 1", "max_tokens")
        if n + request.max_tokens > self.max_len:
            raise RequestError(f"this model's maximum context length is {self.max_len} tokens; the prompt has {n} "
                               f"and max_tokens is {request.max_tokens} ({n + request.max_tokens} in all): shorten "
                               "the prompt or lower max_tokens", "max_tokens" if n < self.max_len else "prompt",
                               "context_length_exceeded")
        if request.temperature < 0:
            raise RequestError(f"temperature={request.temperature}: must be >= 0", "temperature")
        if not 0 < request.top_p <= 1:
            raise RequestError(f"top_p={request.top_p}: must be in (0, 1]", "top_p")
        if request.temperature > 0:
            request._generator = torch.Generator()
            if request.seed is not None:
                request._generator.manual_seed(request.seed)
            else:
                request._generator.seed()
            request._warp = _warpers(request.temperature, None, request.top_p)
        with self._lock:
            if not self._accepting:
                raise QueueFull("the server is shutting down", retry_after=5)
            busy = sum(s is not None for s in self._slots) + len(self._waiting) + len(self._inbox)
            if busy >= self.max_batch + self.max_queue:
                raise QueueFull(f"all {self.max_batch} slots are busy and {self.max_queue} requests wait already",
                                retry_after=1)
            self._inbox.append(request)
            self._wake.notify()
        return request

    @property
    def active(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def queued(self) -> int:
        return len(self._waiting) + len(self._inbox)

    @property
    def guards_skipped(self) -> bool:
        """Whether the forwards skip Dynamo's guards (``skip_guards`` given, and the warm-up compiled nothing
        the second time), until a change to the model makes them checked again."""
        return self._skip_guards

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def serving(self) -> bool:
        """The engine thread runs and takes requests."""
        return self._thread is not None and self._thread.is_alive() and self._accepting

    def start(self) -> None:
        """Compile the programs (a prefill chunk and a decode step, at both widths) and start the engine thread; returns
        when it is ready to serve (raises what compiling raised)."""
        self._running = True
        self._thread = threading.Thread(target=self._main, name="numatp-serve-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error
        with self._lock:
            self._accepting = True

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting; requests still in flight get ``("done", "cancelled")``; the thread ends."""
        with self._lock:
            self._accepting = False
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    # ---- the engine thread -------------------------------------------------------------------------------

    def _main(self) -> None:
        with torch.inference_mode(), callers_threads():
            if self._numatp:
                # the loop's own ops run on this thread alone (see numatp.generate: a parallel op here wakes
                # an OpenMP team that spins on the sockets' cores)
                torch.set_num_threads(1)
            try:
                self._warm_up()
            except BaseException as e:   # noqa: B036 - handed to start(), which raises it
                self._start_error = e
                self._ready.set()
                return
            self._ready.set()
            try:
                while True:
                    with self._lock:
                        while self._running and not self._inbox and not self._waiting and self.active == 0:
                            self._wake.wait(0.5)
                        if not self._running:
                            break
                        self._waiting.extend(self._inbox)
                        self._inbox.clear()
                    try:
                        self._step()
                    except Exception:   # a fault of the engine's own bookkeeping: logged, the thread goes on
                        log.exception("numatp serve: an engine step failed")
            finally:
                self._cancel_all("cancelled")

    def _warm_up(self) -> None:
        """Compile the chunk and step programs, and run each once more: where that compiled nothing and ``skip_guards``
        was given, every later forward skips Dynamo's guards (as numatp.generate does from its fourth
        forward: thousands of guards, ~1 ms a step on gpt2-medium; only the guards that tell the two
        programs apart still run). The stance is process-wide, so it is set around each forward of the
        engine thread, not for its life (another model compiling in the process meanwhile would be refused).
        Then reset the cache."""
        from torch._dynamo.eval_frame import _stance
        from torch._dynamo.utils import counters

        usable = getattr(_stance, "stance", None) == "default" and not getattr(_stance, "skip_guard_eval_unsafe", True)
        frames = None
        self._cache = static_cache(self.model, self.max_batch, self.cache_len, self.dtype)
        self._narrow = [self._row(self._cache, i) for i in range(self.max_batch)] if self.max_batch > 1 else None
        self._own = torch.zeros(self.max_batch, self.cache_len, dtype=torch.long)
        self._t = 0
        backend = None
        ahead = None
        if self._numatp:
            backend = self._backend()
        t0 = time.perf_counter()
        B, C = self.max_batch, self.chunk
        widths = (B, 1) if self._narrow is not None else (B,)
        lengths = (C, 1) if self.long_chunk is None else (C, self.long_chunk, 1)
        for i in range(2):
            if i == 1:
                frames = counters["frames"]["ok"]
            for shape in [(w, n) for w in widths for n in lengths]:
                if self._t + shape[1] > self.cache_len:
                    self._reset()
                ids = torch.full(shape, self.pad, dtype=torch.long)
                mask = torch.zeros(shape[0], self.cache_len, dtype=torch.long)
                mask[:, self._t:self._t + shape[1]] = 1
                pos = torch.arange(shape[1]).expand(shape).contiguous()
                if backend is None and self._numatp:
                    self._forward(ids, mask, pos)
                    backend = self._backend()
                else:
                    if ahead is None and backend is not None and getattr(backend, "gemm", None) is not None:
                        ahead = backend.decode_ahead(B, self.max_len)
                        ahead.__enter__()
                    self._forward(ids, mask, pos)
        if ahead is not None:
            ahead.__exit__(None, None, None)
        self._skip_guards = self.skip_guards and usable and counters["frames"]["ok"] == frames
        self._reset()
        self.resets = 0
        log.info("numatp serve: compiled the prefill %s and the decode step (%d, 1)%s in %.1fs; these "
                 "programs serve every request", self.chunks_said(), B,
                 " at widths 1 and %d" % B if len(widths) > 1 else "", time.perf_counter() - t0)

    def chunks_said(self) -> str:
        """The prefill programs, as the start-up lines name them: "chunk (B, C)" or "chunks (B, C) and (B, L)"."""
        B, C, L = self.max_batch, self.chunk, self.long_chunk
        return f"chunk ({B}, {C})" if L is None else f"chunks ({B}, {C}) and ({B}, {L})"

    def _pieces(self, chunks: int) -> list[tuple[int, int]]:
        """A prefill of ``chunks`` chunks as calls: (first column, length), long chunks first."""
        C, L = self.chunk, self.long_chunk
        long = chunks // LONG_CHUNK if L is not None else 0
        return [(k * LONG_CHUNK * C, LONG_CHUNK * C) for k in range(long)] + \
            [((long * LONG_CHUNK + k) * C, C) for k in range(chunks - long * LONG_CHUNK)]

    def _row(self, cache: Any, i: int) -> Any:
        """A cache of one sequence over row ``i`` of ``cache``'s tensors (views), sharing its lengths."""
        narrow = static_cache(self.model, 1, self.cache_len, self.dtype)
        for small, big in zip(narrow.layers, cache.layers):
            small.keys, small.values = big.keys[i:i + 1], big.values[i:i + 1]
            small.cumulative_length = big.cumulative_length
        return narrow

    def _clock(self, t: int) -> None:
        """Set the clock (the cache's lengths, and every socket's copy of them) back to ``t``."""
        if self._t == t:
            return
        for layer in self._cache.layers:
            layer.cumulative_length.fill_(t)
        if self._numatp:
            backend = self._backend()
            if backend is not None:
                backend.reload_states(replicated_only=True)
        self._t = t

    def _backend(self) -> Any:
        try:
            return backend_of(self.compiled)
        except ValueError:
            return None

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, row: int = 0) -> torch.Tensor:
        """(B, vocab) fp32 logits of each row's last position; the clock advances by the call's length. A
        call of one row runs over slot ``row``'s row of the cache. With the guards skipped, a call of a shape
        two earlier calls of it under the stance showed replayable runs numatp's graph directly
        (:class:`numatp.generate.Replay`)."""
        backend = self._backend() if self._numatp else None
        calls = backend.calls if backend is not None else None
        narrow = self._narrow
        wide = ids.shape[0] == self.max_batch or narrow is None
        key = (ids.shape[0], ids.shape[1], -1 if wide else row)
        replay = self._replays.get(key) if self._skip_guards else None
        if replay is not None and replay.ready:
            logits = replay(ids, mask, pos)
        else:
            logits = self._through_dynamo(ids, mask, pos, self._cache if wide else narrow[row])  # type: ignore[index]
            if self._skip_guards and backend is not None:   # still skipped: the forward ran under the stance
                if replay is None:
                    replay = self._replays[key] = Replay()
                replay.observe(backend, backend.calls - calls, (ids, mask, pos), logits)
        self._t += ids.shape[1]
        self.forwards += 1
        self.widths[ids.shape[0]] += 1
        self.lengths[ids.shape[1]] += 1
        if self._numatp:
            backend = backend or self._backend()
            if backend is None or backend.calls == calls:
                raise RuntimeError(f"numatp serve: a forward of shape {tuple(ids.shape)} ran without numatp (Dynamo "
                                   "ran the model eagerly, which would read stale per-socket caches); the engine "
                                   "compiles four shapes only, so another compile of this model in the process used "
                                   "up torch._dynamo.config.recompile_limit")
        return logits[:, -1, :].to(torch.float32)

    @property
    def replayed(self) -> int:
        """Forwards that ran numatp's graph past Dynamo."""
        return self._replayed_before + sum(r.calls for r in self._replays.values())

    def _drop_replays(self) -> None:
        """Every call shape's next forwards through Dynamo, observed anew."""
        self._replayed_before = self.replayed
        self._replays.clear()

    def _through_dynamo(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        """The compiled model's call (under the guard-skip stance where the guards are skipped): its logits."""
        kwargs = {self._cache_arg: cache}
        if self._skip_guards:
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self.compiled(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs,
                                         use_cache=True, logits_to_keep=1).logits
            except RuntimeError as e:
                # something the guards watch changed (an attribute of the model, set by code outside the
                # engine): Dynamo refuses to compile under the stance, before running anything; run this
                # forward, and every later one, under the guards
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
                log.warning("numatp serve: the model changed under Dynamo's guards (%s); guards are checked at "
                            "every step from now on", str(e).splitlines()[0])
                self._skip_guards = False
                self._drop_replays()
        return self.compiled(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs,
                             use_cache=True, logits_to_keep=1).logits

    def _reset(self) -> None:
        """Clock to 0: the cache's lengths (and, through the backend, every socket's copy) reset, no slot owns
        any position. The keys and values stay: no mask row shows them any more, and rewriting them all
        would cost a copy of the whole cache."""
        for layer in self._cache.layers:
            layer.cumulative_length.zero_()
        if self._numatp:
            backend = self._backend()
            if backend is not None:
                backend.reload_states(replicated_only=True)
        self._own.zero_()
        self._t = 0
        self.resets += 1

    def _step(self) -> None:
        """One step boundary: drop cancelled requests, join what fits, else decode one token for every slot."""
        now = time.perf_counter()
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.request._cancelled:
                self._finish(i, "cancelled")
        for r in [r for r in self._waiting if r._cancelled]:
            self._waiting.remove(r)
            self._deliver(r, "done", "cancelled")
        free = [i for i, s in enumerate(self._slots) if s is None]
        active = [i for i, s in enumerate(self._slots) if s is not None]
        try:
            joiners = list(self._waiting)[:len(free)]
            if joiners:
                chunks = max(math.ceil(len(r.prompt) / self.chunk) for r in joiners)
                if self._t + chunks * self.chunk + 1 > self.cache_len:
                    left = max((self._remaining(i) for i in active), default=0)
                    if not active or self._t + left > self.cache_len or left > self.chunk:
                        # waiting for the active sequences would be long: reset now, re-prefill them with the joiners
                        self._join(joiners, active, reset=True)
                        return
                    joiners = []   # drain: the active sequences finish within chunk steps, then the joiners come
                if joiners:
                    self._join(joiners, [])
                    return
            if not active:
                return
            if self._t + 1 > self.cache_len:
                # the cache is full: reset and re-prefill the active sequences (recompute)
                self._join([], active, reset=True)
                return
            self._decode(active, now)
        except Exception as e:   # a failed forward fails the requests in it, never the engine
            log.exception("numatp serve: a forward failed")
            self._drop_replays()
            for i, slot in enumerate(self._slots):
                if slot is not None:
                    self._slots[i] = None
                    slot.request.finish_reason = "error"
                    self._deliver(slot.request, "error", f"{type(e).__name__}: {e}")
            self._reset()

    def _remaining(self, i: int) -> int:
        slot = self._slots[i]
        assert slot is not None
        return slot.request.max_tokens - len(slot.request.generated)

    def _join(self, joiners: list[Request], rejoin: list[int], reset: bool = False) -> None:
        """Prefill ``joiners`` into free slots, and re-prefill the sequences of the active slots ``rejoin``
        (after a ``reset``, all of them)."""
        if reset:
            self._reset()
        free = [i for i, s in enumerate(self._slots) if s is None]
        for _ in joiners:
            self._waiting.popleft()
        self._prefill(list(zip(free, joiners)), [(i, self._slots[i]) for i in rejoin])  # type: ignore[misc]

    def _rows(self, width: int, lo: int = 0) -> tuple[torch.Tensor, list[int]]:
        """The attention mask of a call over the slots ``lo .. lo + width`` (a copy of their rows of the
        positions they own) and the call's rows whose slot is idle."""
        idle = [k for k, s in enumerate(self._slots[lo:lo + width]) if s is None]
        return self._own[lo:lo + width].clone(), idle

    def _width(self, rows: list[int]) -> int:
        """The batch width of a call for the slots ``rows``: 1 where only slot 0 is in use, else all slots."""
        return 1 if self._narrow is not None and rows == [0] else self.max_batch

    def _prefill(self, joiners: list[tuple[int, Request]], rejoin: list[tuple[int, _Slot]]) -> None:
        """Run the joiners' prompts (and the re-joining slots' prompt + tokens so far) as chunks of (B, C),
        or each alone as chunks of (1, C) over its own row where few join (SOLO_JOIN_SHARE), right-aligned
        (runs of LONG_CHUNK chunks as one call); each gets its next token from its last chunk's logits."""
        C = self.chunk
        rows: dict[int, tuple[Request, list[int]]] = {}
        for i, r in joiners:
            rows[i] = (r, list(r.prompt))
            self.metrics.prompt_tokens(len(r.prompt))
        for i, s in rejoin:
            rows[i] = (s.request, list(s.request.prompt) + s.request.generated)
        chunks = max(math.ceil(len(toks) / C) for _, toks in rows.values())
        for i, (r, _) in rows.items():
            self._slots[i] = _Slot(r, 0, 0)   # placeholder: the slot is taken from the first chunk on
            self._own[i].zero_()
        tokens = {i: toks for i, (_, toks) in rows.items()}
        if self._narrow is not None and len(rows) <= max(1, self.max_batch // SOLO_JOIN_SHARE):
            # each row alone at width 1, over the same positions of its own row of the cache
            t0 = self._t
            logits = torch.empty(self.max_batch, self.vocab_size)
            for i in rows:
                self._clock(t0)
                logits[i] = self._chunks({i: tokens[i]}, chunks, i, 1)[0]
                self.alone[i] += 1
        else:
            logits = self._chunks(tokens, chunks, 0, self.max_batch)
        for i, (r, toks) in rows.items():
            self._slots[i] = _Slot(r, len(toks), 0)
        self._sample_and_emit(list(rows), logits, time.perf_counter())

    def _chunks(self, rows: dict[int, list[int]], chunks: int, lo: int, batch: int) -> torch.Tensor:
        """Run ``rows`` (slot -> tokens), right-aligned in ``chunks`` chunks, in calls over the slots
        ``lo .. lo + batch``; the (batch, vocab) logits of the last call."""
        width = chunks * self.chunk
        ids = torch.full((batch, width), self.pad, dtype=torch.long)
        pos = torch.zeros((batch, width), dtype=torch.long)
        real = torch.zeros((batch, width), dtype=torch.bool)
        for i, toks in rows.items():
            ids[i - lo, width - len(toks):] = torch.tensor(toks)
            pos[i - lo, width - len(toks):] = torch.arange(len(toks))
            real[i - lo, width - len(toks):] = True
        logits = None
        for first, n in self._pieces(chunks):
            t, cols = self._t, slice(first, first + n)
            self._own[lo:lo + batch, t:t + n] = real[:, cols].long()
            mask, idle = self._rows(batch, lo)
            mask[idle, t:t + n] = 1   # an idle row sees its own pad tokens (no query without a key)
            # copies in the canonical layout, not .contiguous(): a (1, C) slice of a wider row counts as
            # contiguous with the row's stride, and Dynamo's guards read strides (a new program for it)
            dense = torch.contiguous_format
            logits = self._forward(ids[:, cols].clone(memory_format=dense), mask,
                                   pos[:, cols].clone(memory_format=dense), lo)
        assert logits is not None
        return logits

    def _decode(self, active: list[int], now: float) -> None:
        t = self._t
        batch = self._width(active)
        ids = torch.full((batch, 1), self.pad, dtype=torch.long)
        pos = torch.zeros((batch, 1), dtype=torch.long)
        for i in active:
            slot = self._slots[i]
            assert slot is not None
            ids[i, 0] = slot.last
            pos[i, 0] = slot.next_pos
            self._own[i, t] = 1
        mask, idle = self._rows(batch)
        mask[idle, t] = 1
        self.metrics.occupancy(len(active), self.max_batch)
        logits = self._forward(ids, mask, pos)
        for i in active:
            slot = self._slots[i]
            assert slot is not None
            slot.next_pos += 1
        self._sample_and_emit(active, logits, time.perf_counter())

    def _sample_and_emit(self, rows: list[int], logits: torch.Tensor, now: float) -> None:
        greedy = argmax(logits)
        for i in rows:
            slot = self._slots[i]
            assert slot is not None
            r = slot.request
            if r._generator is not None:
                row = logits[i:i + 1]
                for w in r._warp:
                    row = w(None, row)
                token = int(torch.multinomial(torch.softmax(row, -1), 1, generator=r._generator)[0, 0])
            else:
                token = int(greedy[i])
            slot.last = token
            r.generated.append(token)
            if r._last_token_at is None:
                self.metrics.first_token(now - r.arrived)
            else:
                self.metrics.inter_token(now - r._last_token_at)
            r._last_token_at = now
            self.metrics.generated_tokens(1)
            self._deliver(r, "token", token)
            if token in self.eos and not r.ignore_eos:
                self._finish(i, "stop")
            elif len(r.generated) >= r.max_tokens:
                self._finish(i, "length")

    def _finish(self, i: int, reason: str) -> None:
        slot = self._slots[i]
        assert slot is not None
        self._slots[i] = None
        self._own[i].zero_()
        slot.request.finish_reason = reason
        self.metrics.finished(reason)
        self._deliver(slot.request, "done", reason)

    def _deliver(self, r: Request, kind: str, value: Any) -> None:
        try:
            r.on_event(kind, value)
        except Exception:   # a broken listener (a closed event loop) costs its own request only
            log.exception("numatp serve: a request's listener failed; cancelling it")
            r._cancelled = True

    def _cancel_all(self, reason: str) -> None:
        for i, s in enumerate(self._slots):
            if s is not None:
                self._finish(i, reason)
        with self._lock:
            pending = list(self._waiting) + list(self._inbox)
            self._waiting.clear()
            self._inbox.clear()
        for r in pending:
            self._deliver(r, "done", reason)
