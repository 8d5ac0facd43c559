"""The steps of a socket program, and the compiler of its segments.

A socket program is a list of steps that one worker runs in order over one environment of named values
(:class:`numatp.runtime.executor.SocketProgram`): a :class:`Segment` (a piece of the program's graph,
compiled once per distinct code by :class:`SegmentCompiler`), a :class:`Collective` (an all-reduce or an
all-gather between the sockets, possibly with the matmul whose output it gathers,
:class:`GatheredMatmul`) or a GEMM step (:class:`numatp.runtime.gemm.GemmStep`). The steps are made
by the planning side (:mod:`numatp.plan.split`, the last graph step of :mod:`numatp.plan.pipeline`);
nothing here rewrites a graph.

A segment may call two C++ dispatcher ops (``ops.cpp``, built by :mod:`numatp.runtime.native`), which a
segment compiled with ``cpp_wrapper`` calls from its C++ without the GIL: ``numatp::linear`` (a GEMM
provider) and ``numatp::socket_all_reduce`` (the collective).
"""

from __future__ import annotations

import hashlib
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from numatp.progress import step as progress_step

__all__ = ["Segment", "Collective", "GatheredMatmul", "SegmentCompiler", "place"]

log = logging.getLogger("numatp")


@dataclass
class Segment:
    gm: torch.fx.GraphModule
    inputs: list[str]          # env keys read, in placeholder order
    outputs: list[str]         # env keys written, in output order
    example: list[Any] = field(default_factory=list)
    compiled: Any = None

    _getter: Any = field(default=None, repr=False, compare=False)

    def take(self, env: dict[str, Any]) -> tuple[Any, ...]:
        """The segment's inputs, in order, from the environment ``env`` (one C call, not a loop). The inputs
        are fixed once a program runs (the getter is made at the first call)."""
        if self._getter is None:
            keys = tuple(self.inputs)
            self._getter = operator.itemgetter(*keys) if len(keys) > 1 else lambda e: tuple(e[k] for k in keys)
        return self._getter(env)


@dataclass
class Collective:
    kind: str                  # "all_reduce" or "all_gather"
    tag: int
    src: str
    dst: str
    dim: int = 0
    global_size: int = 0
    sets: Any = None
    full: tuple[tuple[int, ...], torch.dtype] | None = None   # an all-gather's output: shape, dtype
    matmul: GatheredMatmul | None = None   # an all-gather computed in place (see GatheredMatmul)

    @property
    def inputs(self) -> list[str]:
        return self.matmul.inputs if self.matmul is not None else [self.src]


@dataclass
class GatheredMatmul:
    """The weight matmul whose column-sharded output an all-gather collects, run by the gather itself:
    each socket's ``x @ W`` (``+ b``) writes straight into its columns of the full tensor, so neither a
    shard tensor nor its copy into the full one is made. ``torch.mm(..., out=)`` takes the columns as a
    strided view (the BLAS' leading dimension), and so does MKL's packed GEMM (``numatp::linear_into``,
    where the GEMM pass chose ``mkl_packed``: ``provider`` is its code). Whether this beats another
    provider's kernel plus the copy depends on the CPU and dtype, so the GEMM pass measures both ways
    (``GemmShape.into``). On a 2-core AMX Xeon, gpt2 at 512 tokens on 2 sockets: in fp32 ATen in place
    won (69-76 against 59-67 GFLOP/s) and the gather's 44 ms a call went; in bf16 oneDNN plus the copy
    won (229-293 against 173-201)."""

    x: str                     # (M, K) activations, M the product of the full shape's leading dims
    w: str                     # the weight shard: (N, K) when ``transposed`` (nn.Linear), else (K, N);
                               # with a provider, its prepared operand
    bias: str | None
    transposed: bool
    provider: int | None = None   # numatp::linear's provider code (numatp.runtime.gemm.NATIVE); None: ATen
    n: int = 0                 # with a provider: the shard's columns and the inner dimension
    k: int = 0

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.w] + ([self.bias] if self.bias is not None else [])

    def __call__(self, env: dict[str, Any], full: torch.Tensor, columns: tuple[int, int]) -> None:
        lo, hi = columns
        out = full.view(-1, full.shape[-1])[:, lo:hi]
        bias = env[self.bias] if self.bias is not None else None
        if self.provider is not None:
            torch.ops.numatp.linear_into(env[self.x], env[self.w], bias, self.provider, self.n, self.k, out)
            return
        w = env[self.w].t() if self.transposed else env[self.w]
        if bias is None:
            torch.mm(env[self.x], w, out=out)
        else:
            torch.addmm(bias, env[self.x], w, out=out)


def place(out: torch.Tensor, shard: torch.Tensor, dim: int, s: Any) -> None:
    """Copy one socket's shard to its global indices ``s`` (an index set: ``s.intervals``, sorted
    ``(lo, hi)`` pairs) along ``dim`` of ``out``: a column-sharded output's part of the gather."""
    pos = 0
    for lo, hi in s.intervals:
        out.narrow(dim, lo, hi - lo).copy_(shard.narrow(dim, pos, hi - lo))
        pos += hi - lo


def keep_cpp_references(tensors: list[Any]) -> Any:
    """One more C++ reference to each tensor of ``tensors``, held as long as the returned object lives.

    A compiled segment (``cpp_wrapper``) takes a new reference to each input and drops it when done with
    it. Where that leaves only the tensor's Python object holding it, PyTorch releases the Python object's
    reference (``TensorImpl::decref_pyobject``), which takes the GIL: every socket would take the GIL once
    per weight per call, at the same moments as its peers, and wait for them (measured: about a fifth of a
    decode step's time outside the GEMMs). With one more C++ reference for the program's lifetime (its
    weights, the sockets' cache copies), dropping the segment's leaves the Python object alone.
    """
    return torch._C.ScriptList([t for t in tensors if isinstance(t, torch.Tensor)])


class SegmentCompiler:
    """Compile segments with Inductor's C++ backend; identical segments share one compiled callable.

    ``cpp_wrapper=True`` so a compiled segment runs without holding the GIL (the default Python wrapper
    holds it inside fused kernels, which serialises the sockets), and ``cpp.threads`` bakes in the
    socket's thread count, which Inductor otherwise takes from the compiling thread.
    """

    def __init__(self, *, mode: str = "inductor"):
        self.mode = mode
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.compiled = 0
        self.reused = 0
        self.direct = 0   # compiled segments called without AOTAutograd's runtime wrapper (see _direct)

    def key(self, seg: Segment, threads: int) -> str:
        meta = [(tuple(t.shape), tuple(t.stride()), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                for t in seg.example]
        return hashlib.sha256(f"{seg.gm.code}|{meta}|{threads}|{self.mode}".encode()).hexdigest()

    def compile(self, seg: Segment, threads: int) -> Any:
        k = self.key(seg, threads)
        with self._lock:
            if k in self._cache:
                self.reused += 1
                return self._cache[k]
        if self.mode == "eager":
            fn = seg.gm
        else:
            import torch._functorch.config as functorch
            from torch._inductor.compile_fx import compile_fx
            # no input size asserts: a packed GEMM operand is an opaque tensor (or MKL's buffer) where
            # the segment was compiled for a stand-in of the weight's plain shape, which only the
            # provider's op reads
            patches = {"cpp_wrapper": True, "cpp.threads": threads, "size_asserts": False}
            kept: dict[str, Any] = {}
            # AOTAutograd's own cache off: a graph it loads from there never reaches the inner compiler, so
            # its description (for _direct) would be missing; Inductor's cache still serves the C++
            no_cache = {"enable_autograd_cache": False} if hasattr(functorch, "enable_autograd_cache") else {}
            with torch.no_grad(), functorch.patch(no_cache), \
                    progress_step("Inductor: compiling a segment of %d nodes for %d thread(s)",
                                  len(seg.gm.graph.nodes), threads):
                fn = compile_fx(seg.gm, seg.example, inner_compile=_keeping(kept), config_patches=patches)
            direct = _direct(kept, seg.example)
            if direct is None:
                log.debug("segment %s: called through AOTAutograd's runtime wrapper (%s)", k[:12], kept["why"])
            else:
                fn = direct
        with self._lock:
            self._cache.setdefault(k, fn)
            self.compiled += 1
            self.direct += bool(getattr(fn, "_numatp_direct", False))
        return self._cache[k]


def _keeping(kept: dict[str, Any]) -> Callable[..., Any]:
    """Inductor's inner compiler (``compile_fx_inner``, which ``compile_fx`` hands its own arguments), keeping
    in ``kept`` what it returns (``"code"``: the compiled graph) and AOTAutograd's description of the graph's
    inputs and outputs at that moment (``"meta"``), for :func:`_direct`."""
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx_inner

    def inner(gm: torch.fx.GraphModule, example: Sequence[Any], **kwargs: Any) -> Any:
        code = compile_fx_inner(gm, example, **kwargs)
        context = TracingContext.try_get()
        kept["code"], kept["meta"] = code, getattr(context, "fw_metadata", None)
        return code
    return inner


def _direct(kept: dict[str, Any], example: Sequence[Any]) -> Callable[..., Any] | None:
    """A call of the compiled graph itself, without AOTAutograd's runtime wrapper, where that wrapper has
    nothing to do at run time; else None (and ``kept["why"]`` says why).

    In inference the wrapper's work is: mutations of inputs kept out of the graph, outputs that alias
    inputs or intermediates (rebuilt as views), deduplicated or synthetic-base inputs, effect tokens,
    functionalized RNG, tensor subclasses. A segment has none of these in the usual case (functional ATen,
    its state writes kept in the graph), and the wrapper's Python, once per segment per socket per call
    under the GIL (the sockets leave their segments together, after a reduction, and wait for each other's
    Python), cost a decode step 0.5-1.0 ms of its 12.8 (gpt2-medium int4:a8 on 2 virtual sockets of a
    2-core Xeon, alternating runs; docs/quantization.md); anything the description does not rule out keeps
    the wrapper."""
    code, meta = kept.get("code"), kept.get("meta")
    call = getattr(code, "current_callable", None)
    reasons = {
        "no description of the graph": meta is None,
        "the compiled graph has no callable": call is None,
        "an input is not a tensor": not all(isinstance(t, torch.Tensor) for t in example),
    }
    if meta is not None:
        reasons.update({
            "inputs were deduplicated or merged": len(getattr(meta, "input_info", ())) != len(example),
            "an input is mutated outside the graph": getattr(meta, "num_mutated_inp_runtime_indices", 1) != 0,
            "an output aliases an input or an intermediate": getattr(meta, "num_outputs_aliased", 1) != 0
            or getattr(meta, "num_intermediate_bases", 1) != 0,
            "effect tokens": bool(getattr(meta, "tokens", True)),
            "functionalized RNG": bool(getattr(meta, "is_rng_op_functionalized", True)),
            "a tensor subclass": bool(getattr(meta, "subclass_inp_meta", None) is None
                                      or any(not isinstance(m, int) and type(m).__name__ != "PlainTensorMeta"
                                             for m in meta.subclass_inp_meta)),
            "grad mode changes in the graph": getattr(meta, "grad_enabled_mutation", None) is not None,
        })
    why = [reason for reason, holds in reasons.items() if holds]
    if why:
        kept["why"] = "; ".join(why)
        return None

    # the compiled graph's entry takes its inputs as new handles (which it owns) and returns handles
    entry = getattr(call, "__globals__", {}).get("inductor_entry")
    aoti = getattr(torch._C, "_aoti", None)
    handles = getattr(aoti, "unsafe_alloc_void_ptrs_from_tensors", None)
    tensors = getattr(aoti, "alloc_tensors_by_stealing_from_void_ptrs", None)
    if entry is not None and handles is not None and tensors is not None:
        def direct(*args: Any) -> Any:
            return tensors(entry(handles(args)))
    else:
        def direct(*args: Any) -> Any:
            return call(list(args))   # the compiled graph's wrapper takes (and empties) a list of its inputs
    direct._numatp_direct = True  # type: ignore[attr-defined]
    return direct
