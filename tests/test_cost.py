"""Cost model: the paper's results as the test, model sanity, profile JSON, and the two commands.

Paper = Rathnayaka Weerakoon et al., "NUMA-Torch", HiPC 2026 (/work/shared/seed/numa-torch-paper.txt).
Its sweep (Sec. III-B/D): six models x batch {1, 2, 4, 8} x sequence {128 ... 4096} = 144 configurations.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from numatp.cost import (
    BUILTIN_PROFILES, MachineProfile, blocks_for, choose, decide, load_profile, predict, predict_model,
    save_profile,
)

MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "bert-small", "bert-large", "gemma3-270m")  # Table III
BATCHES = (1, 2, 4, 8)
SEQS = (128, 256, 512, 1024, 2048, 4096)
# Sizes of Table III, so these tests need no transformers import.
SHAPES = {
    "gpt2": dict(layers=12, hidden=768, heads=12, intermediate=3072, vocab=50257, mlp="gelu"),
    "gpt2-medium": dict(layers=24, hidden=1024, heads=16, intermediate=4096, vocab=50257, mlp="gelu"),
    "gpt2-large": dict(layers=36, hidden=1280, heads=20, intermediate=5120, vocab=50257, mlp="gelu"),
    "bert-small": dict(layers=4, hidden=512, heads=8, intermediate=2048, vocab=30522, mlp="gelu"),
    "bert-large": dict(layers=24, hidden=1024, heads=16, intermediate=4096, vocab=30522, mlp="gelu"),
    "gemma3-270m": dict(layers=18, hidden=640, heads=4, kv_heads=1, head_dim=256, intermediate=2048,
                        vocab=262144, mlp="geglu"),
}


def _geo(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def _sweep(platform: str) -> dict[tuple[str, int, int], dict[str, float]]:
    p = load_profile(platform)
    return {(m, b, s): predict_model(SHAPES[m], b, s, "float32", p) for m in MODELS for b in BATCHES for s in SEQS}


@pytest.fixture(scope="module")
def sweeps() -> dict[str, dict[tuple[str, int, int], dict[str, float]]]:
    return {name: _sweep(name) for name in BUILTIN_PROFILES}


def _gap(msg: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"model does not reproduce the paper yet: {msg}")


@_gap("small-model, short-sequence cells are compute-bound in the model and come out at 0.97-0.99x")
@pytest.mark.parametrize("platform", ["haswell-2s", "cascadelake-2s"])
def test_two_socket_speedup_above_one_everywhere(sweeps, platform):
    # Paper Sec. III-D / Table IV: NUMA-TP is slower than default in 0/144 configurations (Cascade
    # Lake); Fig. 8a: every Haswell cell > 1.
    worst = min(r["speedup"] for r in sweeps[platform].values())
    assert worst > 1.0, f"{platform}: slowest predicted speedup {worst:.2f}x"


def test_four_socket_slower_at_short_sequences(sweeps):
    # Paper Sec. III-E, Fig. 9: geometric mean 0.48x at s=128; no configuration at s <= 512 faster.
    at128 = _geo([r["speedup"] for (m, b, s), r in sweeps["haswell-ex-4s"].items() if s == 128])
    assert at128 < 1.0, f"predicted geo-mean at s=128 is {at128:.2f}x, paper 0.48x"


def test_four_socket_faster_at_long_sequences(sweeps):
    # Paper Sec. III-E: "Every measured configuration at s >= 2048 is faster than the baseline".
    worst = min(r["speedup"] for (m, b, s), r in sweeps["haswell-ex-4s"].items() if s >= 2048)
    assert worst > 1.0, f"slowest predicted 4-socket speedup at s >= 2048 is {worst:.2f}x"


@_gap("predicted 4-socket geo-mean crosses 1.0 between s=256 and s=512 (0.98, 1.00, 1.07 at 128/256/512), not between 1024 and 2048")
def test_four_socket_crossover_between_1024_and_2048(sweeps):
    # Paper Fig. 9: geometric mean crosses 1.0x between s=1024 and s=2048.
    per_seq = {s: _geo([r["speedup"] for (m, b, q), r in sweeps["haswell-ex-4s"].items() if q == s]) for s in SEQS}
    assert per_seq[1024] < 1.0 < per_seq[2048], per_seq


def test_cascadelake_geomean_within_25_percent(sweeps):
    # Paper Table IV: NUMA-TP geometric-mean speedup 1.38x over the 144 Cascade Lake configurations.
    geo = _geo([r["speedup"] for r in sweeps["cascadelake-2s"].values()])
    assert 0.75 * 1.38 <= geo <= 1.25 * 1.38, f"predicted {geo:.2f}x, paper 1.38x"


def test_four_socket_geomeans_within_25_percent(sweeps):
    # Paper Sec. III-E: geo-mean 1.56x at s=4096, 1.38x over all configurations with s >= 2048.
    runs = sweeps["haswell-ex-4s"]
    at4096 = _geo([r["speedup"] for (m, b, s), r in runs.items() if s == 4096])
    long = _geo([r["speedup"] for (m, b, s), r in runs.items() if s >= 2048])
    assert 0.75 * 1.56 <= at4096 <= 1.25 * 1.56, f"s=4096: predicted {at4096:.2f}x, paper 1.56x"
    assert 0.75 * 1.38 <= long <= 1.25 * 1.38, f"s>=2048: predicted {long:.2f}x, paper 1.38x"


@_gap("one-socket is predicted 0.91x of the baseline, paper 0.59x")
def test_single_socket_geomean_within_25_percent(sweeps):
    # Paper Table IV: single socket (--cpunodebind=0 --membind=0) geometric mean 0.59x on Cascade Lake.
    geo = _geo([r["unsharded"] / r["one-socket"] for r in sweeps["cascadelake-2s"].values()])
    assert 0.75 * 0.59 <= geo <= 1.25 * 0.59, f"predicted {geo:.2f}x, paper 0.59x"


@_gap("Haswell's and Cascade Lake's predicted geo-means are equal (1.31x each)")
def test_haswell_geomean_above_cascadelake(sweeps):
    # Paper Sec. III-C1: the gain "tracks the number of cores per socket": Haswell (6 cores) speedups
    # frequently exceed 2.0x, Cascade Lake (15 cores) ranges 1.10-1.87x.
    has = _geo([r["speedup"] for r in sweeps["haswell-2s"].values()])
    cas = _geo([r["speedup"] for r in sweeps["cascadelake-2s"].values()])
    assert has > cas, f"Haswell {has:.2f}x, Cascade Lake {cas:.2f}x"


@pytest.mark.parametrize("choice", ["sharded", "unsharded", "one-socket"])
@pytest.mark.parametrize("platform", BUILTIN_PROFILES)
def test_more_tokens_take_more_time(platform, choice):
    p = load_profile(platform)
    for kind_index in (0, 1, -1):  # attention, MLP, LM head
        times = [predict(blocks_for(SHAPES["gpt2"], b, s)[kind_index], p, choice) for b, s in
                 [(1, 128), (1, 512), (2, 512), (4, 2048), (8, 4096)]]
        assert times == sorted(times) and times[0] < times[-1], times


def test_sharded_time_falls_with_sockets_when_compute_bound():
    # A compute-bound profile: huge bandwidth, tiny sync costs; then sharded time ~ 1/sockets.
    p = replace(load_profile("haswell-ex-4s"), local_bw_gbs=1e6, remote_bw_gbs=1e6, barrier_us=0.1)
    mlp = blocks_for(SHAPES["gpt2-large"], 8, 1024)[1]
    times = [predict(mlp, p, "sharded", sockets=n) for n in (1, 2, 3, 4)]
    assert times == sorted(times, reverse=True), times
    assert times[3] < 0.3 * times[0]


def test_profile_json_round_trip(tmp_path):
    for name in BUILTIN_PROFILES:
        p = load_profile(name)
        assert p.sources, f"{name} has no sources"
        again = load_profile(save_profile(p, tmp_path / f"{name}.json"))
        assert again == p


def test_profile_rejects_unknown_keys(tmp_path):
    data = load_profile("haswell-2s").to_json() | {"bandwith": 1}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bandwith"):
        load_profile(tmp_path / "bad.json")


def test_choose_and_decide_agree():
    p = load_profile("haswell-ex-4s")
    blocks = blocks_for(SHAPES["bert-small"], 2, 4096)[:2]
    decisions = decide(blocks, p, sockets=4)
    for b, d in zip(blocks, decisions):
        best, times = choose(b, p)
        assert d.times == times and d.choice in ("sharded", "unsharded")
        assert d.choice == min(("sharded", "unsharded"), key=times.__getitem__)
        assert "haswell-ex-4s" in d.reason


def _cli(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os
    return subprocess.run([sys.executable, "-m", "numatp", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, **(env or {})})


def test_predict_json_has_speedup():
    out = _cli("predict", "--platform", "haswell-2s", "--model", "gpt2", "--batch", "1", "--seq", "256",
               "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["speedup"] > 0 and set(result["seconds"]) == {"sharded", "unsharded", "one-socket"}


def test_calibrate_quick_virtual_two_sockets(tmp_path):
    # The one test that measures this host: --quick on a virtual 2-socket topology (under a minute).
    path = tmp_path / "profile.json"
    out = _cli("calibrate", "--quick", "--virtual", "2", "--out", str(path), timeout=180,
               env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    assert "GEMM" in out.stderr  # progress goes to stderr
    # the GEMM ceilings: printed per dtype and provider, and written to the table gemm=True reads
    from numatp.runtime.gemm import CEILING_SHAPE, ceiling_table
    table = ceiling_table(cache_dir=tmp_path / "cache" / "numatp")
    fp32 = table["float32"][1]  # one CPU per virtual socket here
    assert fp32["aten"] > 0 and set(fp32) >= {"aten", "onednn", "onednn_packed", "mkl_packed"}
    row = next(line.split() for line in out.stdout.splitlines() if line.strip().startswith("float32"))
    assert f"{fp32['aten']:.1f}" in row and row[-1] == max(fp32, key=lambda k: fp32[k])
    assert f"{CEILING_SHAPE[0]} x {CEILING_SHAPE[1]} x {CEILING_SHAPE[2]}" in out.stdout
    p = MachineProfile.from_json(json.loads(path.read_text()))
    assert p.sockets == 2 and p.remote_bw_gbs is None and p.local_bw_gbs > 0
    assert {r[0] for r in p.gemm_table} == {"float32", "bfloat16"} and all(r[4] > 0 for r in p.gemm_table)
    assert p.barrier_us > 0 and p.allreduce_ns_per_byte > 0
