"""The two ways in: ``numatp.compile(model, ...)`` and ``torch.compile(model, backend="numatp", options={...})``.

Both check their options as one :class:`~numatp.backend.options.Options` and build one
:class:`~numatp.backend.core.NumaTPBackend` per compile: two models compiled in one process never share
a topology, a policy or socket workers. ``plans`` and ``placement_report`` find that backend again from
the compiled model, whichever way it was made.

torch hands a registered backend no state of its own: it calls the entry point with ``(gm,
example_inputs, options=...)`` from the wrapper that ``torch.compile`` makes once per call
(``torch._TorchCompileWrapper``). The entry point keeps its backend on that wrapper, which lives at least
as long as the compiled model (Dynamo keeps it for the process, so the backend releases its workers and
shards when the compiled model is collected: ``NumaTPBackend.close``); Dynamo's
``_torchdynamo_orig_backend`` chain leads from the compiled model back to it (:mod:`numatp.backend.registry`).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule

from numatp.backend.core import NumaTPBackend
from numatp.backend.options import AUTO_MEASURE, OPTION_NAMES, RECOMPILE_LIMIT, Options, unknown_names
from numatp.runtime.hosts import HOST_TIMEOUT
from numatp.backend.registry import NOT_RUN, BackendOptionError, backend_of, compiled_by_numatp, numatp_backend
from numatp.generate import generate
from numatp.plan.schema import Plan
from numatp.plan.gemm_pass import GemmOptions
from numatp.topology import Topology

__all__ = ["RECOMPILE_LIMIT", "BackendOptionError", "CompiledModel", "backend_of", "compile", "compiled_by_numatp",
           "numatp_backend", "placement_report", "plans"]

from numatp.zoo._shards import SOURCES

log = logging.getLogger("numatp")


def compile(model: torch.nn.Module, *, sockets: None | int | Topology = None, policy: str = "always",
            mode: str = "inductor", strict_placement: bool = False,
            gemm: bool | GemmOptions | None = None, auto_measure: float = AUTO_MEASURE,
            plan: Any = None, check: bool = False, weights: str | None = None, keep_head: bool = False,
            process_group: Any = None, host_timeout: float = HOST_TIMEOUT, **unknown: Any) -> torch.nn.Module:
    """``torch.compile(model)`` with NUMA-aware tensor parallelism over ``sockets``.

    ``sockets``: None uses the detected sockets, or 2 virtual sockets on a one-node machine with 2 or more
    usable CPUs (:func:`numatp.topology.default_topology`, the rule of the registered backend and of every
    ``numatp`` command too); an int N the first N sockets (N virtual sockets on a one-node machine); or a
    :class:`numatp.Topology`. Each compile logs one line saying which (``numatp.set_progress``).
    ``policy``: "always" shards every block numatp understands, "never" none (the graph runs unsharded
    on all cores), "auto" asks the cost model per block and shards the whole graph or none of it; where
    its two predictions lie within ``auto_measure`` (a fraction) of each other, both plans are built and
    the first call keeps the one it measures faster. ``mode="eager"`` skips Inductor (debugging).
    ``gemm``: pick each weight matmul's kernel (MKL, oneDNN, packed or not) by measuring it on this CPU
    (``True``, or :class:`GemmOptions`), keep Inductor's (``False``), or numatp's default (``None``).
    ``plan``: decisions that override the pass per module, in transformers' tp_plan vocabulary
    (``{"model.layers.*.mlp.down_proj": "rowwise", ...}``, values colwise, rowwise, replicate, vocab; see
    :mod:`numatp.plan.tp_plan`), or ``"hf"`` for the model's
    own tp_plan; ``numatp.plans(compiled)[i].to_tp_plan()`` gives a plan back in the same form. ``check``:
    check the contracts between the pipeline's steps as each graph is built (debugging; see
    :mod:`numatp.plan.contracts`). ``weights``: quantized weights, "int8" (one scale per output channel)
    or "int4" / "int4:g32" / "int4:g64" / "int4:g128" (groups along the input dimension), each with ":a8"
    ("int8:a8", "int4:a8") to quantize every matmul's activations to int8 too, in blocks of 32 as
    llama.cpp's dot products do (integer products, not weight-only), each socket
    quantizing its own shard after sharding; the LM head and the embedding tables are int8 unless
    ``keep_head=True`` keeps them in the model's dtype; None (default) keeps the model's dtype. A model
    quantized by torchao's weight-only configs (``Int8WeightOnlyConfig``, CPU int4
    ``PrototypeInt4WeightOnlyConfig``, symmetric ``IntxWeightOnlyConfig``) is sharded from torchao's own
    values, never re-quantized; its torchao tensors are replaced in ``model`` by their dequantized values
    (:mod:`numatp.quant.torchao`). ``process_group``: more than one host, each process (one per host,
    started by ``torchrun`` or any launcher that initializes ``torch.distributed``) a tensor-parallel rank
    of its own sockets: the plan covers every process's sockets, each process holds its own sockets'
    shards, and each block's reduction adds the other hosts' sums through the group (gloo); None uses the
    default group where ``torch.distributed`` is initialized with more than one process (one log line says
    so). ``host_timeout``: seconds a cross-host collective waits before it fails naming the process that
    stopped. Every process must compile the same model with the same options (checked, named if not);
    policy "auto" is refused across hosts (each machine would decide by its own measurements). See
    :mod:`numatp.runtime.hosts`. An unknown keyword is a TypeError that lists the valid ones and the
    closest (``polcy`` -> ``policy``).

    The first call with an input shape builds its socket programs (tens of seconds: tracing, GEMM
    measurement, Inductor); numatp's progress lines say what it is doing (``numatp.set_progress``).

    The same options work as ``torch.compile(model, backend="numatp", options={"sockets": 2, ...})``.
    Input shapes are static here (``dynamic=False``): each new shape compiles its own programs.

    Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8) compiled entries per code object,
    and by default every ``torch.compile`` of one model class shares them: a few compiles of one model in
    a process would use up the limit and leave a later one (a generation's decode step) running eagerly.
    Each ``numatp.compile`` therefore counts its own entries (``torch.compile(...,
    isolate_recompiles=True)``, torch 2.13 on), whatever else was compiled, and may make up to
    :data:`RECOMPILE_LIMIT` of them (``recompile_limit=``, or the global limit where that is higher): every
    input shape is one entry (each prompt bucket, batch and cache length of :func:`numatp.generate`, which a
    server meets by the dozen), and numatp runs each as built. ``torch.compile(model, backend="numatp")``
    shares the global limit unless given ``isolate_recompiles=True`` and ``recompile_limit=`` itself.
    """
    if unknown:
        raise TypeError(f"numatp.compile() got unknown keyword argument(s) {unknown_names(sorted(unknown))}; "
                        f"it takes {', '.join(OPTION_NAMES)} (see help(numatp.compile))")
    if plan == "hf":
        from numatp.plan.tp_plan import hf_tp_plan
        plan = hf_tp_plan(model)
    options = Options(sockets=sockets, policy=policy, mode=mode, strict_placement=strict_placement, gemm=gemm,
                      auto_measure=auto_measure, plan=plan, check=check, weights=weights, keep_head=keep_head,
                      process_group=process_group, host_timeout=host_timeout)
    imported = _dequantize_torchao(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    backend = NumaTPBackend.from_options(options, names={id(p): n for n, p in params.items()})
    if imported:
        backend.import_quantized({id(params[n]): (n, v) for n, v in imported.items()})
    sources = getattr(model, SOURCES, None)
    if sources:   # numatp.zoo.build(..., shards_only=True): the values are read shard by shard from these
        backend.read_from({id(params[n]): src for n, src in sources.items() if n in params})
    # the backend stays reachable from the result through Dynamo's chain of wrappers (backend_of); an
    # attribute on the result would land on ``model`` itself, and on every later compile of it
    # isolate_recompiles and recompile_limit are keywords of torch.compile's implementation that its
    # overloads do not list
    compiled: Any = torch.compile(model, backend=backend, dynamic=False, **_isolated())
    if type(compiled) is OptimizedModule:
        compiled.__class__ = CompiledModel
    # Dynamo keeps the backend for the life of the process (its code cache, its list of backends): the
    # socket workers, shards and cache copies go with the compiled model instead
    weakref.finalize(compiled, backend.close)
    return compiled


def _dequantize_torchao(model: torch.nn.Module) -> dict[str, Any]:
    """A model quantized by torchao's weight-only configs: its quantized weights replaced, in the model, by
    their dequantized values (so that it traces and plans as a plain model), and the values returned by
    parameter name, from which the weight store cuts each socket's quantized shard
    (:mod:`numatp.quant.torchao`; a torchao format numatp cannot shard is an error naming it)."""
    from numatp.quant.torchao import dequantized, is_torchao

    if not any(map(is_torchao, model.parameters())):
        return {}

    imported = dequantized(model)
    log.info("numatp: %d torchao-quantized weights read as numatp's quantized shards (the model now holds "
             "their dequantized values)", len(imported))
    return imported


def _isolated() -> dict[str, Any]:
    """This compile's own count of Dynamo's compiled entries and its own limit (see compile's docstring),
    where torch has them."""
    params = inspect.signature(torch.compile).parameters
    out: dict[str, Any] = {}
    if "isolate_recompiles" in params:
        out["isolate_recompiles"] = True
        if "recompile_limit" in params:
            out["recompile_limit"] = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    return out


class CompiledModel(OptimizedModule):
    """What :func:`compile` returns for a module: ``torch.compile``'s module, plus ``generate`` through
    NUMA-TP (the model's own ``generate`` stays eager)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        """transformers-style ``generate`` whose prefill and decode steps run as socket programs:
        :func:`numatp.generate.generate_timed` lists the options."""
        return generate(self, input_ids, attention_mask, **kwargs)


def _run(compiled: Any) -> NumaTPBackend:
    """The backend of a compiled model that has run; the same error before its first call, whichever
    way it was compiled (the registered backend does not exist before then)."""
    backend = backend_of(compiled)
    if not backend.graphs:
        raise ValueError(NOT_RUN)
    return backend


def plans(compiled: Any) -> list[Plan]:
    """The plan of every program a compiled model has run: one per Dynamo graph and input signature,
    in the order they were built (``explain`` prints the same plans without compiling). Before the
    model's first call there is none: a ValueError says to call it once, for either entry point."""
    return _run(compiled).plans


def placement_report(compiled: Any) -> dict[str, Any]:
    """Where each socket's weights are: ``{"ranks": [{"socket", "node", "pages": {node: n}}], "local_fraction"}``.
    Before the model's first call a ValueError says to call it once, as :func:`plans` does."""
    return _run(compiled).weights.report()
