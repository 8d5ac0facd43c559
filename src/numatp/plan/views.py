"""How a shard along one dimension moves through view/reshape: the dimension-group algebra.

A view regroups dimensions whose sizes multiply to the same number, e.g. ``(B, S, 768) -> (B, S, 12, 64)``
has groups ``[0]->[0], [1]->[1], [2]->[2, 3]``. A shard of the 768 features by whole heads becomes a shard
of dimension 2 (heads); a shard that cuts a head in two cannot be expressed and is reported as such.
"""

from __future__ import annotations

import math

import numpy as np

from numatp.plan.schema import IndexSet

__all__ = ["view_groups", "map_shard_through_view", "ViewError"]

_MAX_GROUP = 1 << 22  # elements enumerated per group; beyond this the view is treated as unsupported


class ViewError(ValueError):
    """The shard cannot follow this view."""


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair minimal runs of source and target dimensions with equal products (size-1 dims join a run)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi: list[int] = []
        gj: list[int] = []
        pi = pj = 1
        while True:
            if pi == pj and gi and gj:
                # absorb trailing size-1 dims into this group
                while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
                    gi.append(i)
                    i += 1
                while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
                    gj.append(j)
                    j += 1
                break
            if (pi <= pj or j >= len(dst)) and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _flat(sizes: list[int], dim_pos: int, idx: np.ndarray) -> np.ndarray:
    """Flattened (row-major) positions within a group of all elements whose ``dim_pos`` index is in ``idx``."""
    grids = [np.arange(s) if k != dim_pos else idx for k, s in enumerate(sizes)]
    strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
    flat = np.zeros((1,), dtype=np.int64)
    for g, st in zip(grids, strides):
        flat = (flat[:, None] + g[None, :] * st).reshape(-1)
    return flat


def map_shard_through_view(
    src: tuple[int, ...], dst: tuple[int, ...], dim: int, sets: tuple[IndexSet, ...]
) -> tuple[int, tuple[IndexSet, ...]]:
    """The dimension of ``dst`` and the per-socket index sets that a shard ``(dim, sets)`` of ``src`` becomes."""
    for gi, gj in view_groups(src, dst):
        if dim not in gi:
            continue
        if gi == [dim] and len(gj) == 1:
            return gj[0], sets
        in_sizes = [src[k] for k in gi]
        out_sizes = [dst[k] for k in gj]
        if math.prod(in_sizes) > _MAX_GROUP:
            raise ViewError(f"view {src} -> {dst} regroups {math.prod(in_sizes)} elements around the shard")
        result_dim: int | None = None
        result: list[IndexSet] = []
        for s in sets:
            flat = _flat(in_sizes, gi.index(dim), np.asarray(s.indices(), dtype=np.int64))
            found = None
            for pos, od in enumerate(gj):
                if out_sizes[pos] == 1:
                    continue
                stride = math.prod(out_sizes[pos + 1:])
                coords = np.unique((flat // stride) % out_sizes[pos])
                others = math.prod(out_sizes) // out_sizes[pos]
                if len(coords) * others == len(flat):
                    expect = _flat(out_sizes, pos, coords)
                    if np.array_equal(np.sort(flat), np.sort(expect)):
                        found = (od, IndexSet(_intervals(coords)))
                        break
            if found is None or (result_dim is not None and found[0] != result_dim):
                raise ViewError(
                    f"view {src} -> {dst} splits the sharded dimension {dim} across target dimensions "
                    f"{gj}; the shard ({s}) is not whole along any one of them"
                )
            result_dim = found[0]
            result.append(found[1])
        assert result_dim is not None
        return result_dim, tuple(result)
    raise ViewError(f"dimension {dim} not found in view {src} -> {dst}")


def _intervals(sorted_idx: np.ndarray) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for v in sorted_idx.tolist():
        if out and out[-1][1] == v:
            out[-1] = (out[-1][0], v + 1)
        else:
            out.append((v, v + 1))
    return tuple(out)
