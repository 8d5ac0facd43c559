"""From the Dynamo graph to the ATen-level inference graph the NUMA-TP pass works on.

The graph is functionalised and decomposed with Inductor's own decomposition table, traced with fake
tensors at the concrete input shapes (so every node has ``meta["val"]`` with its global shape), and
keeps ``nn_module_stack`` for messages. Parameters stay placeholders.

An input the model writes in place (a static KV cache's keys, values and lengths) stays a placeholder
that the graph ends up ``copy_``-ing its new value into; :attr:`AtenGraph.states` marks it. Each such
write-back is moved to right after the last read of the old value, so that it lands in the same
compiled segment as the write (where Inductor turns ``index_put`` + ``copy_`` into one in-place write).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch._inductor.decomposition import select_decomp_table

__all__ = ["AtenGraph", "trace_aten", "parameter_name"]


@dataclass
class AtenGraph:
    """An ATen graph, and for each placeholder whether it is a parameter and its readable name."""

    gm: torch.fx.GraphModule
    is_param: list[bool]
    names: list[str]
    states: list[bool] | None = None   # per placeholder: an input the graph writes in place (a cache)
    modules: list[dict[str, str]] | None = None
    """Per placeholder, the module that reads it, by use: ``{"lookup": "model.embed_tokens", "matmul":
    "lm_head"}`` (a tied table is both; ``other`` for a norm's weight), from the Dynamo graph's
    ``nn_module_stack``."""

    def __post_init__(self) -> None:
        if self.states is None:
            self.states = [False] * len(self.is_param)
        if self.modules is None:
            self.modules = [{} for _ in self.is_param]


_DYNAMO_PARTS = re.compile(r"_(modules|parameters|buffers)_")


def parameter_name(placeholder: str) -> str:
    """Readable dotted name of a lifted Dynamo placeholder.

    >>> parameter_name("l_self_modules_h_modules_0_modules_attn_modules_c_attn_parameters_weight_")
    'h.0.attn.c_attn.weight'
    """
    name = placeholder.removeprefix("l_self_").removeprefix("L_self_").rstrip("_")
    name = re.sub(r"^(l|L)__self___", "", name)
    return _DYNAMO_PARTS.sub(".", "_" + name).lstrip("._")


def trace_aten(
    gm: torch.fx.GraphModule, example_inputs: list, names: dict[int, str] | None = None
) -> AtenGraph:
    """Trace ``gm`` at the shapes of ``example_inputs`` into a functional ATen inference graph.

    ``names`` maps ``id(parameter)`` to its qualified name when the caller knows the module.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    with torch.no_grad(), fx_traceback.preserve_node_meta(), fake_mode:
        traced = make_fx(
            torch.func.functionalize(gm, remove="mutations"),
            decomposition_table=select_decomp_table(),
            tracing_mode="real",
            pre_dispatch=False,
        )(*fake_args)
    # dead values the trace leaves behind (bf16 GPT-2: a cast of the tied weight's transpose nobody reads)
    # would count as readers of a whole weight; ops with side effects are kept
    traced.graph.eliminate_dead_code()
    written = _write_backs_early(traced)
    traced.recompile()
    is_param = [isinstance(a, torch.nn.Parameter) for a in example_inputs]
    readable = []
    for i, a in enumerate(example_inputs):
        if names is not None and id(a) in names:
            readable.append(names[id(a)])
        elif i < len(placeholders):
            readable.append(parameter_name(placeholders[i].name) if is_param[i] else placeholders[i].name)
        else:
            readable.append(f"input{i}")
    states = [n in written for n in traced.graph.nodes if n.op == "placeholder"]
    return AtenGraph(gm=traced, is_param=is_param, names=readable, states=states,
                     modules=[_reading_modules(p) for p in placeholders])


_MATMULS = (torch.nn.functional.linear, torch._C._nn.linear, torch.addmm, torch.mm, torch.matmul, operator.matmul)


def _reading_modules(placeholder: torch.fx.Node) -> dict[str, str]:
    """The modules whose calls read a Dynamo placeholder: the embedding that looks it up, the layer whose
    matmul multiplies by it."""
    out: dict[str, str] = {}
    for u in placeholder.users:
        stack = u.meta.get("nn_module_stack")
        if not stack:
            continue
        # "L['self'].model.layers.0.mlp.down_proj" (or "L['args'][0]...." where the module came in as an
        # argument): the module's path from the compiled model
        path = re.sub(r"^L(\[[^\]]*\])+\.?|^L__self__\.?", "", list(stack.values())[-1][0])
        kind = ("lookup" if u.target is torch.nn.functional.embedding else
                "matmul" if u.target in _MATMULS else "other")
        out.setdefault(kind, path)
    return out


def _write_backs_early(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Move each ``copy_(input, new)`` that functionalisation put at the end of the graph to right after
    ``new`` and every other read of ``input``; return the inputs written."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    written = set()
    for node in list(gm.graph.nodes):
        if node.target is not torch.ops.aten.copy_.default or node.args[0].op != "placeholder":
            continue
        dst, src = node.args[0], node.args[1]
        written.add(dst)
        after = max([src, *(u for u in dst.users if u is not node)], key=order.__getitem__)
        if order[after] < order[node]:
            after.append(node)
    gm.graph.lint()
    return written
