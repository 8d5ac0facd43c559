"""The demo and explain commands, run as a user would."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys


def _numatp(*args: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numatp", *args], capture_output=True, text=True, timeout=timeout,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"} | _keep_env() | (env or {}))


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


def test_explain_gemm_shows_provider_and_rate_per_socket_shape(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    r = _numatp("explain", "gpt2", "--tiny", "--sockets", "2", "--gemm", "--json", env=env)
    assert r.returncode == 0, r.stderr
    (g,) = json.loads(r.stdout)["graphs"]
    rows = g["gemm"]["rows"]
    assert g["gemm"]["cache"].startswith(str(tmp_path))
    # tiny GPT-2 (hidden 64, 2 layers, 2 sockets): each socket holds half of every sharded weight
    assert {r["rank"] for r in rows} == {0, 1}
    shapes = {(r["k"], r["n"]) for r in rows if r["rank"] == 0}
    assert {(64, 96), (32, 64), (64, 128), (128, 64)} <= shapes  # c_attn, attn c_proj, c_fc, mlp c_proj halves
    assert all(r["m"] == 128 and r["threads"] == 1 for r in rows)
    for row in rows:
        assert row["rates"]["aten"] > 0 and row["gflops"] == row["rates"][row["provider"]] > 0
        best = max(row["rates"].values())
        assert row["provider"] == "aten" or row["gflops"] == best
    text = _numatp("explain", "gpt2", "--tiny", "--sockets", "2", "--gemm", env=env)
    assert text.returncode == 0, text.stderr
    assert "GEMM providers" in text.stdout and "128 x 64 x 96" in text.stdout
    never = _numatp("explain", "gpt2", "--tiny", "--sockets", "2", "--gemm", "--policy", "never", "--json", env=env)
    assert never.returncode == 0, never.stderr
    (graph,) = json.loads(never.stdout)["graphs"]
    # unsharded: one program on one socket of all CPUs, whole weights, measured providers as well
    assert graph["gemm"]["unsharded"] and {r["rank"] for r in graph["gemm"]["rows"]} == {0}
    assert {(r["k"], r["n"]) for r in graph["gemm"]["rows"]} >= {(64, 192), (64, 64), (64, 256), (256, 64)}
    assert all(r["threads"] == len(os.sched_getaffinity(0)) and r["gflops"] > 0 for r in graph["gemm"]["rows"])


def test_explain_auto_shows_predictions_and_whether_compile_measures(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}   # no calibrated profile: the built-in estimate
    r = _numatp("explain", "gpt2", "--tiny", "--sockets", "2", "--policy", "auto", "--json", env=env)
    assert r.returncode == 0, r.stderr
    (graph,) = json.loads(r.stdout)["graphs"]
    pred = graph["predicted"]
    assert pred["sharded"] > 0 and pred["unsharded"] > 0
    from numatp.backend import AUTO_MEASURE
    assert graph["measures_both"] == (max(pred.values()) / min(pred.values()) - 1 <= AUTO_MEASURE)
    text = _numatp("explain", "gpt2", "--tiny", "--sockets", "2", "--policy", "auto", env=env)
    assert f"policy auto: predicted {1e3 * pred['sharded']:.1f} ms sharded" in text.stdout
    assert ("builds both" in text.stdout) == graph["measures_both"]


def test_topo_shows_gemm_ceilings_of_this_cpu(tmp_path):
    from numatp.runtime.gemm import GemmShape, GemmTable

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    empty = _numatp("topo", env=env)
    assert empty.returncode == 0 and "none measured on this CPU yet" in empty.stdout
    GemmTable(tmp_path / "numatp").put({GemmShape(512, 1024, 4096, "float32", "kn", 2): {"aten": 61.5, "onednn": 70.25},
                                        GemmShape(128, 64, 64, "float32", "kn", 2): {"aten": 80.0, "onednn": 3.0}})
    r = _numatp("topo", "--json", env=env)
    assert json.loads(r.stdout)["gemm_ceilings"] == {"float32": {"2": {"aten": 80.0, "onednn": 70.25}}}
    text = _numatp("topo", env=env).stdout
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("float32"))
    assert row == ["float32", "2", "80.0", "70.2", "aten"] or row == ["float32", "2", "80.0", "70.3", "aten"]


def test_explain_bad_socket_count_is_a_clear_error():
    r = _numatp("explain", "gpt2", "--tiny", "--sockets", "9")
    assert r.returncode == 2
    assert "cannot split over 9 sockets" in r.stderr and "fewer sockets" in r.stderr


def test_demo_runs_baseline_and_numatp_side_by_side():
    r = _numatp("demo", "--tiny", "--warmup", "0", "--iters", "1", "--seq", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"speedup numatp / baseline: \d+\.\d\dx", r.stdout)
    assert "socket 1 weights -> node 0" in r.stdout
