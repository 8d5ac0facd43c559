"""The demo and explain commands, run as a user would."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def _numatp(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numatp", *args], capture_output=True, text=True, timeout=timeout,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"} | _keep_env())


def _keep_env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}


def test_explain_json_lists_blocks_and_reductions():
    r = _numatp("explain", "gpt2", "--tiny", "--sockets", "2", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    (g,) = info["graphs"]
    assert g["reductions"] == 4 and g["gathers"] == 1
    kinds = sorted(b["kind"] for b in g["blocks"] if b["sharded"])
    assert kinds == ["attention", "attention", "lm_head", "mlp", "mlp"]
    assert 0.5 < g["sharded_fraction"] < 1.0
    assert sum(g["socket_bytes"]) > g["model_bytes"]  # replicated tensors are counted on each socket


def test_explain_bad_socket_count_is_a_clear_error():
    r = _numatp("explain", "gpt2", "--tiny", "--sockets", "9")
    assert r.returncode == 2
    assert "cannot split over 9 sockets" in r.stderr and "fewer sockets" in r.stderr


def test_demo_runs_baseline_and_numatp_side_by_side():
    r = _numatp("demo", "--tiny", "--warmup", "0", "--iters", "1", "--seq", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"speedup numatp / baseline: \d+\.\d\dx", r.stdout)
    assert "socket 1 weights -> node 0" in r.stdout
