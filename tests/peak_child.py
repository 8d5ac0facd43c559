"""Child of ``test_entry.test_sharded_call_peak_memory_is_bounded``: the activation peak of one call.

Run with ``MALLOC_MMAP_THRESHOLD_`` fixed (glibc then maps every large buffer on its own and unmaps it on
free), so the process's resident-set high-water mark follows the live bytes of the call. Prints one JSON
object: per layer count and policy, the lowest of ``CALLS`` calls' peaks above the resident set before the
call (MiB; the two sockets' own peaks meet or miss by thread timing, and the lowest is the call where they
missed least), and the collectives the workers performed in those calls together. Both policies run the same ATen programs on numatp's
executor (GEMM provider forced to ATen, segments uncompiled), so the peaks differ only by the sharding.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings

import torch
import transformers

import numatp
from numatp.backend import backend_of
from numatp.topology import Topology


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _peak(fn) -> float:
    """MiB the resident set rose above its level before ``fn()`` at its highest."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset VmHWM to the current resident set
    base = _status("VmRSS:")
    fn()
    return (_status("VmHWM:") - base) / 2**20


CALLS = 3


def main(layer_counts: list[int]) -> None:
    warnings.filterwarnings("ignore")
    out = {}
    for layers in layer_counts:
        cfg = transformers.GPT2Config(n_embd=256, n_layer=layers, n_head=4, vocab_size=512, n_positions=1024,
                                      use_cache=False)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).eval()
        ids = torch.randint(0, 512, (2, 512))
        for policy in ("never", "always"):
            torch._dynamo.reset()
            compiled = numatp.compile(model, sockets=Topology.virtual(sockets=2), mode="eager", policy=policy,
                                      gemm=numatp.GemmOptions(force="aten"))
            with torch.inference_mode():
                compiled(input_ids=ids)
                before = dict(backend_of(compiled).performed)
                peak = min(_peak(lambda: compiled(input_ids=ids)) for _ in range(CALLS))
            after = backend_of(compiled).performed
            out[f"{layers}-{policy}"] = {"peak_mib": peak, "calls": CALLS,
                                         "performed": {k: after[k] - before[k] for k in after}}
    print(json.dumps(out))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
