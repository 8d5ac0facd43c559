"""The GEMM provider registry: the kernels numatp can run a weight matmul with, and the shape they run.

A weight matmul of a socket program is ``y (M, N) = x (M, K) @ W (K, N) [+ b]``, with the weight stored
either ``"nk"`` (``nn.Linear``: ``(N, K)``, the graph reads it through ``permute([1, 0])``) or ``"kn"``
(GPT-2 ``Conv1D``). torch ships several kernels for it, and which is fastest depends on the CPU, the
dtype, the shape and the thread count (on an AVX2-only EPYC, an AVX-512 Xeon and an AVX-512 EPYC the
answers differ), so numatp measures them (:mod:`numatp.runtime.gemm.measurement`):

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
- ``amx``: numatp's bf16 kernel on Intel AMX tiles (``amx.cpp``), any rows, on a weight packed once into
  the tiles' layout by ``numatp::amx_pack`` (placed on its node like MKL's): a decode step's 1-16 rows
  stream the packed weight at memory speed where ``gemv``'s dot products fall behind past one row, and a
  prompt's rows run on the same operand (at 0.65-0.85x of oneDNN's packed GEMM, measured at 128-512
  rows), so one copy serves both. On a CPU, build or kernel without AMX-BF16 it fails to prepare (measures 0);
- ``dpbf16``: the same packed layout read with AVX512-BF16 dot products (``amx.cpp``), any rows: a tile
  row of 16 channels x a pair of k is VDPBF16PS's operand against a broadcast pair of x, so up to 8 rows x
  64 channels of sums stay in registers while the weight streams by once (a prompt's rows go 6 at a time,
  each weight row loaded once for 4 blocks); for CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and later,
  Intel Cooper Lake). Measured, one thread of a Zen 5 EPYC, gpt2-medium's 2-socket bf16 shards streamed
  from memory: 31-38 GB/s of weight at 1 row and 27-30 at 8, where ``gemv`` read 21-26 and 12-15 and
  ``onednn_packed`` 20-30 and 17-21; prompts of 32-512 rows near ``onednn_packed`` (321-457 GFLOP/s
  against 365-460), so one copy serves both. Without AVX512-BF16 it fails to prepare (measures 0);
- ``inductor_cpp``: Inductor's C++ GEMM template (max_autotune's CPU kernel) compiled per weight, which
  it blocks and packs as a graph constant; compiling makes it slow to measure, so it runs only when
  ``GemmOptions.providers`` names it.

Quantized weights (:mod:`numatp.runtime.gemm.quant`: a shape's :attr:`GemmShape.weights` names the
format) have providers of their own, which read the quantized shard as it is stored (their operand is
the buffer itself, shared by every such provider of a format) and never a float weight
(:attr:`Provider.weights`, :meth:`Provider.runs`):

- ``qgemv``: numatp's GEMV over int8 and int4 for up to 16 rows (``quant.cpp``): a decode step streams
  the quantized bytes once, fp32 sums, the group's scale applied once per group;
- ``q8dot``: the same GEMV for int8 weights and bf16 activations on AVX512-BF16: the weight widened to bf16
  once for all of a pass's rows (up to 8) and summed by bf16 dot products, two FMAs' work in one; it pays
  where several rows share each widened value (a batch of decode steps), ``qgemv`` where one row reads it;
- ``qtile``: dequantize-per-tile GEMM for any rows: blocks of output channels dequantized into a buffer
  in x's dtype (so for bf16 x the weight is rounded to bf16 first; exact for fp32), then ATen's GEMM;
- ``q8_aten``: ATen's ``_weight_int8pack_mm`` on views into an int8 buffer; the scales are converted to
  x's dtype (rounded to bf16 for bf16 x) and the bias added to its rounded output.

``int8:a8`` and ``int4:gG:a8`` weights (int8 activations too): ``qgemv`` sums the integer products of x's
quantized blocks (VNNI, else AVX2's ``vpmaddubsw``); ``q8dot``, ``qtile``, ``q8_aten`` and ``q_dequant``
multiply x quantized and multiplied back (:func:`~numatp.runtime.gemm.quant.quantize_activations`, in x's
dtype): the table takes ``q8dot`` where several rows make its shared bf16 weight the faster.

Packed weights are opaque tensors (``layout=torch._mkldnn``, oneDNN's) or MKL's buffers (plain float32
tensors, a header then MKL's bytes): a packed provider replaces the plain shard, and compiled segments
call it through ``numatp::linear`` (``ops.cpp``, by its :data:`NATIVE` code; see
:mod:`numatp.plan.gemm_pass`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from numatp.runtime.gemm import quant
from numatp.runtime.gemm.quant import QuantFormat

__all__ = ["GEMV_MAX_ROWS", "IN_PLACE", "NATIVE", "PROVIDERS", "GemmShape", "Provider", "amx_usable", "call_into",
           "dot_usable", "native_code"]

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
    weights outgrow the cache (:func:`numatp.runtime.gemm.measurement.streams`). Timed on a ring of copies
    (:func:`numatp.runtime.gemm.measurement.measure_all`)."""
    weights: str = ""
    """The weight's quantized format (:class:`numatp.runtime.gemm.quant.QuantFormat`'s name: ``"int8"``,
    ``"int4:g64"``); ``""``: the plain weight in ``dtype``. Only providers that read that format run it."""

    @property
    def key(self) -> str:
        return f"{self.dtype}|{self.m}|{self.k}|{self.n}|{self.layout}|t{self.threads}" + \
            (f"|into{self.into}" if self.into else "") + ("|stream" if self.stream else "") + \
            (f"|w={self.weights}" if self.weights else "")

    @classmethod
    def from_key(cls, key: str) -> GemmShape:
        """The shape a table key names (the inverse of :attr:`key`)."""
        dtype, m, k, n, layout, threads, *more = key.split("|")
        into = next((int(f.removeprefix("into")) for f in more if f.startswith("into")), 0)
        weights = next((f.removeprefix("w=") for f in more if f.startswith("w=")), "")
        return cls(int(m), int(k), int(n), dtype, layout, int(threads.removeprefix("t")), into, "stream" in more,
                   weights)

    @property
    def bits(self) -> int | None:
        """The quantized weight's bits (8 or 4), None for a plain weight."""
        return QuantFormat.parse(self.weights).bits if self.weights else None

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def weight_bytes(self) -> int:
        """Bytes of the (K, N) weight: the quantized buffer's (:func:`~numatp.runtime.gemm.quant.nbytes`,
        without zeros) where :attr:`weights` names a format."""
        if self.weights:
            return quant.nbytes(self.n, self.k, self.weights)
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
    prepare: Callable[..., Any]
    """``(w_nk, m)`` or, where ``places``, ``(w_nk, m, node)``; a class (``inductor_cpp``) is a callable too."""
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
    weights: tuple[int, ...] = ()
    """The quantized weights it reads, by bits (8, 4); empty: plain float weights. A quantized provider's
    ``prepare(buf, m)`` gets the quantized shard (:mod:`numatp.runtime.gemm.quant`'s buffer) and returns
    it as it is: every quantized provider of a format shares that one operand."""

    def runs(self, shape: GemmShape) -> bool:
        """Whether it takes ``shape``'s dtype, rows and weights at all (a plain provider no quantized
        weight, a quantized one only its formats' bits)."""
        reads = shape.bits in self.weights if shape.weights else not self.weights
        return reads and getattr(torch, shape.dtype) in self.dtypes and \
            (self.max_rows is None or shape.m <= self.max_rows)


def _aten_call(x, w_nk, bias, n, k):
    return torch.mm(x, w_nk.t()) if bias is None else torch.addmm(bias, x, w_nk.t())


IN_PLACE = ("aten", "mkl_packed")
"""The providers whose kernel writes a gathered matmul's columns of the full tensor itself (ATen's
``mm(..., out=)``, MKL's packed GEMM through ``numatp::linear_into``); the others' outputs are copied."""


def call_into(provider: Provider, x, op, bias, n, k, full: torch.Tensor) -> None:
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


def _quant_prepare(buf, m):
    # the quantized shard itself: read as stored by every quantized provider
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        what = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise ValueError(f"a quantized provider's operand is the quantized shard (a 1-D uint8 buffer of "
                         f"numatp.runtime.gemm.quant.quantize), got {what}; quantize the weight first")
    quant.header(buf)   # raises unless it is one
    from numatp.runtime.native import load_ops
    load_ops()
    return buf


def _quant_call(name):
    def call(x, buf, bias, n, k):
        return torch.ops.numatp.linear(x, buf, bias, NATIVE[name], n, k)
    return call


def _q8dot_prepare(buf, m):
    buf = _quant_prepare(buf, m)
    _require_dot("q8dot")
    if quant.header(buf)["zeros"]:
        raise ValueError("the q8dot provider reads int8 weights without zero points; this one has them: use qgemv")
    return buf


def amx_usable() -> bool:
    """Whether the ``amx`` provider runs here: numatp's library built with AMX-BF16 (a compiler and CPU
    that have it) and a Linux kernel that grants the process the tiles."""
    from numatp.runtime.native import load_ops
    load_ops()
    return bool(torch.ops.numatp.amx_usable())


def _amx_pack(w_nk, m, node=None):
    if not amx_usable():
        raise RuntimeError("the amx provider needs AMX-BF16 tiles (Intel Xeon 4th generation and later, Linux "
                           "5.16+), which this CPU, compiler or kernel does not give; leave it out of "
                           "GemmOptions.providers")
    return torch.ops.numatp.amx_pack(w_nk, -1 if node is None else node)


def _amx_call(x, packed, bias, n, k):
    return torch.ops.numatp.linear(x, packed, bias, NATIVE["amx"], n, k)


def dot_usable() -> bool:
    """Whether the ``dpbf16`` provider runs here: numatp's library built for a CPU with AVX512-BF16."""
    from numatp.runtime.native import load_ops
    load_ops()
    return bool(torch.ops.numatp.dot_usable())


def _require_dot(provider: str) -> None:
    if not dot_usable():
        raise RuntimeError(f"the {provider} provider needs AVX512-BF16 (Intel Cooper Lake, Sapphire Rapids and "
                           "later, AMD Zen 4 and later), which this CPU does not have; leave it out of "
                           "GemmOptions.providers")


def _dot_pack(w_nk, m, node=None):
    _require_dot("dpbf16")
    return torch.ops.numatp.dot_pack(w_nk, -1 if node is None else node)


def _dot_call(x, packed, bias, n, k):
    return torch.ops.numatp.linear(x, packed, bias, NATIVE["dpbf16"], n, k)


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
            self._fn = cast(Callable[..., Any], compile_fx(gm, fake, config_patches=patches))
            # the kernel has its own packed copy; the traced graph's reference to the plain weight would
            # keep a second copy alive
            for name, _ in list(gm.named_buffers()):
                gm.register_buffer(name, torch.empty(0, dtype=w_nk.dtype))
        self._zero = b
        self.shape = (n, k)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self._fn(x, self._zero if bias is None else bias)
        return out[0] if isinstance(out, (tuple, list)) else out


def _dequant_call(x, buf, bias, n, k):
    from numatp.runtime.gemm.quant import dequantize, header, quantize_activations
    if header(buf)["act"]:   # the :a8 formats: the activations as their kernels read them
        x = quantize_activations(x).to(x.dtype)
    w = dequantize(buf, x.dtype)
    return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())


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
    # numatp's kernel on AMX tiles: bf16, a packed copy that replaces the plain weight, any rows
    "amx": Provider("amx", (torch.bfloat16,), True, _amx_pack, _amx_call, places=True),
    "dpbf16": Provider("dpbf16", (torch.bfloat16,), True, _dot_pack, _dot_call, places=True),
    # Inductor's own C++ GEMM template (what max_autotune picks from on CPU); one compile per weight
    # makes it the costliest to measure, so GemmOptions leaves it out unless asked for
    "inductor_cpp": Provider("inductor_cpp", (torch.float32, torch.bfloat16), True, _TemplateGemm,
                             lambda x, op, bias, n, k: op(x, bias), compiles=True),
    # quantized weights (GemmShape.weights): the quantized shard as the operand, shared by all of them
    "qgemv": Provider("qgemv", (torch.float32, torch.bfloat16), False, _quant_prepare, _quant_call("qgemv"),
                      max_rows=GEMV_MAX_ROWS, weights=(8, 4)),
    "q8dot": Provider("q8dot", (torch.bfloat16,), False, _q8dot_prepare, _quant_call("q8dot"),
                      max_rows=GEMV_MAX_ROWS, weights=(8,)),
    "qtile": Provider("qtile", (torch.float32, torch.bfloat16), False, _quant_prepare, _quant_call("qtile"),
                      weights=(8, 4)),
    "q8_aten": Provider("q8_aten", (torch.float32, torch.bfloat16), False, _quant_prepare, _quant_call("q8_aten"),
                        weights=(8,)),
    # quantized weights: the whole weight dequantized to x's dtype, then ATen's matmul; the reference the
    # quantized kernels are measured against
    "q_dequant": Provider("q_dequant", (torch.float32, torch.bfloat16), False, _quant_prepare, _dequant_call,
                          weights=(8, 4)),
}


NATIVE = {"onednn": 0, "onednn_packed": 0, "mkl_packed": 1, "mkl_packed_f32": 2, "gemv": 3, "qgemv": 5,
          "qtile": 6, "q8_aten": 7, "amx": 8, "dpbf16": 9, "q8dot": 10}
"""Providers that ``numatp::linear`` (``ops.cpp``) runs in C++, by its provider code (:func:`native_code`):
a segment calls them without leaving compiled code. The others (``inductor_cpp``) stay a cut of the program."""


def native_code(provider: str, layout: str) -> int:
    """``numatp::linear``'s code for ``provider`` on a weight operand stored in ``layout``: ``gemv`` reads
    the plain weight either way (3 for (N, K), 4 for (K, N)); the others' operands are (N, K) or packed."""
    return NATIVE[provider] + int(provider == "gemv" and layout == "kn")
