"""GEMM providers for weight matmuls, measured per shape and cached on disk per CPU.

A weight matmul of a socket program is ``y (M, N) = x (M, K) @ W (K, N) [+ b]``, with the weight stored
either ``"nk"`` (``nn.Linear``: ``(N, K)``, the graph reads it through ``permute([1, 0])``) or ``"kn"``
(GPT-2 ``Conv1D``). torch ships several kernels for it, and which is fastest depends on the CPU, the
dtype, the shape and the thread count (on an AVX2-only EPYC, an AVX-512 Xeon and an AVX-512 EPYC the
answers differ), so numatp measures them:

- ``aten``: ``torch.mm`` / ``addmm``, what Inductor calls by default (MKL for fp32 on x86);
- ``onednn``: ``mkldnn._linear_pointwise`` on the plain weight;
- ``onednn_packed``: the same op on a weight reordered once by ``mkldnn._reorder_linear_weight``;
- ``mkl_packed``: MKL's packed-B GEMM (``cblas_sgemm_compute``, from the MKL inside torch) on a weight
  packed once by ``numatp::mkl_pack`` (fp32; ``ops.cpp``): like torch's ``mkl._mkl_linear``, but the
  packed weight is a plain tensor (placed and checked page by page like any weight) and the kernel
  writes into the columns of a wider tensor (a gathered LM head) without a copy;
- ``mkl_packed_f32``: for bf16, the same in fp32 on an upcast packed weight (twice the bytes);
- ``gemv``: numatp's own kernel for up to 16 rows (a decode step), on the weight as stored, in C++
  (``gemv.cpp``): it streams the weight once per call, where the others are built for many rows;
- ``inductor_cpp``: Inductor's C++ GEMM template (max_autotune's CPU kernel) compiled per weight, which
  it blocks and packs as a graph constant; compiling makes it slow to measure, so it runs only when
  ``GemmOptions.providers`` names it.

Packed weights are opaque tensors (``layout=torch._mkldnn``, oneDNN's) or MKL's buffers (plain float32
tensors, a header then MKL's bytes): a packed provider replaces
the plain shard, and compiled segments call it through ``numatp::linear`` (``ops.cpp``; see
:mod:`numatp.plan.gemm_pass`). Rates are GFLOP/s (``2 M K N``
per call), keyed by ``(dtype, M, K, N, layout, threads)`` in ``gemm-<cpu signature>-v<format>.json``; the
signature hashes the CPU's model and flags and the torch version, so another CPU re-measures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import torch

from numatp._cache import cache_dir
from numatp.topology.resources import last_level_cache_bytes
from numatp.topology.resources import memory_available as _available_bytes

log = logging.getLogger("numatp")

__all__ = ["Provider", "PROVIDERS", "GemmShape", "GemmTable", "measure", "measure_all", "cpu_signature", "ceilings",
           "ceiling_table", "measure_ceilings", "CEILING_SHAPE", "best_provider", "default_cache_dir", "GEMM_OP",
           "GemmStep", "PackInfo", "gemm", "stand_in", "NATIVE", "native_code", "GEMV_MAX_ROWS", "IN_PLACE",
           "streamed_copies", "streams", "STREAM_MAX_BYTES"]

mkldnn = torch.ops.mkldnn


@dataclass(frozen=True)
class GemmShape:
    """One weight matmul as seen by one socket: ``(M, K) @ (K, N)`` with ``threads`` intra-op threads."""

    m: int
    k: int
    n: int
    dtype: str          # "float32" or "bfloat16"
    layout: str         # "nk" (nn.Linear weight) or "kn" (Conv1D weight)
    threads: int
    into: int = 0
    """Nonzero: the output is gathered into a full tensor of this many columns (a column-parallel LM
    head). Each call then writes its N columns there: ``aten`` and ``mkl_packed`` in place (:data:`IN_PLACE`),
    any other provider by a copy of its own output, so the rates compare what the gather will run."""
    stream: bool = False
    """The weight comes from memory, not cache, at every call: a decode step's few rows in a program whose
    weights outgrow the cache (:func:`streams`). Timed on a ring of copies (:func:`measure_all`)."""

    @property
    def key(self) -> str:
        return f"{self.dtype}|{self.m}|{self.k}|{self.n}|{self.layout}|t{self.threads}" + \
            (f"|into{self.into}" if self.into else "") + ("|stream" if self.stream else "")

    @classmethod
    def from_key(cls, key: str) -> GemmShape:
        """The shape a table key names (the inverse of :attr:`key`)."""
        dtype, m, k, n, layout, threads, *more = key.split("|")
        into = next((int(f.removeprefix("into")) for f in more if f.startswith("into")), 0)
        return cls(int(m), int(k), int(n), dtype, layout, int(threads.removeprefix("t")), into, "stream" in more)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def weight_bytes(self) -> int:
        """Bytes of the (K, N) weight."""
        return self.k * self.n * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Provider:
    """A way to compute ``x @ W + b``: ``prepare`` makes the operand kept per socket, ``call`` runs it.

    ``prepare(w_nk, m)`` gets the weight as an ``(N, K)`` tensor (a view for "kn" weights) and the
    number of rows it will be called with; ``call(x, operand, bias, n, k)`` returns ``(M, N)``.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    packed: bool        # the operand is a packed copy (opaque, or MKL's buffer) that replaces the plain weight
    prepare: Callable[..., Any]   # (w_nk, m), and the node where ``places``: a tensor, or a kernel object
    call: Callable[..., torch.Tensor]
    compiles: bool = False
    """``prepare`` compiles a kernel (seconds per weight): measured only when asked for, without a probe."""
    max_rows: int | None = None
    """The most rows of ``x`` it takes (``None``: any); a shape with more measures 0."""
    places: bool = False
    """``prepare(w_nk, m, node)`` allocates the operand on memory node ``node`` itself (None: anywhere),
    instead of leaving that to a copy (MKL's packed buffer, part of which its packing never writes)."""
    keeps_plain: tuple[str, ...] = ()
    """Layouts whose plain weight is the operand as it is (no copy, no packing), so that this provider
    and another such one can share the weight: one for a prompt's many rows, one for a decode step's few."""

    def runs(self, shape: GemmShape) -> bool:
        """Whether it takes ``shape``'s dtype and rows at all."""
        return getattr(torch, shape.dtype) in self.dtypes and (self.max_rows is None or shape.m <= self.max_rows)


def _aten_call(x, w_nk, bias, n, k):
    return torch.mm(x, w_nk.t()) if bias is None else torch.addmm(bias, x, w_nk.t())


IN_PLACE = ("aten", "mkl_packed")
"""The providers whose kernel writes a gathered matmul's columns of the full tensor itself (ATen's
``mm(..., out=)``, MKL's packed GEMM through ``numatp::linear_into``); the others' outputs are copied."""


def _call_into(provider: Provider, x, op, bias, n, k, full: torch.Tensor) -> None:
    """One call of a gathered matmul (``GemmShape.into``): its columns of ``full`` written in place by the
    :data:`IN_PLACE` providers, by a copy of the output otherwise (as
    ``numatp.runtime.segments.GatheredMatmul`` and the gather run)."""
    cols = full[:, :n]
    if provider.name == "aten":
        torch.mm(x, op.t(), out=cols) if bias is None else torch.addmm(bias, x, op.t(), out=cols)
    elif provider.name in IN_PLACE:   # a native kernel that takes the output's row stride
        torch.ops.numatp.linear_into(x, op, bias, NATIVE[provider.name], n, k, cols)
    else:
        cols.copy_(provider.call(x, op, bias, n, k))


def _onednn_call(x, w, bias, n, k):
    return mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def _mkl_pack(w_nk, m, node=None):
    from numatp.runtime.native import load_ops
    load_ops()
    return torch.ops.numatp.mkl_pack(w_nk.contiguous(), m, -1 if node is None else node)


def _mkl_call(x, packed, bias, n, k):
    return torch.ops.numatp.linear(x, packed, bias, NATIVE["mkl_packed"], n, k)


GEMV_MAX_ROWS = 16
"""The most rows ``gemv`` takes (as ``kGemvMaxRows`` in ``ops.cpp``); more are left to the GEMM providers."""


def _gemv_prepare(w_nk, m):
    # the weight as stored, (N, K) or the transposed view of a (K, N) one: the kernel reads either
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"gemv runs up to {GEMV_MAX_ROWS} rows, not {m}")
    from numatp.runtime.native import load_ops
    load_ops()
    return w_nk


def _gemv_call(x, w_nk, bias, n, k):
    if w_nk.is_contiguous():
        return torch.ops.numatp.linear(x, w_nk, bias, native_code("gemv", "nk"), n, k)
    return torch.ops.numatp.linear(x, w_nk.t(), bias, native_code("gemv", "kn"), n, k)


def _upcast_pack(w_nk, m, node=None):
    return _mkl_pack(w_nk.float(), m, node)


def _upcast_call(x, packed, bias, n, k):
    return _mkl_call(x.float(), packed, None if bias is None else bias.float(), n, k).to(x.dtype)


_TRACE_LOCK = threading.Lock()


class _TemplateGemm:
    """``x @ W^T + b`` compiled by Inductor's C++ GEMM template for one weight, any number of rows.

    The weight enters the traced graph as a constant, which is what the template needs to block and
    pack it at compile time; the graph is traced with a symbolic row count, so one compile serves every
    M. Compiled on the calling thread for its thread count (a socket worker, so the packed constant is
    made under the socket's memory binding); the plain weight is not kept once compiled.
    """

    def __init__(self, w_nk: torch.Tensor, m: int):
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx

        n, k = w_nk.shape
        self.dtype = w_nk.dtype
        weight = w_nk.contiguous()

        def linear(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return torch.addmm(bias, x, weight.t())

        # traced at a row count equal to neither K nor N: equal sizes would share one symbol, which the
        # weight's fixed K or N would then pin to a constant
        rows = next(r for r in range(17, 17 + 3) if r not in (k, n))
        x = torch.zeros(rows, k, dtype=w_nk.dtype)
        b = torch.zeros(n, dtype=w_nk.dtype)
        # tracing patches module globals: one socket's worker at a time
        with _TRACE_LOCK, torch.no_grad():
            gm = make_fx(linear, tracing_mode="symbolic", _allow_non_fake_inputs=True)(x, b)
            fake = [node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"]
            fake[0].fake_mode.allow_non_fake_inputs = True  # the weight is a real constant of the graph
            # no FX graph cache: measured here, a bf16 kernel compiled for another weight of the same
            # shape came back from it with that weight's values
            patches = {"max_autotune": True, "max_autotune_gemm_backends": "CPP", "fx_graph_cache": False,
                       "cpp.threads": torch.get_num_threads(), "freezing": True}
            # compile_fx returns a callable here (file names only when compiling ahead of time)
            self._fn: Callable[..., Any] = compile_fx(gm, fake, config_patches=patches)  # type: ignore[assignment]
            # the kernel has its own packed copy; the traced graph's reference to the plain weight would
            # keep a second copy alive
            for name, _ in list(gm.named_buffers()):
                gm.register_buffer(name, torch.empty(0, dtype=w_nk.dtype))
        self._zero = b
        self.shape = (n, k)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self._fn(x, self._zero if bias is None else bias)
        return out[0] if isinstance(out, (tuple, list)) else out


PROVIDERS: dict[str, Provider] = {
    "aten": Provider("aten", (torch.float32, torch.bfloat16), False, lambda w, m: w, _aten_call,
                     keeps_plain=("nk", "kn")),
    # oneDNN's linear takes a contiguous (N, K) weight: a Conv1D (K, N) weight gets a transposed copy
    # that replaces the plain one
    "onednn": Provider("onednn", (torch.float32, torch.bfloat16), False, lambda w, m: w.contiguous(),
                       _onednn_call, keeps_plain=("nk",)),
    "onednn_packed": Provider("onednn_packed", (torch.float32, torch.bfloat16), True,
                              lambda w, m: mkldnn._reorder_linear_weight(w.contiguous(), m), _onednn_call),
    "mkl_packed": Provider("mkl_packed", (torch.float32,), True, _mkl_pack, _mkl_call, places=True),
    # bf16 in and out, fp32 MKL on an fp32 packed weight: for CPUs without bf16 GEMM instructions
    # (AVX2), where torch's bf16 matmul falls back to slow loops. Its operand has twice the bf16 bytes.
    "mkl_packed_f32": Provider("mkl_packed_f32", (torch.bfloat16,), True, _upcast_pack, _upcast_call,
                               places=True),
    # numatp's kernel for decode steps: the plain weight, either layout, no copy
    "gemv": Provider("gemv", (torch.float32, torch.bfloat16), False, _gemv_prepare, _gemv_call,
                     max_rows=GEMV_MAX_ROWS, keeps_plain=("nk", "kn")),
    # Inductor's own C++ GEMM template (what max_autotune picks from on CPU); one compile per weight
    # makes it the costliest to measure, so GemmOptions leaves it out unless asked for
    "inductor_cpp": Provider("inductor_cpp", (torch.float32, torch.bfloat16), True, _TemplateGemm,
                             lambda x, op, bias, n, k: op(x, bias), compiles=True),
}


def measure(provider: Provider, shape: GemmShape, *, min_seconds: float = 0.15, max_calls: int = 20,
            seed: int = 0, max_call_seconds: float = 5.0) -> float:
    """GFLOP/s of ``provider`` at ``shape`` on the calling thread (its thread count and pinning).

    One warm-up call, then calls until ``min_seconds`` or ``max_calls``; the median time counts. Returns
    0.0 where the provider does not support the dtype or the CPU (e.g. oneDNN bf16 reorders need
    AVX-512 or AVX-NE-CONVERT). A provider that a 32-row probe shows would take over ``max_call_seconds``
    per call (torch's reference bf16 loops on AVX2 run near 1 GFLOP/s) gets the probe's rate instead.
    """
    return measure_all({provider.name: provider}, shape, min_seconds=min_seconds, max_calls=max_calls,
                       seed=seed, max_call_seconds=max_call_seconds)[provider.name]


def measure_all(providers: dict[str, Provider], shape: GemmShape, *, min_seconds: float = 0.15,
                max_calls: int = 20, seed: int = 0, max_call_seconds: float = 5.0) -> dict[str, float]:
    """GFLOP/s of each provider at ``shape``, as :func:`measure`, timed in rounds: every round calls each
    provider once, so a change of load on the machine slows all of them alike and the comparison that
    picks one stays fair. Rounds go on until each provider has had ``min_seconds`` or ``max_calls``.

    A :attr:`GemmShape.stream` shape (a decode step's few rows, its weight read from memory at every call
    as a decode step reads every weight in turn) would sit in cache if timed on one weight, and the rate
    would be the cache's: each call reads the next of a ring of copies past the last-level cache
    (:func:`streamed_copies`). Each copy is prepared apart, as a program's own operand is, and a
    prepared copy's speed may depend on where it was allocated (measured on an AVX-512/AMX Xeon, one
    thread, a 1 x 1024 x 25128 bf16 LM head: six oneDNN-packed copies of one weight in one process ran at
    4.2-4.8 or 10.7-11.7 GFLOP/s, copy by copy, where numatp's gemv on the plain weight ran at 8.2-9.1);
    a program reads one copy, whichever it got, so a streamed rate is the mean over the copies of each
    copy's median time: the time the program can expect, not the luckiest copy's."""
    dtype = getattr(torch, shape.dtype)
    rates: dict[str, float] = {name: 0.0 for name in providers}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.m, shape.k, generator=g).to(dtype)
    w = torch.randn(shape.n, shape.k, generator=g).to(dtype) if shape.layout == "nk" else \
        torch.randn(shape.k, shape.n, generator=g).to(dtype).t()
    bias = torch.randn(shape.n, generator=g).to(dtype)
    copies = streamed_copies(shape)
    ring = [w] + [w.clone() if shape.layout == "nk" else w.t().clone().t() for _ in range(copies - 1)]
    timed: dict[str, tuple[Provider, list[torch.Tensor]]] = {}
    with torch.inference_mode():
        for name, provider in providers.items():
            if not provider.runs(shape):
                continue
            if shape.m > 32 and not provider.compiles:
                probe = GemmShape(32, shape.k, shape.n, shape.dtype, shape.layout, shape.threads)
                rate = measure(provider, probe, min_seconds=0.0, max_calls=1, seed=seed)
                if rate == 0.0 or shape.flops / (rate * 1e9) > max_call_seconds:
                    rates[name] = rate
                    continue
            try:
                ops = [provider.prepare(c, shape.m) for c in ring]
                provider.call(x, ops[0], bias, shape.n, shape.k)
            except Exception as e:  # noqa: BLE001  (a kernel this CPU or torch cannot run measures 0)
                log.debug("numatp: GEMM provider %s cannot run %s: %s", name, shape.key, e)
                continue
            timed[name] = (provider, ops)
        by_copy: dict[str, dict[int, list[float]]] = {name: {} for name in timed}   # call times per copy
        made = dict.fromkeys(timed, 0)
        spent = dict.fromkeys(timed, 0.0)
        # providers that read the plain weight share the ring's copies: each starts at its own place in
        # it, so none reads a copy another has just brought into cache
        start = {name: i * len(ring) // len(timed) for i, name in enumerate(timed)}
        calls = 0
        while timed and any(made[n] < max_calls and (made[n] < 2 or spent[n] < min_seconds)
                            for n in timed):
            calls += 1
            for name, (provider, ops) in timed.items():
                if made[name] >= max_calls:
                    continue
                at = (start[name] + calls) % len(ops)
                op = ops[at]
                t0 = time.perf_counter()
                if shape.into:   # a fresh full tensor per call, as per gather: its pages fault in
                    _call_into(provider, x, op, bias, shape.n, shape.k, x.new_empty(shape.m, shape.into))
                else:
                    provider.call(x, op, bias, shape.n, shape.k)
                dt = time.perf_counter() - t0
                by_copy[name].setdefault(at, []).append(dt)
                made[name] += 1
                spent[name] += dt
    for name, per_copy in by_copy.items():
        rates[name] = shape.flops / statistics.fmean(statistics.median(ts) for ts in per_copy.values()) / 1e9
    return rates


STREAM_MAX_BYTES = 512 << 20
"""The most weight bytes in :func:`measure_all`'s ring of copies (:func:`streamed_copies`); each packed
provider holds its own ring while the shape is measured (MKL's fp32 one for bf16, twice the bytes)."""


def streams(m: int, weight_bytes: int) -> bool:
    """Whether a matmul of ``m`` rows in a program reading ``weight_bytes`` of weights per call takes its
    weight from memory: few rows (at most ``GEMV_MAX_ROWS``: nothing reuses a weight within the call) and
    weights past a quarter of the last-level cache (between two reads of one weight, all the others pass
    through; a quarter, not all, because a cache shared with other cores and tenants keeps less than its
    size, and a virtual machine may report the host's)."""
    return m <= GEMV_MAX_ROWS and weight_bytes > last_level_cache_bytes() // 4


def streamed_copies(shape: GemmShape) -> int:
    """How many copies of the weight :func:`measure_all` cycles through at ``shape``: 1 unless it streams;
    else enough to pass twice the last-level cache, within :data:`STREAM_MAX_BYTES`, 1/32 of the memory
    available now (every provider holds a ring, and every socket measures at once), and 1024 copies."""
    if not shape.stream:
        return 1
    free = _available_bytes()
    want = min(2 * last_level_cache_bytes(), STREAM_MAX_BYTES, STREAM_MAX_BYTES if free is None else free // 32)
    return max(1, min(1024, -(-want // max(shape.weight_bytes, 1))))


def cpu_signature() -> str:
    """A short hash of this CPU (vendor, family, model, model name, flags) and the torch build."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                k, _, v = line.partition(":")
                if k.strip() in ("vendor_id", "cpu family", "model", "model name", "flags"):
                    fields[k.strip()] = v.strip()
    except OSError:
        import platform
        fields["machine"] = platform.processor() or platform.machine()
    fields["torch"] = torch.__version__
    fields["mkldnn"] = str(torch.backends.mkldnn.is_available())
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


default_cache_dir = cache_dir  # ``~/.cache/numatp``, or as numatp._cache.cache_dir says


TABLE_FORMAT = 4
"""Part of the table's file name: a change of how rates are measured starts a new table (2: shapes of
few rows are timed streaming their weight; 3: a streamed rate is the mean over the ring's copies, see
:func:`measure_all`; 4: ``mkl_packed`` writes a gathered matmul's columns in place), so no choice
compares rates taken one way against rates taken the other."""


class GemmTable:
    """The measured rates of this CPU: ``{shape key: {provider: GFLOP/s}}`` in one JSON file.

    Writes go to a temporary file renamed over the old one, so a reader never sees half a file; entries
    of other processes written since the load are merged in, not overwritten.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None):
        self.path = Path(cache_dir or default_cache_dir()) / f"gemm-{cpu_signature()}-v{TABLE_FORMAT}.json"
        self._lock = threading.Lock()
        self.entries: dict[str, dict[str, float]] = self._read()
        self.measured = 0   # shapes measured by this table (not served from the file)

    def _read(self) -> dict[str, dict[str, float]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data.get("rates", {}) if isinstance(data, dict) else {}

    def get(self, shape: GemmShape) -> dict[str, float] | None:
        with self._lock:
            return self.entries.get(shape.key)

    def put(self, results: dict[GemmShape, dict[str, float]]) -> None:
        with self._lock:
            self.measured += len(results)
            merged = self._read()
            merged.update(self.entries)
            merged.update({s.key: r for s, r in results.items()})
            self.entries = merged
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".gemm-", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"cpu": cpu_signature(), "unit": "GFLOP/s", "rates": merged}, f, indent=1,
                          sort_keys=True)
            os.replace(tmp, self.path)

    def measure_missing(self, shapes: list[GemmShape], providers: list[str], *,
                        again: Collection[GemmShape] = ()) -> dict[GemmShape, dict[str, float]]:
        """Measure on the calling thread the shapes (or providers) not in the table, and those in ``again``
        whatever the table holds; returns the new rates."""
        out: dict[GemmShape, dict[str, float]] = {}
        for s in dict.fromkeys(shapes):
            have = {} if s in again else (self.get(s) or {})
            todo = [p for p in providers if p not in have]
            if todo:
                found = measure_all({p: PROVIDERS[p] for p in todo}, s)
                out[s] = {**have, **{p: round(r, 2) for p, r in found.items()}}
        return out


def ceilings(dtype: str | torch.dtype, *, cache_dir: str | os.PathLike | None = None,
             threads: int | None = None) -> dict[str, float]:
    """Best measured GFLOP/s per provider for ``dtype`` on this CPU (optionally at one thread count).

    Read from the on-disk table that compiling and ``benchmarks/gemm_providers.py`` fill; empty when
    nothing was measured yet. This is the GEMM roofline ``numatp explain`` and ``calibrate`` report.
    """
    by_threads = ceiling_table(cache_dir=cache_dir).get(str(dtype).removeprefix("torch."), {})
    best: dict[str, float] = {}
    for t, rates in by_threads.items():
        if threads is None or t == threads:
            for p, r in rates.items():
                best[p] = max(best.get(p, 0.0), r)
    return best


def ceiling_table(*, cache_dir: str | os.PathLike | None = None) -> dict[str, dict[int, dict[str, float]]]:
    """Best measured GFLOP/s per dtype, thread count and provider: ``{dtype: {threads: {provider: rate}}}``.
    Shapes timed into a gathered tensor (``GemmShape.into``: a strided write, or a copy) are left out."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for key, rates in GemmTable(cache_dir).entries.items():
        shape = GemmShape.from_key(key)
        if shape.into:
            continue
        best = out.setdefault(shape.dtype, {}).setdefault(shape.threads, {})
        for p, r in rates.items():
            best[p] = max(best.get(p, 0.0), r)
    return out


CEILING_SHAPE = (512, 1024, 4096)
"""``(M, K, N)`` at which ``measure_ceilings`` times every provider: a 512-token prefill through a
1024 -> 4096 weight (GPT-2 medium's MLP up-projection), large enough for each kernel's steady rate."""


def measure_ceilings(threads: int, dtypes: tuple[str, ...] = ("float32", "bfloat16"), *,
                     cache_dir: str | os.PathLike | None = None,
                     progress: Callable[[str], None] = lambda _: None) -> dict[str, dict[str, float]]:
    """Every provider's GFLOP/s at ``CEILING_SHAPE`` per dtype, on the calling thread, which must run
    ``threads`` torch threads pinned where they should be measured; the rates join the on-disk table.
    A provider that cannot run the dtype here reports 0.0; one slower than a second per call (torch's
    bf16 loops on CPUs without bf16 instructions) is timed on a 32-row probe instead."""
    m, k, n = CEILING_SHAPE
    found: dict[GemmShape, dict[str, float]] = {}
    for dt in dtypes:
        shape = GemmShape(m, k, n, dt, "kn", threads)
        progress(f"GEMM providers, {dt}, {m} x {k} x {n}, {threads} threads")
        found[shape] = {name: round(r, 2) for name, r in measure_all(PROVIDERS, shape, max_call_seconds=1.0).items()}
    GemmTable(cache_dir).put(found)
    return {s.dtype: r for s, r in found.items()}


def best_provider(rates: dict[str, float], allowed: list[str], *, margin: float = 1.05) -> str:
    """The fastest allowed provider; ``aten`` (the unchanged graph) unless another beats it by ``margin``."""
    base = rates.get("aten", 0.0)
    name, rate = max(((p, rates.get(p, 0.0)) for p in allowed), key=lambda pr: pr[1])
    return name if name != "aten" and rate > base * margin else "aten"


# The rewritten programs' GEMM call (numatp.plan.gemm_pass puts it there) and the executor's step for it

@torch.library.custom_op("numatp::gemm", mutates_args=())
def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, provider: str, layout: str) -> torch.Tensor:
    """``x @ W (+ bias)`` by ``provider``; ``layout`` says how ``w`` is stored ("nk" or "kn").

    The runtime calls the provider directly (its operand may be packed); this body is the reference
    for running a rewritten program outside numatp's executor, on the plain weight.
    """
    w_kn = w.t() if layout == "nk" else w
    return torch.mm(x, w_kn) if bias is None else torch.addmm(bias, x, w_kn)


@gemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, provider: str, layout: str) -> torch.Tensor:
    n = w.shape[0] if layout == "nk" else w.shape[1]
    return x.new_empty((x.shape[0], n))


GEMM_OP = torch.ops.numatp.gemm.default

NATIVE = {"onednn": 0, "onednn_packed": 0, "mkl_packed": 1, "mkl_packed_f32": 2, "gemv": 3}
"""Providers that ``numatp::linear`` (``ops.cpp``) runs in C++, by its provider code (:func:`native_code`):
a segment calls them without leaving compiled code. The others (``inductor_cpp``) stay a cut of the program."""


def native_code(provider: str, layout: str) -> int:
    """``numatp::linear``'s code for ``provider`` on a weight operand stored in ``layout``: ``gemv`` reads
    the plain weight either way (3 for (N, K), 4 for (K, N)); the others' operands are (N, K) or packed."""
    return NATIVE[provider] + int(provider == "gemv" and layout == "kn")


@dataclass(frozen=True)
class PackInfo:
    """What a prepared operand is: its provider, the plain weight's shape/dtype/layout, the M it was packed for.

    ``plain`` and ``later``: where the operand is a second copy made for a prompt's rows (see
    ``GemmOptions.decode_copies``), the plain weight it was made from, kept for the decode steps, and the
    provider that reads it there; otherwise None."""

    provider: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    m: int
    plain: Any = field(default=None, compare=False, repr=False)
    later: str | None = None


@dataclass
class GemmStep:
    """A weight matmul the executor runs itself: ``env[dst] = provider(env[x], env[w], env[bias])``."""

    provider: str
    x: str
    w: str
    bias: str | None
    dst: str
    n: int
    k: int

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.w] + ([self.bias] if self.bias else [])

    def __call__(self, env: dict[str, Any]) -> torch.Tensor:
        b = env[self.bias] if self.bias else None
        return PROVIDERS[self.provider].call(env[self.x], env[self.w], b, self.n, self.k)


def stand_in(t: Any) -> Any:
    """A dense tensor of a prepared operand's plain shape, for shape propagation (no storage of its size)."""
    info = getattr(t, "_numatp_gemm", None)
    if info is None:
        return t
    return torch.empty(1, dtype=info.dtype).expand(info.shape)
