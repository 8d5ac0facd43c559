"""What the side-by-side scripts of this folder share: the modes they compare, and one child process per
configuration (each child prints one JSON line last; a child that fails has its output tail shown and is
left out)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable


def run_children(script: str, configs: list[tuple], argv: Callable[[tuple], list[str]], out: str | None) -> list[dict]:
    """Run ``python script --child ...`` (``argv(config)`` gives the arguments after ``script``) for each
    configuration in turn; print and return its JSON line, and append it to ``out`` when given."""
    rows = []
    for i, config in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {' '.join(map(str, config))}", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, script, *argv(config)], capture_output=True, text=True)
        if r.returncode:
            sys.stderr.write(r.stderr[-3000:])
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def compiled_modes(model, cpus: int, without: tuple[str, ...] = ()) -> dict[str, Callable[[], object]]:
    """How to compile each mode: torch.compile (the baseline), numatp on 1 and 2 virtual sockets, and on 4
    where the process has 4 CPUs; with ``without``, numatp on 1 and 2 sockets again without those GEMM
    providers (``numatp-1-without-gemv``), to see what they bring."""
    import torch

    import numatp
    from numatp.plan.gemm_pass import GemmOptions
    from numatp.topology import Topology

    modes = {"baseline": lambda: torch.compile(model)}
    for n in (1, 2, 4) if cpus >= 4 else (1, 2):
        modes[f"numatp-{n}"] = lambda n=n: numatp.compile(model, sockets=Topology.virtual(sockets=n))
    if without:
        kept = GemmOptions(providers=tuple(p for p in GemmOptions().providers if p not in without))
        for n in (1, 2):
            modes[f"numatp-{n}-without-{'-'.join(without)}"] = lambda n=n: numatp.compile(
                model, sockets=Topology.virtual(sockets=n), gemm=kept)
    return modes
