"""A plan as input and output, in transformers' ``tp_plan`` vocabulary.

A tp_plan maps module patterns to a decision: ``{"model.layers.*.self_attn.q_proj": "colwise", ...}``.
A pattern is a dotted module path where ``*`` stands for one path component (a layer index); it matches
a module whose name ends with it (``layers.*.mlp.down_proj`` matches ``model.layers.3.mlp.down_proj``).
numatp's values:

- ``"colwise"``: the projection's output features are split over the sockets (a block's Q/K/V or
  up/gate projection, or the LM head);
- ``"rowwise"``: its input features are split and its partial sums all-reduced (a block's output or
  down projection);
- ``"replicate"``: a full copy on every socket (a whole block when its output projection is replicated;
  a single column projection, say K or V, beside split ones);
- ``"vocab"``: an embedding table split by vocabulary rows, its lookups summed by one all-reduce.

transformers' own variants are read as these: ``colwise_rep``, ``local_colwise`` and
``colwise_gather_output`` as colwise, ``rowwise_rep``, ``local_rowwise`` and ``rowwise_split_input`` as
rowwise, ``embedding_rowwise`` as vocab, ``replicated_with_grad_allreduce`` and ``local`` as replicate.

:func:`parse` checks a plan; :func:`resolve` finds each pattern's modules in one graph (a pattern that
matches none is an error naming the modules it could have meant); :meth:`numatp.plan.Plan.to_tp_plan`
writes a plan the pass made in the same vocabulary, so that it can be edited and passed back.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["VALUES", "TpPlan", "compress", "hf_tp_plan", "parse"]

VALUES = ("colwise", "rowwise", "replicate", "vocab")

_SYNONYMS = {
    "colwise": "colwise", "colwise_rep": "colwise", "local_colwise": "colwise", "colwise_gather_output": "colwise",
    "rowwise": "rowwise", "rowwise_rep": "rowwise", "local_rowwise": "rowwise", "rowwise_split_input": "rowwise",
    "replicate": "replicate", "replicated_with_grad_allreduce": "replicate", "local": "replicate",
    "vocab": "vocab", "embedding_rowwise": "vocab",
}


@dataclass(frozen=True)
class TpPlan:
    """A checked plan: ``(pattern, value)`` pairs in the order given, values normalised to :data:`VALUES`."""

    entries: tuple[tuple[str, str], ...]
    source: str = "plan"
    """Where the plan came from, for messages: ``plan`` (the caller's), or ``the model's tp_plan``."""

    def decisions(self, modules: Iterable[str]) -> dict[str, tuple[str, str]]:
        """``{module: (value, pattern)}`` for every module some pattern matches; where two patterns give one
        module different values, the one with fewer ``*`` decides (``layers.3.mlp.down_proj`` over
        ``layers.*.mlp.down_proj``). A pattern that matches no module, or two as specific as each other
        that disagree, is a ValueError."""
        modules = list(modules)
        out: dict[str, tuple[str, str]] = {}
        for pattern, value in self.entries:
            rx = _regex(pattern)
            hits = [m for m in modules if rx.search(m)]
            if not hits:
                near = difflib.get_close_matches(pattern, modules, n=3, cutoff=0.3)
                raise ValueError(f"{self.source}: pattern {pattern!r} matches no module of this graph"
                                 + (f"; did you mean {', '.join(map(repr, near))}?" if near else "")
                                 + " (patterns name modules, e.g. 'model.layers.*.mlp.down_proj')")
            for m in hits:
                if m in out and out[m][0] != value:
                    other = out[m][1]
                    if other.count("*") == pattern.count("*"):
                        raise ValueError(f"{self.source}: {m} is {out[m][0]!r} by pattern {other!r} and {value!r} "
                                         f"by pattern {pattern!r}; make the patterns agree")
                    if pattern.count("*") > other.count("*"):
                        continue   # the pattern with fewer wildcards (the named layer) decides
                out[m] = (value, pattern)
        return out


def parse(plan: Mapping[str, str] | TpPlan, *, source: str = "plan") -> TpPlan:
    """Check ``plan`` (a dict of module pattern to value) and normalise its values."""
    if isinstance(plan, TpPlan):
        return plan
    if not isinstance(plan, Mapping):
        raise ValueError(f"{source}={plan!r}: pass a dict of module patterns to {', '.join(VALUES)} "
                         "(or 'hf' for the model's own tp_plan)")
    entries = []
    for pattern, value in plan.items():
        if not isinstance(pattern, str) or not pattern or not re.fullmatch(r"[\w*]+(\.[\w*]+)*", pattern):
            raise ValueError(f"{source}: {pattern!r} is not a module pattern (dotted names, * for one component)")
        norm = _SYNONYMS.get(value) if isinstance(value, str) else None
        if norm is None:
            synonyms = ", ".join(k for k in _SYNONYMS if k not in VALUES)
            raise ValueError(f"{source}: {pattern!r}: {value!r} is not a decision numatp takes; use one of "
                             f"{', '.join(VALUES)} (or transformers' {synonyms})")
        entries.append((pattern, norm))
    return TpPlan(tuple(entries), source)


def hf_tp_plan(model: object) -> TpPlan:
    """The model's own tp_plan from transformers (its class's ``_tp_plan``, or the config's
    ``base_model_tp_plan`` under the base model's prefix); a ValueError where it has none."""
    own = getattr(model, "_tp_plan", None)
    if not own:
        base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        own = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}
    if not own:
        raise ValueError(f"plan='hf': {type(model).__name__} ships no tp_plan (transformers has none for "
                         f"{getattr(getattr(model, 'config', None), 'model_type', 'this model')}); pass a dict, or "
                         "leave plan unset and let the pass decide (numatp explain shows its plan)")
    return parse(own, source=f"{type(model).__name__}'s tp_plan")


def _regex(pattern: str) -> re.Pattern:
    body = r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(rf"(^|\.){body}$")


def compress(decisions: Mapping[str, str]) -> dict[str, str]:
    """Per-module decisions with the numeric path components that differ only by layer written as ``*``,
    where every module of that pattern has the same value."""
    groups: dict[str, dict[str, str]] = {}
    for module, value in decisions.items():
        pattern = ".".join("*" if part.isdigit() else part for part in module.split("."))
        groups.setdefault(pattern, {})[module] = value
    out: dict[str, str] = {}
    for pattern, members in groups.items():
        if len(set(members.values())) == 1:
            out[pattern] = next(iter(members.values()))
        else:
            out.update(members)
    return dict(sorted(out.items()))
