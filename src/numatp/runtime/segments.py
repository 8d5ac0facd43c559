"""Cut a socket program into segments, and compile each distinct one once.

Two kinds of nodes stay inside segments as C++ dispatcher ops (``ops.cpp``, built by
:mod:`numatp.runtime.native`), which a segment compiled with ``cpp_wrapper`` calls from its C++ without
the GIL: a ``numatp::gemm`` whose provider has a C++ kernel becomes ``numatp::linear``, and every
all-reduce after the first becomes ``numatp::socket_all_reduce``. The program is cut at what is left: the
first all-reduce (the sockets' programs differ before it, by the vocabulary-parallel lookup's row
range), all-gathers and a provider that is a Python callable (``inductor_cpp``), and a segment ends after
every :data:`REDUCTIONS_PER_SEGMENT`-th reduction. So each layer is one segment: a socket returns to
Python once per layer, and since the layers' segments have the same code (canonical names make them
compare equal), one Inductor compilation serves every layer and every socket with the same local shapes.
With one socket the segment ends stay as cuts (the identity) and the other collectives go. An all-gather
of an ATen weight matmul's output takes that matmul out of its segment and runs it into the full tensor
(:class:`GatheredMatmul`).

Contract. Takes: a local program (after the GEMM rewrite) and arguments of its local shapes.
Guarantees: the steps, run in order over one environment, compute what the program computes; each
segment's inputs and outputs are named values of that environment. Refuses: nothing.
"""

from __future__ import annotations

import hashlib
import operator
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from numatp.plan.ops import COLLECTIVES
from numatp.progress import step as progress_step
from numatp.runtime.collective import SocketComm
from numatp.runtime.gemm import GEMM_OP, IN_PLACE, NATIVE, GemmStep, native_code
from numatp.runtime.native import load_ops

__all__ = ["Segment", "Collective", "GatheredMatmul", "gather_in_place", "split_program", "SegmentCompiler"]


@dataclass
class Segment:
    gm: torch.fx.GraphModule
    inputs: list[str]          # env keys read, in placeholder order
    outputs: list[str]         # env keys written, in output order
    example: list[Any] = field(default_factory=list)
    compiled: Any = None


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


def split_program(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                  sockets: int) -> tuple[list[str], list, list[Any]]:
    """(placeholder keys, steps, output spec) of a socket program of a group of ``sockets``; steps are
    Segment, Collective or GemmStep. ``gm`` is rewritten in place."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, fake).propagate(*[fake.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                          for t in example_inputs])
    _native_gemms(gm)
    cuts = _place_reductions(gm, sockets)
    in_place, absorbed = _gathered_matmuls(gm)
    nodes = list(gm.graph.nodes)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    last_use: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a.name] = i
    steps: list[Any] = []
    current: list[torch.fx.Node] = []
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "output"):
            continue
        if n.target is GEMM_OP:  # a weight matmul the executor runs with its provider (numatp.plan.gemm_pass)
            if current:
                steps.append(_segment(gm, current, i, last_use, output))
                current = []
            x, w, b, provider, _ = n.args
            steps.append(GemmStep(provider, x.name, w.name, b.name if b is not None else None, n.name,
                                  int(n.meta["val"].shape[1]), int(x.meta["val"].shape[1])))
        elif n.target in COLLECTIVES:
            if current:
                steps.append(_segment(gm, current, i, last_use, output))
                current = []
            src = n.args[0].name
            if n.target is COLLECTIVES[0]:
                steps.append(Collective("all_reduce", n.args[1], src, n.name))
            else:
                full = n.meta["val"]
                steps.append(Collective("all_gather", n.args[3], src, n.name, n.args[1], n.args[2],
                                        n.meta.get("numatp_gather"), (tuple(map(int, full.shape)), full.dtype),
                                        in_place.get(n)))
        elif n in absorbed:   # run by the all-gather it feeds
            continue
        else:
            current.append(n)
            if n in cuts:   # after a reduction that runs inside the segment: the end of a layer
                steps.append(_segment(gm, current, i + 1, last_use, output))
                current = []
    if current:
        steps.append(_segment(gm, current, len(nodes), last_use, output))
    outs = [a.name if isinstance(a, torch.fx.Node) else ("const", a) for a in output.args[0]]
    return placeholders, steps, outs


def gather_in_place(mm: torch.fx.Node) -> torch.fx.Node | None:
    """The all-gather a matmul's output could be written into in place, else None: the matmul's output
    alone (or one view of it that splits rows only) is gathered along its last dim, and every socket's
    columns are one interval. The GEMM pass times such a matmul as written there (``GemmShape.into``)."""
    v = mm
    if len(v.users) == 1 and next(iter(v.users)).target is torch.ops.aten.view.default:
        v = next(iter(v.users))
    if len(v.users) != 1:
        return None
    g = next(iter(v.users))
    full, sets = g.meta.get("val"), g.meta.get("numatp_gather")
    if g.target is not COLLECTIVES[1] or full is None or sets is None:
        return None
    if any(len(s.intervals) != 1 for s in sets) or g.args[1] % full.dim() != full.dim() - 1:
        return None
    if mm.meta["val"].shape[0] * full.shape[-1] != full.numel():   # the view splits rows only
        return None
    return g


def _gathered_matmuls(gm: torch.fx.GraphModule) -> tuple[dict[torch.fx.Node, GatheredMatmul], set[torch.fx.Node]]:
    """The all-gathers that can compute their input in place (:func:`gather_in_place`) of an ATen
    ``mm(x, W)`` or ``addmm(b, x, W)``, with ``W`` a weight (a placeholder, or ``permute(W, [1, 0])`` /
    ``t(W)`` of one), or of a ``numatp::linear`` whose provider writes in place (``mkl_packed``). Returns
    them with their :class:`GatheredMatmul`, and the nodes the gathers take over (left out of the
    segments). Others (another provider's ``numatp::linear``, an elementwise op after the matmul) keep
    the copy."""
    aten = torch.ops.aten
    found: dict[torch.fx.Node, GatheredMatmul] = {}
    absorbed: set[torch.fx.Node] = set()
    linear = getattr(getattr(torch.ops, "numatp", None), "linear", None)
    in_place_codes = {NATIVE[p] for p in IN_PLACE if p in NATIVE}
    for mm in list(gm.graph.nodes):
        if linear is not None and mm.target is linear.default and mm.args[3] in in_place_codes:
            g = gather_in_place(mm)
            if g is None:
                continue
            x, w, bias, code, n, k = mm.args
            found[g] = GatheredMatmul(x.name, w.name, bias.name if bias is not None else None, False, code, n, k)
            absorbed |= {mm, g.args[0]}
            continue
        if mm.target not in (aten.mm.default, aten.addmm.default) or mm.kwargs:
            continue
        g = gather_in_place(mm)
        if g is None:
            continue
        bias, x, wt = (None, *mm.args) if mm.target is aten.mm.default else mm.args
        taken = {mm, g.args[0]}   # the matmul and its view, if any
        if wt.op == "placeholder":
            w, transposed = wt, False
        elif (wt.target is aten.t.default or (wt.target is aten.permute.default and list(wt.args[1]) == [1, 0])) \
                and wt.args[0].op == "placeholder" and len(wt.users) == 1:
            w, transposed = wt.args[0], True
            taken.add(wt)
        else:
            continue
        found[g] = GatheredMatmul(x.name, w.name, bias.name if bias is not None else None, transposed)
        absorbed |= taken
    return found, absorbed


def _native_gemms(gm: torch.fx.GraphModule) -> None:
    """Each ``numatp::gemm`` whose provider has a C++ kernel becomes ``numatp::linear`` in place."""
    sites = [n for n in gm.graph.nodes if n.target is GEMM_OP and n.args[3] in NATIVE]
    if not sites:
        return
    load_ops()
    for n in sites:
        x, w, b, provider, layout = n.args
        val = n.meta["val"]
        with gm.graph.inserting_before(n):
            code = native_code(provider, layout)
            new = gm.graph.call_function(torch.ops.numatp.linear.default,
                                         (x, w, b, code, int(val.shape[1]), int(x.meta["val"].shape[1])))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


REDUCTIONS_PER_SEGMENT = 2
"""After the first, every this-many-th all-reduce ends a segment. Transformer layers have 2 reductions
each, so every layer is one segment of the same code, compiled once (measured, gpt2-medium on one
socket: the whole program as one segment took 73 s to compile, a segment per layer 31 s)."""


def _place_reductions(gm: torch.fx.GraphModule, sockets: int) -> set[torch.fx.Node]:
    """Decide where each collective runs; returns the nodes after which a segment ends.

    The first all-reduce stays a cut of the program (a step of its own): the sockets' programs differ
    before it (a vocabulary-parallel lookup's row range is a constant of its segment) and are the same
    code after it wherever the sockets' shapes are. Every later one becomes ``numatp::socket_all_reduce``
    in place, each chained to the one before, and every :data:`REDUCTIONS_PER_SEGMENT`-th ends a segment
    right after it: a layer's reductions both run inside its segment, without a return to Python
    (measured, gpt2-medium bf16 decode on 2 virtual sockets: a reduction called from Python between two
    segments cost 20 us, one inside 4-9 us). The chain (each reduction reads the one-element token the
    one before returned) keeps the reductions in program order on every socket, whatever the compiler
    schedules between them. A dtype the C++ collective does not sum stays a cut.

    With one socket the reductions that would run inside and the all-gathers are dropped (a sum over one
    socket is its input), and the segment ends stay as cuts (the identity), so that the layers stay
    segments of the same code.
    """
    reductions = [n for n in gm.graph.nodes if n.target is COLLECTIVES[0]]
    summed = [i > 0 and (sockets == 1 or SocketComm.supports(n.meta["val"])) for i, n in enumerate(reductions)]
    ends = {n for i, n in enumerate(reductions) if i and i % REDUCTIONS_PER_SEGMENT == 0}
    cuts: set[torch.fx.Node] = set()
    if sockets == 1:
        inline = [n for n, ok in zip(reductions, summed) if ok and n not in ends]
        gathers = [n for n in gm.graph.nodes if n.target in COLLECTIVES[1:]]
        for n in inline + gathers:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    else:
        inline = [n for n, ok in zip(reductions, summed) if ok]
        if inline:
            load_ops()
        token = None
        for n in inline:
            with gm.graph.inserting_before(n):
                call = gm.graph.call_function(torch.ops.numatp.socket_all_reduce.default, (n.args[0], token))
                total = gm.graph.call_function(operator.getitem, (call, 0))
                token = gm.graph.call_function(operator.getitem, (call, 1))
            total.meta = dict(n.meta)
            token.meta["val"] = n.meta["val"].new_empty(1)   # a segment's inputs are made from these
            call.meta["val"] = (total.meta["val"], token.meta["val"])
            n.replace_all_uses_with(total)
            gm.graph.erase_node(n)
            if n in ends:
                cuts.add(token)   # the last of the three nodes made for it
    gm.graph.lint()
    gm.recompile()
    return cuts


def _segment(gm, body: list[torch.fx.Node], end: int, last_use: dict[str, int], output) -> Segment:
    inside = set(body)
    inputs: list[torch.fx.Node] = []
    for n in body:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outs = [n for n in body if any(u not in inside for u in n.users)]
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for k, a in enumerate(inputs):
        env[a] = g.placeholder(f"in{k}")
        env[a].meta["val"] = a.meta.get("val")
    for i, n in enumerate(body):
        # canonical names: the same layer code in another layer must compare equal
        args = torch.fx.node.map_arg(n.args, lambda x: env[x])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda x: env[x])
        env[n] = g.create_node(n.op, n.target, args, kwargs, name=f"v{i}")
        env[n].meta = dict(n.meta)
    g.output(tuple(env[o] for o in outs))
    seg_gm = torch.fx.GraphModule(gm, g)
    seg = Segment(seg_gm, [a.name for a in inputs], [o.name for o in outs])
    missing = [a.name for a in inputs if a.meta.get("val") is None]
    if missing:   # the compiler would drop such an input and read the next one in its place
        raise AssertionError(f"numatp: segment inputs {missing} have no example value")
    seg.example = [_example(a.meta["val"]) for a in inputs]
    return seg


def _example(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype)
    return v


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
            from torch._inductor.compile_fx import compile_fx
            # no input size asserts: a packed GEMM operand is an opaque tensor (or MKL's buffer) where
            # the segment was compiled for a stand-in of the weight's plain shape, which only the
            # provider's op reads
            patches = {"cpp_wrapper": True, "cpp.threads": threads, "size_asserts": False}
            with torch.no_grad(), progress_step("Inductor: compiling a segment of %d nodes for %d thread(s)",
                                       len(seg.gm.graph.nodes), threads):
                fn = compile_fx(seg.gm, seg.example, config_patches=patches)
        with self._lock:
            self._cache.setdefault(k, fn)
            self.compiled += 1
        return self._cache[k]
