"""The cross-socket collectives as graph ops: ``numatp::all_reduce`` and ``numatp::all_gather``.

They are visible nodes of the per-socket program so that tests can count them and the runtime can cut
the program at them. Called outside a socket group (one socket, or plain eager use of a graph) they
behave as a group of one: the reduction of one partial sum is itself, the gather of the only shard is
the whole tensor only when it already has the global size.
"""

from __future__ import annotations

import torch

__all__ = ["all_reduce", "all_gather", "COLLECTIVES"]


@torch.library.custom_op("numatp::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, tag: int) -> torch.Tensor:
    """Sum of the per-socket partials of ``x``; ``tag`` numbers the reduction within the program."""
    return x.clone()


@all_reduce.register_fake
def _(x: torch.Tensor, tag: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("numatp::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, global_size: int, tag: int) -> torch.Tensor:
    """The full tensor whose slices along ``dim`` the sockets hold; ``global_size`` is its size there."""
    if x.shape[dim] != global_size:
        raise RuntimeError(
            f"numatp::all_gather(tag={tag}) ran outside a socket group with a shard of size "
            f"{x.shape[dim]} along dim {dim}, not the global {global_size}; run the program through "
            "numatp's runtime or reference executor"
        )
    return x.clone()


@all_gather.register_fake
def _(x: torch.Tensor, dim: int, global_size: int, tag: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = global_size
    return x.new_empty(shape)


COLLECTIVES = (torch.ops.numatp.all_reduce.default, torch.ops.numatp.all_gather.default)
