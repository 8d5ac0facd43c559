"""The runtime: socket groups (pinned workers) and the executor that runs per-socket programs on them."""

from numatp.runtime.executor import ShardedExecutor
from numatp.runtime.group import GroupAborted, SocketError, SocketGroup
from numatp.runtime.segments import SegmentCompiler

__all__ = ["GroupAborted", "SegmentCompiler", "ShardedExecutor", "SocketError", "SocketGroup"]
