"""Lower a socket program's GEMMs, reductions and gathers to what the runtime runs.

Three graph rewrites that follow the GEMM choice and the single-query attention pass, in this order
(:mod:`numatp.plan.pipeline` calls them):

1. :func:`lower_gemms`: each ``numatp::gemm`` whose provider has a C++ kernel becomes ``numatp::linear``
   in place, which a compiled segment calls from its C++ without the GIL;
2. :func:`place_reductions`: the first all-reduce stays a cut of the program; every later one becomes
   ``numatp::socket_all_reduce``, chained to the one before, and every
   :data:`REDUCTIONS_PER_SEGMENT`-th one (:data:`STEP_REDUCTIONS_PER_SEGMENT`-th in a decode step's program)
   is marked as a segment's end (``meta["numatp_segment_end"]``);
   with one socket the reductions that would run inside and the all-gathers go;
3. :func:`mark_gathered_matmuls`: an all-gather that can compute its input in place takes over the
   matmul that makes it (``meta["numatp_gathered"]``: a
   :class:`~numatp.runtime.segments.GatheredMatmul`; the nodes it runs: ``meta["numatp_absorbed"]``).

Decisions live in ``node.meta``; :func:`numatp.plan.split.split_program` reads them to cut the program
into steps. Each rewrite ends with ``graph.lint()`` and ``recompile()``.

Contract. Takes: a local program after the GEMM choice, with ``meta["val"]`` on every node
(:func:`propagate_shapes`). Guarantees: the program computes what it computed (a sum over one socket is
its input); every socket's program keeps its collectives in the same order. Refuses: nothing.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from numatp.plan.ops import COLLECTIVES
from numatp.runtime.collective import SocketComm
from numatp.runtime.gemm import GEMM_OP, IN_PLACE, NATIVE, native_code
from numatp.runtime.native import load_ops
from numatp.runtime.segments import GatheredMatmul

__all__ = ["REDUCTIONS_PER_SEGMENT", "STEP_REDUCTIONS_PER_SEGMENT", "STEP_ROWS", "SEGMENT_END", "GATHERED",
           "ABSORBED", "propagate_shapes", "lower_gemms",
           "place_reductions", "gather_in_place", "mark_gathered_matmuls"]

SEGMENT_END = "numatp_segment_end"
"""``node.meta`` key: a segment ends right after this node (the token of a layer's last reduction)."""
GATHERED = "numatp_gathered"
"""``node.meta`` key of an all-gather: the :class:`GatheredMatmul` it runs in place of its input."""
ABSORBED = "numatp_absorbed"
"""``node.meta`` key: the node is run by the all-gather it feeds, not by a segment."""

REDUCTIONS_PER_SEGMENT = 2
"""After the first, every this-many-th all-reduce ends a segment. Transformer layers have 2 reductions
each, so every layer is one segment of the same code, compiled once (measured, gpt2-medium on one
socket: the whole program as one segment took 73 s to compile, a segment per layer 31 s)."""
STEP_REDUCTIONS_PER_SEGMENT = 8
"""The same in a program of at most :data:`STEP_ROWS` rows (a decode step): 4 layers a segment. A call of a
compiled segment costs a fixed ~100-200 us (its C++ entry, its inputs' handles), a large share of a
decode step's layer; fewer, longer segments take it fewer times (measured, gpt2-medium, 2 virtual
sockets, 64-token generations, two runs: bf16 decode +9% and +13%, int4 +13%), for a longer compile of
that program."""
STEP_ROWS = 16
"""The most rows (batch x positions) of a program that :data:`STEP_REDUCTIONS_PER_SEGMENT` applies to."""


def propagate_shapes(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """``meta["val"]`` (a fake tensor) on every node of ``gm``, from arguments of its local shapes (a
    prepared GEMM operand stands in by its plain shape: :func:`numatp.runtime.gemm.stand_in`)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, fake).propagate(*[fake.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                          for t in example_inputs])


def lower_gemms(gm: torch.fx.GraphModule) -> None:
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


def place_reductions(gm: torch.fx.GraphModule, sockets: int, hosts: int = 1) -> None:
    """Decide where each collective runs; marks the nodes after which a segment ends (:data:`SEGMENT_END`).

    The first all-reduce stays a cut of the program (a step of its own): the sockets' programs differ
    before it (a vocabulary-parallel lookup's row range is a constant of its segment) and are the same
    code after it wherever the sockets' shapes are. Every later one becomes ``numatp::socket_all_reduce``
    in place, each chained to the one before, and every :data:`REDUCTIONS_PER_SEGMENT`-th ends a segment
    right after it (every :data:`STEP_REDUCTIONS_PER_SEGMENT`-th in a decode step's program of at most
    :data:`STEP_ROWS` rows): a layer's reductions both run inside its segment, without a return to Python
    (measured, gpt2-medium bf16 decode on 2 virtual sockets: a reduction called from Python between two
    segments cost 20 us, one inside 4-9 us). The chain (each reduction reads the one-element token the
    one before returned) keeps the reductions in program order on every socket, whatever the compiler
    schedules between them. A dtype the C++ collective does not sum stays a cut.

    With one socket the reductions that would run inside and the all-gathers are dropped (a sum over one
    socket is its input), and the segment ends stay as cuts (the identity), so that the layers stay
    segments of the same code.

    With more than one process (``hosts``: one per host, :mod:`numatp.runtime.hosts`) every collective
    stays a step of its own: the executor adds the other hosts' sums (gloo, from Python) to this host's.
    """
    if hosts > 1:
        gm.graph.lint()
        return
    reductions = [n for n in gm.graph.nodes if n.target is COLLECTIVES[0]]
    summed = [i > 0 and (sockets == 1 or SocketComm.supports(n.meta["val"])) for i, n in enumerate(reductions)]
    rows = max((n.meta["val"].numel() // max(n.meta["val"].shape[-1], 1) for n in reductions
                if n.meta["val"].dim()), default=0)
    every = STEP_REDUCTIONS_PER_SEGMENT if rows <= STEP_ROWS else REDUCTIONS_PER_SEGMENT
    ends = {n for i, n in enumerate(reductions) if i and i % every == 0}
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
                token.meta[SEGMENT_END] = True   # the last of the three nodes made for it
    gm.graph.lint()
    gm.recompile()


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


def mark_gathered_matmuls(gm: torch.fx.GraphModule) -> None:
    """Mark the all-gathers that can compute their input in place (:func:`gather_in_place`) of an ATen
    ``mm(x, W)`` or ``addmm(b, x, W)``, with ``W`` a weight (a placeholder, or ``permute(W, [1, 0])`` /
    ``t(W)`` of one), or of a ``numatp::linear`` whose provider writes in place (``mkl_packed``), with
    their :class:`GatheredMatmul` (:data:`GATHERED`), and the nodes the gathers take over
    (:data:`ABSORBED`: left out of the segments). Others (another provider's ``numatp::linear``, an
    elementwise op after the matmul) keep the copy."""
    aten = torch.ops.aten
    linear = getattr(getattr(torch.ops, "numatp", None), "linear", None)
    in_place_codes = {NATIVE[p] for p in IN_PLACE if p in NATIVE}
    for mm in list(gm.graph.nodes):
        if linear is not None and mm.target is linear.default and mm.args[3] in in_place_codes:
            g = gather_in_place(mm)
            if g is None:
                continue
            x, w, bias, code, n, k = mm.args
            g.meta[GATHERED] = GatheredMatmul(x.name, w.name, bias.name if bias is not None else None, False,
                                              code, n, k)
            for taken in {mm, g.args[0]}:
                taken.meta[ABSORBED] = True
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
        g.meta[GATHERED] = GatheredMatmul(x.name, w.name, bias.name if bias is not None else None, transposed)
        for n in taken:
            n.meta[ABSORBED] = True
