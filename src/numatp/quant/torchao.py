"""Weights quantized by torchao's weight-only configs, read as numatp's int8 and int4 values.

A model passed through ``torchao.quantization.quantize_`` holds tensor subclasses in place of its linear
weights. :func:`extract` reads each one into a :class:`TorchaoWeight`: the values numatp's own format
stores for a 2-D weight ``W`` of shape ``(N, K)`` (``nn.Linear`` layout), unpacked, never re-quantized:

- ``int8``: ``q`` int8 ``(N, K)``, ``scales`` ``(N,)`` float32;
  ``w[n, k] = q[n, k] * scales[n]`` (computed in float32, rounded once to ``dtype``).
- ``int4``: ``q`` uint8 ``(N, K)`` holding 0..15, ``scales`` and ``zeros`` ``(N, K // group)`` in the
  model dtype; ``w[n, k] = (q[n, k] - 8) * scales[n, g] + zeros[n, g]`` with ``g = k // group`` (one fused
  multiply-add in float32, rounded once to ``dtype``; the zero point is in the float domain).

:meth:`TorchaoWeight.dequantize` is that formula. It equals torchao's own ``weight.dequantize()`` bit for
bit where torchao has one (``Int8Tensor``, ``IntxUnpackedToInt8Tensor``), and for the CPU int4 tensor (no
``dequantize``) the weight that ATen's ``_weight_int4pack_mm_for_cpu`` kernel multiplies by, which
dequantizes in float32 with one FMA.

:func:`dequantized` replaces those parameters by plain float tensors equal to that dequantization, so the
model traces and plans like an unquantized one, and returns the same dict.

What is read (torchao 0.18; the classes are matched by name, so a version that moved them still reads):

- ``Int8Tensor`` (``Int8WeightOnlyConfig()``): ``qdata`` int8 ``(N, K)``, ``scale`` float32 ``(N, 1)``
  (per row; ``(1, 1)`` per tensor, read as ``N`` equal scales), ``zero_point`` int8 zeros, ``block_size``
  ``[1, K]`` (``[N, K]`` per tensor).
- ``Int4OpaqueTensor`` (``torchao.prototype.quantization.int4.PrototypeInt4WeightOnlyConfig(group_size)``,
  torchao's int4 weight-only on CPU, tinygemm or HQQ parameters alike; ``Int4WeightOnlyConfig`` has no CPU
  packing in 0.18: its formats need CUDA, XPU or NPU kernels): ``qdata`` uint8
  ``(N, K / 2)`` packed by ``aten._convert_weight_to_int4pack_for_cpu`` (a layout that depends on the CPU
  capability ATen dispatched to: AVX512, AVX2 or the scalar one), ``scale_and_zero`` ``(K / group, N, 2)``
  in the model dtype, ``block_size`` ``[1, group]``.
- ``IntxUnpackedToInt8Tensor`` (``IntxWeightOnlyConfig``, symmetric): ``qdata`` int8 ``(N, K)`` one value
  an element (-8..7 for ``weight_dtype=torch.int4``, read as ``q = qdata + 8``), ``scale`` ``(N, K /
  block)`` in ``scale_dtype`` or the model dtype, ``zero_point`` int8 zeros, ``target_dtype`` and
  ``block_size`` ``[1, K]`` (int8, ``PerAxis(0)``) or ``[1, group]`` (int4, ``PerGroup(group)``).

Anything else from torchao (dynamic activation quantization, float8, per-group int8, asymmetric int8, an
activation pre-scale, int4 in another packing) is refused with :class:`TorchaoFormatError`, which names
the parameter, what it holds, and the supported configs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["SUPPORTED", "TorchaoFormatError", "TorchaoWeight", "dequantized", "extract", "is_torchao"]

SUPPORTED = ("torchao.quantization.Int8WeightOnlyConfig() (per row or per tensor), "
             "torchao.prototype.quantization.int4.PrototypeInt4WeightOnlyConfig(group_size=32, 64 or 128) "
             "(torchao's int4 weight-only for CPU), and torchao.quantization.IntxWeightOnlyConfig, symmetric, "
             "with weight_dtype=torch.int8 per row (PerAxis(0)) or torch.int4 in PerGroup(32, 64 or 128)")

_INT4_GROUPS = (32, 64, 128)


class TorchaoFormatError(ValueError):
    """A torchao tensor in the model that numatp has no layout for."""


@dataclass(frozen=True)
class TorchaoWeight:
    """One torchao weight as numatp's int8 or int4 values (shapes for a weight of shape ``(N, K)``)."""

    kind: Literal["int8", "int4"]
    """``"int8"``: one scale per output row; ``"int4"``: groups of ``group`` along the input dimension."""
    group: int | None
    """The int4 group size along K (32, 64 or 128); ``None`` for int8."""
    q: torch.Tensor
    """int8 ``(N, K)`` for int8; uint8 ``(N, K)`` holding 0..15, one value an element, for int4."""
    scales: torch.Tensor
    """float32 ``(N,)`` for int8; ``(N, K // group)`` for int4, in the dtype torchao stored them (the model
    dtype, or IntxWeightOnlyConfig's ``scale_dtype``)."""
    zeros: torch.Tensor | None
    """int4 from ``Int4OpaqueTensor`` only: ``(N, K // group)`` float zero points in the model dtype, added
    after scaling; ``None`` for symmetric weights."""
    dtype: torch.dtype
    """The float dtype the weight dequantizes to (the model's dtype for it)."""
    source: str
    """The torchao tensor type it was read from, e.g. ``"Int8Tensor"``."""

    def dequantize(self) -> torch.Tensor:
        """The float weight ``(N, K)`` in ``dtype``, by the formula of the module docstring."""
        if self.kind == "int8":
            return (self.q.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(self.dtype)
        assert self.group is not None
        scales = self.scales.to(torch.float32).repeat_interleave(self.group, dim=1)
        centred = self.q.to(torch.float32) - 8
        if self.zeros is None:
            return (centred * scales).to(self.dtype)
        zeros = self.zeros.to(torch.float32).repeat_interleave(self.group, dim=1)
        return torch.addcmul(zeros, centred, scales).to(self.dtype)   # one FMA, as the CPU int4 kernel


def is_torchao(value: Any) -> bool:
    """Whether ``value`` is a torchao tensor (by its class's module: torchao is never imported here)."""
    return isinstance(value, torch.Tensor) and type(value).__module__.split(".")[0] == "torchao"


def extract(module: torch.nn.Module) -> dict[str, TorchaoWeight]:
    """Every parameter of ``module`` that holds a torchao weight-only tensor, by its full name (every name
    of a tied parameter), read as numatp's values. ``{}`` for a model without torchao tensors, without
    importing torchao. Raises :class:`TorchaoFormatError` for a torchao tensor numatp cannot represent."""
    found: dict[str, TorchaoWeight] = {}
    read: dict[int, TorchaoWeight] = {}
    layouts: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if not is_torchao(param):
            continue
        if id(param) not in read:
            read[id(param)] = _read(name, param, layouts)
        found[name] = read[id(param)]
    return found


def dequantized(module: torch.nn.Module) -> dict[str, TorchaoWeight]:
    """Replace, in place, every torchao weight of ``module`` by a plain float parameter (no grad) equal to
    :meth:`TorchaoWeight.dequantize`, and return :func:`extract`'s dict. Tied parameters stay tied. The
    ``extra_repr`` that torchao's ``quantize_`` put on each module it quantized is removed with it."""
    weights = extract(module)
    plain: dict[int, torch.nn.Parameter] = {}
    for name, weight in weights.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if id(weight) not in plain:
            plain[id(weight)] = torch.nn.Parameter(weight.dequantize(), requires_grad=False)
        setattr(owner, leaf, plain[id(weight)])
        _drop_torchao_repr(owner)
    return weights


def _drop_torchao_repr(owner: torch.nn.Module) -> None:
    patched = owner.__dict__.get("extra_repr")
    func = getattr(patched, "__func__", None)
    func = getattr(func, "func", func)   # quantize_ binds a functools.partial
    if str(getattr(func, "__module__", "")).startswith("torchao"):
        del owner.__dict__["extra_repr"]


def _refuse(name: str, tensor: torch.Tensor, what: str) -> TorchaoFormatError:
    return TorchaoFormatError(
        f"{name}: torchao {type(tensor).__name__} ({what}) has no numatp layout; numatp reads {SUPPORTED}. "
        f"Quantize with one of those, or keep this layer out of quantize_ (its filter_fn)")


def _read(name: str, tensor: torch.Tensor, layouts: dict[int, str]) -> TorchaoWeight:
    kind = type(tensor).__name__
    if kind == "Int8Tensor":
        return _read_int8(name, tensor)
    if kind == "Int4OpaqueTensor":
        return _read_int4_opaque(name, tensor, layouts)
    if kind == "IntxUnpackedToInt8Tensor":
        return _read_intx(name, tensor)
    raise _refuse(name, tensor, f"{type(tensor).__module__}.{kind}, not a weight-only int8 or CPU int4 tensor")


def _read_int8(name: str, t: Any) -> TorchaoWeight:
    if getattr(t, "act_quant_kwargs", None) is not None:
        raise _refuse(name, t, "int8 dynamic activation quantization, e.g. Int8DynamicActivationInt8WeightConfig, "
                               "one scale per token; numatp's own weights='int8:a8' on the unquantized model "
                               "quantizes activations in blocks of 32")
    for extra in ("act_pre_scale", "act_quant_scale", "act_quant_zero_point"):
        if getattr(t, extra, None) is not None:
            raise _refuse(name, t, f"carries {extra}: activations are scaled or quantized, not only the weight")
    qdata, scale = t.qdata, t.scale
    if qdata.ndim != 2 or qdata.dtype != torch.int8:
        raise _refuse(name, t, f"qdata {qdata.dtype} of shape {tuple(qdata.shape)}; numatp reads 2-D int8")
    n, k = qdata.shape
    block = list(t.block_size)
    if block == [1, k]:
        scales = scale.reshape(n)
    elif block == [n, k]:
        scales = scale.reshape(1).expand(n).contiguous()   # per tensor: the one scale on every row
    else:
        raise _refuse(name, t, f"block size {block} of a {n}x{k} weight; numatp's int8 has one scale per "
                               f"row (block [1, {k}]) or per tensor")
    zero = t.zero_point
    if zero is not None and bool(zero.ne(0).any()):
        raise _refuse(name, t, "asymmetric int8 with non-zero zero points; numatp's int8 is symmetric")
    return TorchaoWeight(kind="int8", group=None, q=qdata, scales=scales.to(torch.float32), zeros=None,
                         dtype=t.dtype, source="Int8Tensor")


def _read_intx(name: str, t: Any) -> TorchaoWeight:
    if getattr(t, "activation_quantization", None) is not None:
        raise _refuse(name, t, f"{t.activation_quantization} activation quantization, e.g. "
                               f"Int8DynamicActivationIntxWeightConfig")
    qdata = t.qdata
    if qdata.ndim != 2 or qdata.dtype != torch.int8:
        raise _refuse(name, t, f"qdata {qdata.dtype} of shape {tuple(qdata.shape)}; numatp reads 2-D int8")
    zero = t.zero_point
    if zero is not None and bool(zero.ne(0).any()):
        raise _refuse(name, t, "asymmetric, with non-zero zero points; numatp reads symmetric intx")
    n, k = qdata.shape
    block, bits = list(t.block_size), t.target_dtype
    if bits == torch.int8 and block == [1, k]:
        return TorchaoWeight(kind="int8", group=None, q=qdata, scales=t.scale.reshape(n).to(torch.float32),
                             zeros=None, dtype=t.dtype, source="IntxUnpackedToInt8Tensor")
    if bits == getattr(torch, "int4", None) and block[:1] == [1] and block[1] in _INT4_GROUPS and k % block[1] == 0:
        # qdata holds -8..7: numatp's 0..15 are the same values offset by 8, and w = qdata * scale
        return TorchaoWeight(kind="int4", group=block[1], q=(qdata + 8).to(torch.uint8),
                             scales=t.scale.reshape(n, k // block[1]), zeros=None, dtype=t.dtype,
                             source="IntxUnpackedToInt8Tensor")
    raise _refuse(name, t, f"{bits} in blocks of {block} of a {n}x{k} weight; numatp reads int8 per row or "
                           f"int4 in groups of 32, 64 or 128 along K")


def _read_int4_opaque(name: str, t: Any, layouts: dict[int, str]) -> TorchaoWeight:
    if getattr(t, "act_mapping_type", None) is not None:
        raise _refuse(name, t, "int8 dynamic activation with int4 weights (Int8DynamicActivationInt4WeightConfig)")
    if getattr(t, "act_pre_scale", None) is not None:
        raise _refuse(name, t, "carries act_pre_scale: activations are scaled, not only the weight")
    n, k = t.shape
    block = list(t.block_size)
    group = block[1] if len(block) == 2 else 0
    if block[:1] != [1] or group not in _INT4_GROUPS or k % group:
        raise _refuse(name, t, f"block size {block} of a {n}x{k} weight; numatp's int4 groups are 32, 64 or "
                               f"128 along K")
    qdata, sz = t.qdata, t.scale_and_zero
    if qdata.dtype != torch.uint8 or qdata.numel() * 2 != n * k or tuple(sz.shape) != (k // group, n, 2):
        raise _refuse(name, t, f"qdata {qdata.dtype} {tuple(qdata.shape)} and scale_and_zero "
                               f"{tuple(sz.shape)} for a {n}x{k} weight in groups of {group}; numatp reads "
                               f"uint8 ({n}, {k // 2}) and ({k // group}, {n}, 2)")
    if n not in layouts:
        layouts[n] = _cpu_pack_layout(name, t, n)
    q = _unpack_cpu_int4(qdata.reshape(-1), n, k, layouts[n])
    scales = sz[..., 0].t().contiguous()   # (G, N) -> (N, G)
    zeros = sz[..., 1].t().contiguous()
    return TorchaoWeight(kind="int4", group=group, q=q, scales=scales, zeros=zeros, dtype=t.dtype,
                         source="Int4OpaqueTensor")


# ---- ATen's CPU int4 packing (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel) ----
# Rows go in blocks of BLOCK_N (4 float vectors: 64 on AVX512, 32 otherwise); block i holds K rows of bytes,
# one per k, each carrying the block's nb values of that column two to a byte, low nibble first. A full
# block on AVX512 pairs row d with row d+32 (byte d) and d+16 with d+48 (byte 16+d); a full block on AVX2
# pairs d with d+16; any other block pairs neighbours (n, n+1). Which one a process packs with is read from
# the packing op itself (`_cpu_pack_layout`), never assumed from the CPU's name.

def _rows_wide64(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return torch.cat([lo[..., :16], lo[..., 16:], hi[..., :16], hi[..., 16:]], dim=-1)


def _rows_wide32(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return torch.cat([lo, hi], dim=-1)


def _rows_pairs(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# layout name -> (BLOCK_N, how a full block's bytes hold its rows)
_LAYOUTS: dict[str, tuple[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
    "avx512": (64, _rows_wide64), "avx2": (32, _rows_wide32), "scalar32": (32, _rows_pairs),
    "scalar16": (16, _rows_pairs), "scalar64": (64, _rows_pairs),
}


def _unpack_cpu_int4(flat: torch.Tensor, n: int, k: int, layout: str) -> torch.Tensor:
    """uint8 ``(n, k)`` values 0..15 from ``n * k / 2`` packed bytes."""
    block, full_rows = _LAYOUTS[layout]
    full, tail = divmod(n, block)
    parts = []
    if full:
        b = flat[: full * k * block // 2].reshape(full, k, block // 2)
        parts.append(full_rows(b & 0xF, b >> 4).transpose(1, 2).reshape(full * block, k))   # (full*block, k)
    if tail:
        b = flat[full * k * block // 2:].reshape(k, tail // 2)
        parts.append(_rows_pairs(b & 0xF, b >> 4).t())   # (tail, k)
    return torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous()


def _cpu_pack_layout(name: str, t: Any, n: int) -> str:
    """The layout this process's ``_convert_weight_to_int4pack_for_cpu`` packs ``n`` rows with: pack a probe of
    known values and keep the layout that unpacks it back."""
    k = 4
    probe = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1).reshape(-1)
    for layout in _LAYOUTS:
        try:
            unpacked = _unpack_cpu_int4(packed, n, k, layout)
        except RuntimeError:   # a block size that does not tile these rows (reshape): not this layout
            continue
        if torch.equal(unpacked.to(torch.int32), probe):
            return layout
    raise _refuse(name, t, f"int4 packed by ATen for CPU capability {torch.backends.cpu.get_cpu_capability()} "
                           f"in a layout numatp does not know ({n} rows)")
