"""Quantized weights: the formats numatp stores a weight shard in, and the one buffer that holds it.

A decode step reads every weight once per token, so its time is the weights' bytes over the memory's
bandwidth; int8 weights read half of bf16's bytes, int4 about a quarter. numatp quantizes each weight
matmul's shard on its own socket, after sharding (weight-only, activations staying in the model's dtype,
but for the ``:a8`` formats):

- ``int8``: symmetric, one scale per output channel: ``w[n, k] = q[n, k] * s[n]``; numatp's quantizer
  takes ``s = max_k |w[n, k]| / 127`` and ``q`` in [-127, 127] (values made elsewhere may hold -128).
- ``int8:a8`` (and ``int4:gG:a8``): the weights as ``int8`` (``int4:gG``), and the activations quantized
  too, as each matmul reads them:
  every row of x in blocks of 32 along the input dimension, ``d = max |x| / 127`` and ``qx = round(x / d)``
  (to nearest, ties to even; :func:`quantize_activations`), so that a decode step's products are integer
  dot products (one VNNI instruction per 64 weight bytes), each block's sum scaled by its ``d`` in
  float32. llama.cpp's Q8_0 quantizes the activations of its dot products so (blocks of 32). Not
  weight-only: the model's activations lose the bits int8 cannot hold (see docs/quantization.md); a
  shard's input size must be a multiple of 32, so that the blocks are the same at every socket count.
- ``int4:gG`` (G = 32, 64 or 128; ``int4`` is ``int4:g64``): groups of G along the input dimension, one
  scale per group and output channel: ``w[n, k] = (q[n, k] - 8) * s[n, k // G] (+ z[n, k // G])``,
  ``q`` in [0, 15]. numatp's own quantizer is symmetric (no ``z``), as llama.cpp's Q4_0: the group's
  value of largest magnitude ``m`` maps to ``q = 0`` (``s = m / -8``). Values made elsewhere (torchao's
  int4, asymmetric) carry a zero ``z`` per group, in the float domain.

A quantized shard is one flat ``uint8`` tensor (so that it is placed on its socket's node, checked page
by page and handed around like any operand), in sections aligned to 64 bytes:

=========  ===========================================================================================
header     16 int64: magic, version, bits (8 or 4), N, K, group (K for int8), has zeros, the byte
           offsets of ``q``, the scales and the zeros (0: none), ``q``'s bytes, the total, and the
           activations' bits (8: the ``:a8`` formats, 0: weight-only)
``q``      int8: ``(N, K)`` int8, row-major. int4: ``(N, K / 2)`` bytes; per block of 32 values of a
           row, byte ``i`` (0-15) holds value ``i`` in its low nibble and value ``i + 16`` in its high
           nibble (llama.cpp's Q4_0 order: a vector of bytes unpacks into two runs of values with one AND
           and one shift)
scales     ``(N, K / group)`` float32
zeros      ``(N, K / group)`` float32, where present
=========  ===========================================================================================

The kernels that read it are in ``quant.cpp`` (``numatp::linear``'s quantized provider codes); this module
makes buffers, reads them back and dequantizes them (the reference every kernel is tested against).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ACT_BLOCK", "DEFAULT_INT4_GROUP", "GROUPS", "MAGIC", "QuantFormat", "QuantValues", "dequantize",
           "from_values", "header", "nbytes", "qembedding", "qembedding_op", "quantize", "quantize_activations",
           "unpack", "views"]

MAGIC = 0x5150544E   # "NTPQ"
VERSION = 1
GROUPS = (32, 64, 128)
DEFAULT_INT4_GROUP = 64
ACT_BLOCK = 32   # the :a8 formats: the activations' values per scale, along the input dimension
_HEADER = 128
_ALIGN = 64


@dataclass(frozen=True)
class QuantFormat:
    """How a weight is stored: ``bits`` 8 (per output channel) or 4 (groups of ``group`` along K); ``act``
    8 where the activations are quantized too (``int8:a8``, ``int4:gG:a8``), None for weight-only."""

    bits: int
    group: int | None = None
    act: int | None = None

    def __post_init__(self) -> None:
        if self.act is not None and self.act != 8:
            raise ValueError(f"activations are quantized to 8 bits ('int8:a8', 'int4:gG:a8'), not {self.act}")
        if self.bits == 8 and self.group is not None:
            raise ValueError(f"int8 weights take one scale per output channel, not groups (group={self.group})")
        if self.bits == 4 and self.group not in GROUPS:
            raise ValueError(f"int4 weights are quantized in groups of {', '.join(map(str, GROUPS))} along the "
                             f"input dimension, not {self.group}; e.g. 'int4:g{DEFAULT_INT4_GROUP}'")
        if self.bits not in (4, 8):
            raise ValueError(f"numatp stores weights in int8 or int4, not {self.bits} bits")

    @classmethod
    def parse(cls, spec: str | QuantFormat) -> QuantFormat:
        """``"int8"``, ``"int4"`` (groups of :data:`DEFAULT_INT4_GROUP`) or ``"int4:g32"``/``g64``/``g128``;
        ``":a8"`` after any of them quantizes the activations too (``"int8:a8"``, ``"int4:a8"``)."""
        if isinstance(spec, QuantFormat):
            return spec
        m = re.fullmatch(r"\s*int(8|4)(?::g(\d+))?(?::a(\d+))?\s*", str(spec).lower())
        if m is None:
            raise ValueError(f"weights={spec!r}: the quantized formats are 'int8' (one scale per output channel) "
                             f"and 'int4' or 'int4:gG' with G in {GROUPS} (groups along the input dimension; 'int4' "
                             f"is 'int4:g{DEFAULT_INT4_GROUP}'), each with ':a8' for int8 activations too (blocks of "
                             f"{ACT_BLOCK}: 'int8:a8', 'int4:a8'); None keeps the model's dtype")
        bits = int(m[1])
        if bits == 8 and m[2]:
            raise ValueError(f"weights={spec!r}: int8 takes one scale per output channel, no group; use 'int8'")
        if m[3] and m[3] != "8":
            raise ValueError(f"weights={spec!r}: numatp quantizes activations to int8 (':a8'), not to {m[3]} bits")
        return cls(bits, int(m[2]) if m[2] else (DEFAULT_INT4_GROUP if bits == 4 else None),
                   8 if m[3] else None)

    @property
    def name(self) -> str:
        return ("int8" if self.bits == 8 else f"int4:g{self.group}") + (":a8" if self.act else "")

    def __str__(self) -> str:
        return self.name

    def groups(self, k: int) -> int:
        """Scales per output channel for an input size ``k``."""
        return 1 if self.bits == 8 else k // int(self.group or 1)

    def fits(self, k: int) -> bool:
        """Whether a shard of input size ``k`` divides into whole groups (int8: any; with ``:a8``, whole blocks of
        :data:`ACT_BLOCK` too)."""
        if self.act and k % ACT_BLOCK:
            return False
        return self.bits == 8 or k % int(self.group or 1) == 0

    def fitting_groups(self, k: int) -> list[int]:
        """The group sizes that divide ``k`` (for an error that says which would fit)."""
        return [g for g in GROUPS if k % g == 0]

    def misfit(self, k: int) -> str | None:
        """Why a shard of input size ``k`` cannot take this format and what would (None where it can)."""
        if self.fits(k):
            return None
        if self.bits == 8:
            return (f"not a multiple of the activations' blocks of {ACT_BLOCK} ({self}); use 'int8' "
                    f"(weight-only) for this model")
        fit = self.fitting_groups(k)
        a8 = ":a8" if self.act else ""
        return (f"not a multiple of the int4 group {self.group}; "
                + (f"groups that fit: {', '.join(f'int4:g{g}{a8}' for g in fit)}" if fit
                   else f"no int4 group (32, 64, 128) divides it: use 'int8{a8}'"))


@dataclass
class QuantValues:
    """A buffer's contents, unpacked: ``q`` as ``(N, K)`` int16 (int8: -127..127, int4: 0..15), scales and
    zeros ``(N, K / group)`` float32 (zeros None where absent)."""

    fmt: QuantFormat
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        g = k // self.scales.shape[1]
        q = self.q.to(torch.float32)
        if self.fmt.bits == 4:
            q = q - 8
        w = q.view(n, k // g, g) * self.scales.unsqueeze(-1)
        if self.zeros is not None:
            w = w + self.zeros.unsqueeze(-1)
        return w.reshape(n, k).to(dtype)


def _align(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


def _layout(n: int, k: int, fmt: QuantFormat, zeros: bool) -> tuple[int, int, int, int, int]:
    """Byte offsets of q, scales, zeros (0: none), the q bytes and the total size."""
    q_bytes = n * k if fmt.bits == 8 else n * k // 2
    s_off = _align(_HEADER + q_bytes)
    s_bytes = n * fmt.groups(k) * 4
    z_off = _align(s_off + s_bytes) if zeros else 0
    total = _align((z_off or s_off) + s_bytes)
    return _HEADER, s_off, z_off, q_bytes, total


def nbytes(n: int, k: int, fmt: QuantFormat | str, zeros: bool = False) -> int:
    """The size of the buffer of an ``(N, K)`` weight in ``fmt``."""
    return _layout(n, k, QuantFormat.parse(fmt), zeros)[4]


def _check_shape(n: int, k: int, fmt: QuantFormat, what: str = "the weight") -> None:
    why = fmt.misfit(k)
    if why:
        raise ValueError(f"{what} has an input size of {k}, {why}")


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` values 0..15 -> ``(N, K / 2)`` bytes in blocks of 32 (value i low, i + 16 high)."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (b[:, :, 0, :] | (b[:, :, 1, :] << 4)).reshape(n, k // 2)


def _unpack4(packed: torch.Tensor, k: int) -> torch.Tensor:
    n = packed.shape[0]
    b = packed.view(n, k // 32, 16)
    return torch.stack([b & 0xF, b >> 4], dim=2).reshape(n, k).to(torch.int16)


def from_values(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: QuantFormat | str,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The buffer holding ``q`` (``(N, K)`` integers in the format's range), ``scales`` and ``zeros``
    (``(N, K / group)``, any float dtype: stored as float32), written into ``out`` where given (a buffer
    of :func:`nbytes` allocated where it should live) or a new tensor."""
    fmt = QuantFormat.parse(fmt)
    n, k = q.shape
    _check_shape(n, k, fmt)
    g = fmt.groups(k)
    scales = scales.reshape(n, g)
    lo, hi = (-128, 127) if fmt.bits == 8 else (0, 15)   # numatp's quantizer keeps to -127..127; torchao's not
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{fmt} values must lie in [{lo}, {hi}], got [{int(q.min())}, {int(q.max())}]")
    q_off, s_off, z_off, q_bytes, total = _layout(n, k, fmt, zeros is not None)
    buf = torch.zeros(total, dtype=torch.uint8) if out is None else out
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != total or not buf.is_contiguous():
        raise ValueError(f"the buffer for a {n} x {k} {fmt} weight is a contiguous uint8 tensor of {total} bytes, "
                         f"got {buf.dtype} {tuple(buf.shape)}")
    if fmt.act and zeros is not None:
        raise ValueError(f"{fmt} weights have no zero points (int8 activations need a symmetric weight)")
    head = torch.tensor([MAGIC, VERSION, fmt.bits, n, k, fmt.group or k, int(zeros is not None),
                         q_off, s_off, z_off, q_bytes, total, fmt.act or 0, 0, 0, 0], dtype=torch.int64)
    buf[:_HEADER].view(torch.int64).copy_(head)
    qdata = q.to(torch.int8) if fmt.bits == 8 else _pack4(q)
    buf[q_off:q_off + q_bytes].view(qdata.dtype).view(qdata.shape).copy_(qdata)
    buf[s_off:s_off + n * g * 4].view(torch.float32).view(n, g).copy_(scales)
    if zeros is not None:
        buf[z_off:z_off + n * g * 4].view(torch.float32).view(n, g).copy_(zeros.reshape(n, g))
    return buf


def header(buf: torch.Tensor) -> dict[str, int]:
    """The header's fields; raises if ``buf`` is not a quantized weight."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < _HEADER:
        raise ValueError(f"not a numatp quantized weight: {buf.dtype} {tuple(buf.shape)}")
    h = buf[:_HEADER].view(torch.int64).tolist()
    if h[0] != MAGIC or h[1] != VERSION:
        raise ValueError("not a numatp quantized weight (bad magic or version)")
    keys = ("magic", "version", "bits", "n", "k", "group", "zeros", "q_off", "s_off", "z_off", "q_bytes", "total",
            "act")
    return dict(zip(keys, h))


def format_of(buf: torch.Tensor) -> QuantFormat:
    h = header(buf)
    return QuantFormat(8, act=h["act"] or None) if h["bits"] == 8 else QuantFormat(4, h["group"], h["act"] or None)


def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Views into the buffer, no copy: ``q`` (int8 ``(N, K)``, or the packed uint8 ``(N, K / 2)``), the
    scales and the zeros (None where absent)."""
    h = header(buf)
    n, k, g = h["n"], h["k"], h["k"] // h["group"]
    q = buf[h["q_off"]:h["q_off"] + h["q_bytes"]]
    q = q.view(torch.int8).view(n, k) if h["bits"] == 8 else q.view(n, k // 2)
    s = buf[h["s_off"]:h["s_off"] + n * g * 4].view(torch.float32).view(n, g)
    z = buf[h["z_off"]:h["z_off"] + n * g * 4].view(torch.float32).view(n, g) if h["zeros"] else None
    return q, s, z


def unpack(buf: torch.Tensor) -> QuantValues:
    """The buffer's values (copies)."""
    fmt = format_of(buf)
    q, s, z = views(buf)
    k = header(buf)["k"]
    qv = q.to(torch.int16) if fmt.bits == 8 else _unpack4(q, k)
    return QuantValues(fmt, qv, s.clone(), None if z is None else z.clone())


def dequantize(buf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``(N, K)`` weight the buffer stands for, computed in float32 (the kernels' reference)."""
    return unpack(buf).dequantize(dtype)


def quantize_values(w_nk: torch.Tensor, fmt: QuantFormat | str) -> QuantValues:
    """numatp's quantizer (symmetric, see the module's docstring) on an ``(N, K)`` weight, in float32."""
    fmt = QuantFormat.parse(fmt)
    n, k = w_nk.shape
    _check_shape(n, k, fmt)
    w = w_nk.detach().to(torch.float32)
    if fmt.bits == 8:
        s = w.abs().amax(dim=1, keepdim=True) / 127.0
        q = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
        return QuantValues(fmt, q.to(torch.int16), s, None)
    g = int(fmt.group or 1)
    wg = w.view(n, k // g, g)
    at = wg.abs().argmax(dim=2, keepdim=True)
    s = wg.gather(2, at) / -8.0                   # the largest magnitude maps to q = 0 (-8 * s)
    safe = torch.where(s != 0, s, 1.0)
    q = torch.where(s != 0, torch.round(wg / safe) + 8, 8.0).clamp(0, 15)
    return QuantValues(fmt, q.reshape(n, k).to(torch.int16), s.squeeze(-1), None)


def quantize(w_nk: torch.Tensor, fmt: QuantFormat | str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``w_nk`` (``(N, K)``, any float dtype, a transposed view included) quantized to a buffer (into
    ``out`` where given, see :func:`from_values`)."""
    v = quantize_values(w_nk, fmt)
    return from_values(v.q, v.scales, v.zeros, v.fmt, out=out)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``(..., K)``, K a multiple of :data:`ACT_BLOCK`) as the ``:a8`` formats' kernels read it, in float32:
    each block of 32 along the last dimension quantized (``d = max |x| / 127``, ``qx = round(x / d)``, ties
    to even, in [-127, 127]; ``d = 0``: 0) and multiplied back, ``qx * d``. The reference of every ``:a8``
    provider (the decode kernel sums ``qx q`` as integers and scales them by ``d`` in float32: the same
    values up to float32 rounding)."""
    k = x.shape[-1]
    if k % ACT_BLOCK:
        raise ValueError(f"int8 activations are quantized in blocks of {ACT_BLOCK}; an input of {k} features is "
                         f"not a multiple of {ACT_BLOCK}")
    xb = x.detach().to(torch.float32).reshape(*x.shape[:-1], k // ACT_BLOCK, ACT_BLOCK)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1.0)).clamp(-127, 127), 0.0)
    return (q * d).reshape(x.shape)


def qembedding(buf: torch.Tensor, ids: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """``embedding(W, ids)`` of a ``(rows, k)`` table stored as a quantized buffer: the rows ``ids``
    dequantized (in float32, as :func:`dequantize`), in ``dtype``. A tied LM head's vocabulary-parallel
    lookup reads the head's own quantized shard with it, and an untied table is stored so too. ``k`` is
    the width (in the header too, which shape propagation cannot read). The op is ``numatp::qembedding``
    (:func:`qembedding_op`), in C++: a compiled segment calls it without taking the GIL."""
    return qembedding_op()(buf, ids, k, dtype)


def qembedding_op() -> Any:
    """``torch.ops.numatp.qembedding.default`` (numatp's library loaded, built on first use)."""
    from numatp.runtime.native import load_ops
    load_ops()
    return torch.ops.numatp.qembedding.default
