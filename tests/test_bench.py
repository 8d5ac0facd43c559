"""numatp bench and numatp report: one real tiny sweep (schema, resume, process policies as the
child saw them), the sweep's failure paths, and the report from a fixture with known numbers.

The sweep runs each configuration in a child process (~10-20 s each, compile included), so the
whole module runs one shared sweep with warmup 1 and iters 2; timings are never asserted. The tests of
that sweep and the decode sweep's real child are slow (``-m slow``); the rest run by default.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

import pytest

import numatp
from numatp.bench import RESULTS, Config, expand, policy_table, read_results, run_sweep, write_report
from numatp.bench.machine import cpu_model, estimate_bytes, resolve_ranks
from numatp.bench.policy import choose_mechanism, launch_prefix, policy_for
from numatp.cli import main
from numatp.topology import Topology, parse_cpulist

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent / "fixtures" / "bench" / "results.jsonl"
POLICY_MODES = ("interleave", "localalloc", "single-socket")
# numatp-auto runs the same child code as numatp with another policy string; leaving it out saves
# a compile of ~40 s on a 2-core machine.
MODES = ("baseline", *POLICY_MODES, "numatp")
SWEEP_ARGS = ["--tiny", "--model", "gpt2", "--batch", "1", "--seq", "16", "--warmup", "1", "--iters", "2",
              "--mechanism", "syscall", "--no-progress"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    main(["bench", *SWEEP_ARGS, "--modes", *MODES, "--out", str(out)])
    return out


@pytest.fixture(scope="module")
def records(sweep: Path) -> dict[str, dict]:
    return {r["mode"]: r for r in read_results(sweep / RESULTS)}


@pytest.fixture(scope="module")
def machine() -> Topology:
    return Topology.detect()


def _status_field(name: str) -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"/proc/self/status has no {name}")


def _steady(topology: dict) -> dict:
    """A topology dict without the nodes' memory sizes, which drift a little on a VM."""
    return {**topology, "nodes": [{k: v for k, v in n.items() if k != "memory_bytes"} for n in topology["nodes"]]}


@pytest.mark.slow
def test_one_line_per_configuration(records: dict[str, dict]) -> None:
    assert sorted(records) == sorted(MODES)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_ok_line_schema(records: dict[str, dict], sweep: Path, machine: Topology, mode: str) -> None:
    r = records[mode]
    config = Config(model="gpt2", batch=1, seq=16, dtype="float32", mode=mode,
                    sockets=resolve_ranks(None, machine).num_sockets, warmup=1, iters=2, tiny=True)
    assert r["status"] == "ok", r.get("reason")
    assert r["schema"] == 1
    assert r["key"] == config.key
    assert Config.from_dict(r) == config
    datetime.datetime.fromisoformat(r["started_at"])
    assert r["host"] == {"cpu_model": cpu_model(), "hostname": os.uname().nodename, "cpu_count": os.cpu_count()}
    assert _steady(r["topology"]) == _steady(machine.to_dict())
    assert _steady(r["ranks"]) == _steady(resolve_ranks(None, machine).to_dict())
    import torch
    import transformers

    assert r["versions"] == {"python": sys.version.split()[0], "torch": torch.__version__,
                             "transformers": transformers.__version__, "numatp": numatp.__version__}
    assert set(r["policy"]) == {"mode", "memory", "nodes", "cpus", "numactl_args", "mechanism", "command"}
    assert r["policy"]["mechanism"] == ("syscall" if mode in POLICY_MODES else "none")
    assert r["policy"]["command"] is None  # syscall mechanism: no numactl in front of the child
    assert 0 < r["memory"]["estimate_bytes"] < r["memory"]["available_bytes"]
    assert r["wall_s"] > 0 and r["returncode"] == 0
    assert (sweep / r["log"]).is_file()
    child = r["child"]
    assert set(child) == {"cpus_allowed_list", "mems_allowed_list", "mempolicy", "policy_before_torch", "pid"}
    assert child["policy_before_torch"] is True
    t = r["timing"]
    assert set(t) == {"build_s", "compile_s", "mean_s", "median_s", "stdev_s", "cv", "min_s", "max_s", "times_s"}
    assert len(t["times_s"]) == 2 and all(x > 0 for x in t["times_s"])
    assert t["mean_s"] == pytest.approx(statistics.fmean(t["times_s"]))
    assert t["median_s"] == pytest.approx(statistics.median(t["times_s"]))
    assert t["stdev_s"] == pytest.approx(statistics.stdev(t["times_s"]))
    assert t["cv"] == pytest.approx(t["stdev_s"] / t["mean_s"])
    assert t["min_s"] == min(t["times_s"]) and t["max_s"] == max(t["times_s"])
    assert t["compile_s"] > 0 and t["build_s"] > 0
    cpus = parse_cpulist(child["cpus_allowed_list"])
    threads = len(cpus) if "OMP_NUM_THREADS" not in os.environ else min(len(cpus), int(os.environ["OMP_NUM_THREADS"]))
    assert r["torch_threads"] == threads
    assert sum(r["weight_pages"].values()) > 0
    assert r["peak_rss_bytes"] > 0
    if mode.startswith("numatp"):
        placement = r["placement"]
        assert [rank["socket"] for rank in placement["ranks"]] == list(range(config.sockets))
        assert 0.0 <= placement["local_fraction"] <= 1.0
    else:
        assert r["placement"] is None


@pytest.mark.slow
def test_policies_as_the_child_saw_them(records: dict[str, dict], machine: Topology) -> None:
    ranks = resolve_ranks(None, machine)
    all_cpus = machine.allowed_cpus
    first = ranks.sockets[0]
    mems = _status_field("Mems_allowed_list")  # policies leave the cpuset alone
    expected = {
        "baseline": (all_cpus, "default", []),
        "interleave": (all_cpus, "interleave", list(machine.nodes_with_memory)),
        "localalloc": (all_cpus, "local", []),
        "single-socket": (frozenset(first.cpus), "bind", [first.node]),
    }
    for mode, (cpus, memory, nodes) in expected.items():
        child = records[mode]["child"]
        assert parse_cpulist(child["cpus_allowed_list"]) == cpus, mode
        assert child["mems_allowed_list"] == mems, mode
        assert child["mempolicy"] == {"mode": memory, "nodes": nodes}, mode
    if machine.num_sockets == 1:  # here: virtual sockets, so single-socket keeps fewer CPUs
        assert len(first.cpus) < len(all_cpus)


@pytest.mark.slow
def test_rerun_skips_finished_configurations(sweep: Path, machine: Topology) -> None:
    before = read_results(sweep / RESULTS)
    done = [m for m in MODES if any(r["mode"] == m and r["status"] == "ok" for r in before)]
    configs = expand(models=["gpt2"], batches=[1], seqs=[16], dtypes=["float32"], modes=done,
                     sockets=resolve_ranks(None, machine).num_sockets, warmup=1, iters=2, tiny=True)
    counts = run_sweep(configs, sweep, machine=machine, ranks=resolve_ranks(None, machine),
                       mechanism="syscall", progress=False)
    assert (counts.resumed, counts.ok, counts.errors, counts.skipped) == (len(done), 0, 0, 0)
    assert read_results(sweep / RESULTS) == before


@pytest.mark.slow
def test_bench_writes_report(sweep: Path) -> None:
    summary = (sweep / "summary.md").read_text()
    assert "| single-socket |" in summary and (sweep / "speedup.png").is_file()


def test_timeout_and_too_long_sequence_are_recorded_and_the_sweep_goes_on(tmp_path: Path, machine: Topology) -> None:
    ranks = resolve_ranks(None, machine)
    slow = Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="baseline", sockets=ranks.num_sockets, tiny=True)
    long = Config(model="gpt2", batch=1, seq=4096, dtype="float32", mode="baseline", sockets=ranks.num_sockets, tiny=True)
    counts = run_sweep([slow, long], tmp_path, machine=machine, ranks=ranks, timeout_s=0.5, progress=False)
    assert (counts.errors, counts.skipped) == (1, 1)
    error, skipped = read_results(tmp_path)
    assert error["status"] == "error" and error["returncode"] is None
    assert "timed out after 0.5 s" in error["reason"] and "--timeout" in error["reason"]
    assert isinstance(error["stderr_tail"], str)
    assert skipped["status"] == "skipped" and "seq 4096 exceeds the 128 positions" in skipped["reason"]


def test_crashed_child_is_recorded_with_its_output(tmp_path: Path, machine: Topology) -> None:
    # A socket on a CPU that does not exist: the child's sched_setaffinity fails before torch loads.
    ranks = Topology.virtual(sockets=1, cpus=[4095])
    config = Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="single-socket", sockets=1, tiny=True)
    counts = run_sweep([config], tmp_path, machine=machine, ranks=ranks, mechanism="syscall", progress=False)
    assert counts.errors == 1
    (line,) = read_results(tmp_path)
    assert line["status"] == "error" and line["returncode"] == 1
    assert line["reason"].startswith("child exited with status 1: OSError")
    assert "sched_setaffinity" in line["stderr_tail"] and (tmp_path / line["log"]).is_file()


def test_memory_guard_skips_and_says_why(tmp_path: Path, machine: Topology) -> None:
    ranks = resolve_ranks(None, machine)
    config = Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="numatp", sockets=ranks.num_sockets, tiny=True)
    counts = run_sweep([config], tmp_path, machine=machine, ranks=ranks, mem_available=lambda: 1 << 20, progress=False)
    assert counts.skipped == 1
    (line,) = read_results(tmp_path)
    assert line["status"] == "skipped" and "--no-memory-guard" in line["reason"]
    assert line["memory"] == {"estimate_bytes": line["memory"]["estimate_bytes"], "available_bytes": 1 << 20}
    assert line["memory"]["estimate_bytes"] > 1 << 20


def test_memory_estimate_grows_with_the_work() -> None:
    shape = {"parameters": 124_000_000, "vocab": 50257, "hidden": 768, "intermediate": 3072, "heads": 12}
    small = estimate_bytes(shape, batch=1, seq=128, dtype="float32", mode="baseline")
    assert estimate_bytes(shape, batch=8, seq=128, dtype="float32", mode="baseline") > small
    assert estimate_bytes(shape, batch=1, seq=1024, dtype="float32", mode="baseline") > small
    assert estimate_bytes(shape, batch=1, seq=128, dtype="float32", mode="numatp") > small
    assert estimate_bytes(shape, batch=1, seq=128, dtype="bfloat16", mode="baseline") < small


def test_numactl_equivalents(machine: Topology) -> None:
    two = Topology.virtual(sockets=2, cpus=[0, 1])
    assert policy_for("interleave", two, two).numactl_args == ("--interleave=all",)
    assert policy_for("localalloc", two, two).numactl_args == ("--localalloc",)
    single = policy_for("single-socket", two, two)
    assert single.numactl_args == ("--physcpubind=0", "--membind=0") and single.cpus == (0,)
    assert launch_prefix(single, "numactl")[1:] == ["--physcpubind=0", "--membind=0"]
    assert launch_prefix(single, "syscall") == []
    assert policy_for("baseline", two, two).memory == "default"
    assert choose_mechanism("auto") == ("numactl" if shutil.which("numactl") else "syscall")


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], pattern: str) -> None:
    """``numatp ARGV`` fails with exit code 2 and one line on stderr that matches ``pattern``."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(pattern, err), err


def test_bad_values_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"mode 'fast' is not one of baseline"):
        Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="fast", sockets=2)
    with pytest.raises(ValueError, match=r"batch=0 must be at least 1"):
        Config(model="gpt2", batch=0, seq=16, dtype="float32", mode="baseline", sockets=2)
    _refused(capsys, ["bench", "--model", "no-such-model", "--out", "/nonexistent"],
             r"numatp bench: --model unknown model 'no-such-model'")


# -- report, from the fixture -------------------------------------------------------------------


def _table_from_fixture() -> dict[str, tuple[float, float, int, int]]:
    """Table IV recomputed from the raw lines, without numatp's report code."""
    latest: dict[tuple, float] = {}
    for line in FIXTURE.read_text().splitlines():
        r = json.loads(line)
        if r["status"] == "ok":  # a later line of the same point replaces an earlier one
            latest[(r["mode"], r["model"], r["dtype"], r["batch"], r["seq"])] = r["timing"]["mean_s"]
    table = {}
    for mode in ("numatp", "numatp-auto", "interleave", "localalloc", "single-socket"):
        ratios = sorted(latest[("baseline", *p)] / t for (m, *p), t in latest.items() if m == mode)
        n = len(ratios)
        median = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
        table[mode] = (math.prod(ratios) ** (1 / n), median, sum(x < 1 for x in ratios), n)
    return table


def test_policy_table_matches_an_independent_computation() -> None:
    expected = _table_from_fixture()
    rows = {r.mode: (r.geomean, r.median, r.worse, r.count) for r in policy_table(read_results(FIXTURE))}
    assert rows.keys() == expected.keys()
    for mode, (geomean, median, worse, count) in expected.items():
        assert rows[mode] == (pytest.approx(geomean), pytest.approx(median), worse, count), mode
    assert expected["numatp"][3] == 16  # the superseded line did not add a point


def test_report_from_fixture(tmp_path: Path) -> None:
    from matplotlib import image   # the test extra installs matplotlib: its absence is a failure here

    assert main(["report", str(FIXTURE.parent), "--out", str(tmp_path)]) == 0
    names = {"heatmap-gpt2-float32.png", "heatmap-bert-small-float32.png", "speedup.png", "scaling.png"}
    assert {p.name for p in tmp_path.iterdir()} == names | {"summary.md"}
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = image.imread(tmp_path / name)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    summary = (tmp_path / "summary.md").read_text()
    for mode, (geomean, median, worse, count) in _table_from_fixture().items():
        assert f"| {mode} | {geomean:.2f}x | {median:.2f}x | {worse}/{count} | {count} |" in summary
    for name in names:
        assert f"]({name})" in summary
    assert "skipped: gpt2 float32 b8 s1024 baseline" in summary and "error: bert-small" in summary


def test_no_scaling_plot_on_two_nodes(tmp_path: Path) -> None:
    lines = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    for r in lines:
        r["topology"]["nodes"] = r["topology"]["nodes"][:2]
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    written = {p.name for p in write_report(tmp_path)}
    assert "scaling.png" not in written and "speedup.png" in written


def test_report_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes an import raise ImportError, for submodules already loaded too.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "numatp.bench.plots", raising=False)
    monkeypatch.delattr(numatp.bench, "plots", raising=False)  # else `from numatp.bench import plots` finds it
    written = write_report(FIXTURE, tmp_path)
    assert [p.name for p in written] == ["summary.md"]
    summary = written[0].read_text()
    assert "pip install 'numatp[plot]'" in summary and re.search(r"\| numatp \| \d+\.\d\dx", summary)


def test_report_names_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(capsys, ["report", str(tmp_path / "nothing")], r"does not exist; run `numatp bench --out")


@pytest.mark.slow
def test_decode_sweep_records_first_token_and_tokens_per_second(tmp_path: Path, machine: Topology) -> None:
    # one real numatp child with --decode: the prefill timing, then three timed generations after one untimed
    assert main(["bench", "--tiny", "--model", "gpt2", "--batch", "1", "--seq", "8", "--warmup", "0", "--iters", "1",
                 "--modes", "numatp", "--decode", "3", "--no-progress", "--no-report", "--out", str(tmp_path)]) == 0
    (r,) = read_results(tmp_path / RESULTS)
    assert r["status"] == "ok", r.get("reason")
    assert Config.from_dict(r).decode == 3 and "decode=3" in r["key"]
    d = r["generation"]
    assert d["new_tokens"] == 3 and len(d["runs"]) == 3
    assert d["first_token_s"] == pytest.approx(statistics.median(x["first_token_s"] for x in d["runs"]))
    assert d["tokens_per_s"] == pytest.approx(statistics.median(2 / x["decode_s"] for x in d["runs"]))


@pytest.mark.slow
def test_decode_sweep_with_quantized_weights_records_the_format_and_bytes(tmp_path: Path) -> None:
    assert main(["bench", "--tiny", "--model", "gpt2", "--batch", "1", "--seq", "8", "--warmup", "0", "--iters", "1",
                 "--modes", "numatp", "--decode", "2", "--weights", "int8", "--no-progress", "--no-report",
                 "--out", str(tmp_path)]) == 0
    (r,) = read_results(tmp_path / RESULTS)
    assert r["status"] == "ok", r.get("reason")
    assert Config.from_dict(r).weights == "int8" and "weights=int8" in r["key"]
    stored = r["weight_storage"]
    assert (stored["format"], stored["head"]) == ("int8", "int8")
    assert stored["socket_bytes"] == [x["bytes"] for x in r["placement"]["ranks"]]
    assert len(stored["socket_bytes"]) == 2 and 0 < stored["socket_bytes"][0] < stored["model_bytes"] / 4
    assert r["generation"]["tokens_per_s"] > 0


def test_decode_sweep_refuses_encoders_and_negative_counts(capsys: pytest.CaptureFixture[str]) -> None:
    _refused(capsys, ["bench", "--tiny", "--model", "gpt2", "bert-small", "--decode", "4", "--no-progress"],
             "bert-small.*encoder")
    _refused(capsys, ["bench", "--tiny", "--model", "gpt2", "--decode", "-1", "--no-progress"], "--decode -1")
    with pytest.raises(ValueError, match="decode=-2"):
        Config(model="gpt2", batch=1, seq=8, dtype="float32", mode="numatp", sockets=2, decode=-2)


def test_report_shows_decode_rates_against_the_baseline(tmp_path: Path) -> None:
    lines = []
    for mode, rate, first in (("baseline", 20.0, 0.5), ("numatp", 25.0, 0.4)):
        r = json.loads(FIXTURE.read_text().splitlines()[0])
        r.update(mode=mode, model="gpt2", dtype="float32", batch=1, seq=128, status="ok",
                 decode=64, generation={"new_tokens": 64, "first_token_s": first, "tokens_per_s": rate, "runs": []})
        lines.append(json.dumps(r))
    (tmp_path / RESULTS).write_text("\n".join(lines) + "\n")
    written = write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "## Generation: decode tokens/s" in summary
    assert "| gpt2 | float32 | 1 | 128 | 64 | 20.0 (500) | 25.0 (400, 1.25x) |" in summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert tmp_path / "decode.png" in written


def test_bench_prints_its_results_table_when_it_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # the sweep itself is replaced by the fixture's lines: what is tested is what the command prints after it
    import numatp.bench
    from numatp.bench.sweep import SweepCounts

    shutil.copy(FIXTURE, tmp_path / RESULTS)
    monkeypatch.setattr(numatp.bench, "run_sweep", lambda configs, out, **kw: SweepCounts(ok=len(configs)))
    assert main(["bench", "--quick", "--no-report", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Mean prefill time per call, ms (x: speedup over the baseline)" in out
    gpt2 = next(line.split() for line in out.splitlines() if line.startswith("gpt2") and " 1  1024 " in line)
    assert gpt2[:4] == ["gpt2", "float32", "1", "1024"] and gpt2[5:7] == ["2.21", "(1.85x)"]
    assert re.search(r"^numatp\s+1\.44x\s+1\.47x\s+1/16$", out, re.MULTILINE)
    assert "Table IV" in out and "arXiv:2611.07105" in out


def test_summary_cites_the_paper_where_it_names_its_tables(tmp_path: Path) -> None:
    from numatp.cost.paper import CITATION

    summary = write_report(FIXTURE, tmp_path)[-1].read_text()
    assert "NUMA-Torch: Compiler-Driven NUMA-Aware LLM Prefill on Multi-Socket CPUs" in CITATION
    assert CITATION in summary and "https://arxiv.org/abs/2611.07105" in summary
    assert summary.index(CITATION) < summary.index("Table IV") and "Fig. 7-9" in summary


# -- quantized weights: one configuration per format, recorded and reported ------------------------------


def test_weights_are_part_of_a_configurations_identity() -> None:
    plain = Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="numatp", sockets=2)
    int8 = Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="numatp", sockets=2, weights="int8")
    int4 = Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="numatp", sockets=2, weights="int4")
    kept = Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="numatp", sockets=2, weights="int8",
                  keep_head=True)
    assert "weights" not in plain.key and "keep_head" not in plain.key   # a plain line keeps its old key
    assert "weights=int8" in int8.key and "weights=int4:g64" in int4.key and "keep_head=True" in kept.key
    assert len({plain.key, int8.key, int4.key, kept.key}) == 4
    assert int4.weights == "int4:g64" and int4.key == Config.from_dict(int4.to_dict()).key
    with pytest.raises(ValueError, match=r"weights='int8' with mode 'baseline': numatp quantizes the weights of its "
                                         r"own modes"):
        Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="baseline", sockets=2, weights="int8")
    with pytest.raises(ValueError, match=r"weights 'int3' is not one of int8, int8:a8, int4, int4:g32"):
        Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="numatp", sockets=2, weights="int3")
    with pytest.raises(ValueError, match="keep_head=True without weights"):
        Config(model="gpt2", batch=1, seq=16, dtype="float32", mode="numatp", sockets=2, keep_head=True)
    # the numatp modes once per format, the others once, on the model as it is
    configs = expand(models=["gpt2"], batches=[1], seqs=[16], dtypes=["float32"], modes=["baseline", "numatp"],
                     sockets=2, weights=[None, "int8", "int4", "int4:g64"], keep_head=True)
    assert [(c.mode, c.weights, c.keep_head) for c in configs] == [
        ("baseline", None, False), ("numatp", None, False), ("numatp", "int8", True), ("numatp", "int4:g64", True)]


def test_a_sweep_skips_only_the_formats_already_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          machine: Topology) -> None:
    import numatp.bench.sweep as sweep_module

    ran: list[str] = []

    def measured(config: Config, *args: object) -> dict:
        ran.append(config.key)
        return {"status": "ok"}

    monkeypatch.setattr(sweep_module, "_measure", measured)
    configs = expand(models=["gpt2"], batches=[1], seqs=[16], dtypes=["float32"], modes=["baseline", "numatp"],
                     sockets=2, tiny=True, decode=4)
    kw = dict(machine=machine, ranks=resolve_ranks(2, machine), mechanism="syscall", memory_guard=False,
              progress=False)
    assert run_sweep(configs, tmp_path, **kw).ok == 2
    quantized = expand(models=["gpt2"], batches=[1], seqs=[16], dtypes=["float32"], modes=["baseline", "numatp"],
                       sockets=2, tiny=True, decode=4, weights=[None, "int8", "int4"])
    ran.clear()
    counts = run_sweep(quantized, tmp_path, **kw)
    assert (counts.ok, counts.resumed) == (2, 2)   # the plain ones are done; each format is new
    assert [Config.from_dict(r).weights for r in read_results(tmp_path / RESULTS)] == [None, None, "int8", "int4:g64"]
    assert ran == [c.key for c in quantized if c.weights is not None]
    assert run_sweep(quantized, tmp_path, **kw).resumed == 4 and ran == [c.key for c in quantized if c.weights]


def test_bench_passes_weights_to_the_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numatp.bench
    from numatp.bench.sweep import SweepCounts

    seen: list[Config] = []

    def sweep(configs: list[Config], out: Path, **kw: object) -> SweepCounts:
        seen.extend(configs)
        return SweepCounts(ok=len(configs))

    monkeypatch.setattr(numatp.bench, "run_sweep", sweep)
    assert main(["bench", *SWEEP_ARGS, "--modes", "baseline", "numatp", "--decode", "2", "--weights", "none", "int8",
                 "int4:g32", "--keep-head", "--no-report", "--out", str(tmp_path)]) == 0
    assert [(c.mode, c.weights, c.keep_head, c.decode) for c in seen] == [
        ("baseline", None, False, 2), ("numatp", None, False, 2), ("numatp", "int8", True, 2),
        ("numatp", "int4:g32", True, 2)]


def _decode_lines(formats: list[tuple[str, str | None, float, list[int] | None]]) -> list[dict]:
    """Results lines of one point (tiny numbers), a generation each: (mode, weights, tokens/s, socket bytes)."""
    lines = []
    for mode, weights, rate, held in formats:
        r = json.loads(FIXTURE.read_text().splitlines()[0])
        r.update(mode=mode, model="gpt2", dtype="bfloat16", batch=1, seq=128, status="ok", decode=64, weights=weights,
                 keep_head=False, generation={"new_tokens": 64, "first_token_s": 0.1, "tokens_per_s": rate, "runs": []},
                 weight_storage={"format": weights or "bfloat16", "socket_bytes": held})
        r["timing"] = dict(r["timing"], mean_s=1.0 / rate)
        lines.append(r)
    return lines


def test_report_sets_decode_beside_the_weights_format(tmp_path: Path) -> None:
    from numatp.bench.report import decode_by_weights

    mib = 1 << 20
    lines = _decode_lines([("baseline", None, 20.0, None), ("numatp", None, 25.0, [400 * mib, 400 * mib]),
                           ("numatp", "int8", 45.0, [205 * mib, 205 * mib]),
                           ("numatp", "int4:g64", 70.0, [110 * mib, 110 * mib])])
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    table = decode_by_weights(read_results(tmp_path))
    assert list(table) == ["torch.compile", "plain", "int8", "int4:g64"]
    assert [d["tokens_per_s"] for by_point in table.values() for d in by_point.values()] == [20.0, 25.0, 45.0, 70.0]
    written = write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "## Decode tokens/s by weights format" in summary
    assert "| Model | dtype | Batch | Prompt | torch.compile | plain | int8 | int4:g64 |" in summary
    assert "| gpt2 | bfloat16 | 1 | 128 | 20.0 | 25.0 (400.0 MiB) | 45.0 (205.0 MiB) | 70.0 (110.0 MiB) |" in summary
    # each format is a mode of its own in the other tables, against the same baseline
    assert ("| gpt2 | bfloat16 | 1 | 128 | 64 | 20.0 (100) | 25.0 (100, 1.25x) | 45.0 (100, 2.25x) "
            "| 70.0 (100, 3.50x) |") in summary
    assert re.search(r"\| numatp int4:g64 \| 3\.50x \| 3\.50x \| 0/1 \| 1 \|", summary)
    if importlib.util.find_spec("matplotlib") is not None:
        from matplotlib import image

        assert tmp_path / "decode-weights.png" in written and "](decode-weights.png)" in summary
        pixels = image.imread(tmp_path / "decode-weights.png")
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    # without a quantized line: no such table, no such figure, and no error
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    written = write_report(plain)
    assert decode_by_weights(read_results(plain)) == {}
    assert plain / "decode-weights.png" not in written and "by weights format" not in (plain / "summary.md").read_text()
