"""The sweep: one fresh child process per configuration, one after another, each outcome appended as
a JSON line to ``DIR/results.jsonl``.

A configuration already measured (a line with status ``"ok"`` and the same key) is not run again, so
an interrupted sweep resumes where it stopped. One that would not fit in memory, or whose sequence
is longer than the model's positions, gets a ``"skipped"`` line saying why; a child that crashes or
runs past its timeout gets an ``"error"`` line with the tail of its output, and the sweep goes on.
Children never run in parallel: two would share the cores and the memory bandwidth being measured.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numatp
from numatp.bench import bootstrap
from numatp.bench import machine as _machine
from numatp.bench.policy import ProcessPolicy, choose_mechanism, launch_prefix, policy_for
from numatp.bench.spec import Config
from numatp.topology import Topology

__all__ = ["RESULTS", "SCHEMA", "SweepCounts", "finished_keys", "read_results", "run_sweep"]

RESULTS = "results.jsonl"
SCHEMA = 1
_TAIL_CHARS = 4000


@dataclass
class SweepCounts:
    """What a sweep did, by outcome."""

    ok: int = 0
    errors: int = 0
    skipped: int = 0
    resumed: int = 0
    """Configurations found finished in results.jsonl and not run again."""


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Every JSON line of a results file; a torn last line (a sweep killed mid-write) is dropped."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number < len(lines):
                raise ValueError(f"{path}:{number} is not a JSON line ({e}); remove or repair that line") from e
    return records


def finished_keys(path: str | Path) -> set[str]:
    """Keys of the configurations with an ``"ok"`` line in ``path`` (none if it does not exist)."""
    if not Path(path).exists():
        return set()
    return {r["key"] for r in read_results(path) if r.get("status") == "ok"}


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "numatp": numatp.__version__}
    for package in ("torch", "transformers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@functools.lru_cache(maxsize=None)
def _shape(model: str, tiny: bool) -> tuple[dict[str, Any], int | None]:
    """The zoo's shape summary of ``model`` and its number of positions (None: unlimited)."""
    from numatp import zoo

    if model in zoo.PRESETS:
        cfg = zoo.config(model, tiny=tiny)
    else:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(model)
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return zoo.describe(model, tiny=tiny), positions


def _skip_reason(config: Config, available: int | None) -> tuple[str | None, dict[str, Any]]:
    shape, positions = _shape(config.model, config.tiny)
    if positions is not None and config.seq > positions:
        return f"seq {config.seq} exceeds the {positions} positions of {config.model}", {}
    if available is None:
        return None, {}
    need = _machine.estimate_bytes(shape, batch=config.batch, seq=config.seq, dtype=config.dtype, mode=config.mode)
    memory = {"estimate_bytes": need, "available_bytes": available}
    if need > available:
        return (
            f"needs about {need / 2**30:.1f} GiB (weights, activations, compile) but only "
            f"{available / 2**30:.1f} GiB is available; pass --no-memory-guard to run it anyway",
            memory,
        )
    return None, memory


def _child_env() -> dict[str, str]:
    # The child must import this same numatp, installed or not: put its source root first.
    root = str(Path(numatp.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _run_child(command: list[str], log: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run the child in its own session; on timeout kill its whole group (Inductor's compile
    workers included). Returns (exit status or None on timeout, output tail)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=_child_env())
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, log.read_text(errors="replace")[-_TAIL_CHARS:]


def run_sweep(
    configs: Sequence[Config],
    out_dir: str | Path,
    *,
    machine: Topology,
    ranks: Topology,
    mechanism: str = "auto",
    timeout_s: float = 1800.0,
    memory_guard: bool = True,
    mem_available: Callable[[], int] = _machine.mem_available,
    progress: bool = True,
) -> SweepCounts:
    """Measure each config in its own child, append one JSON line each to ``out_dir/results.jsonl``.

    ``machine`` is the detected topology (recorded with every line); ``ranks`` the one numatp runs
    on (``machine.resolve_ranks``). ``mem_available`` is read before each child, since the previous
    one's memory may take a moment to return.
    """
    from tqdm import tqdm

    out = Path(out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    done = finished_keys(results)
    how = choose_mechanism(mechanism)
    common = {
        "host": {"cpu_model": _machine.cpu_model(), "hostname": platform.node(), "cpu_count": os.cpu_count()},
        "topology": machine.to_dict(),
        "ranks": ranks.to_dict(),
        "versions": _versions(),
    }
    counts = SweepCounts(resumed=sum(c.key in done for c in configs))
    # Finished configurations start the bar as `initial`, so they do not make the ETA look fast.
    bar = tqdm(total=len(configs), initial=counts.resumed, unit="run", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    with tempfile.TemporaryDirectory(prefix="numatp-bench-") as scratch:
        for config in configs:
            bar.set_description(f"{Path(config.model).name} b{config.batch} s{config.seq} {config.dtype} {config.mode}"
                                + (f" {config.weights}" if config.weights else ""))
            if config.key in done:
                continue
            policy = policy_for(config.mode, machine, ranks)
            applied = how if policy.memory != "default" else "none"
            record: dict[str, Any] = {
                "schema": SCHEMA,
                "key": config.key,
                **config.to_dict(),
                "started_at": _now(),
                **common,
                "policy": {**policy.to_dict(), "mechanism": applied,
                           "command": launch_prefix(policy, applied) or None},
            }
            reason, record["memory"] = _skip_reason(config, mem_available() if memory_guard else None)
            if reason is not None:
                record.update(status="skipped", reason=reason)
                counts.skipped += 1
            else:
                record.update(_measure(config, policy, applied, ranks, out / "logs", Path(scratch), timeout_s))
                if record["status"] == "ok":
                    counts.ok += 1
                else:
                    counts.errors += 1
            with results.open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.update()
    bar.close()
    return counts


def _measure(config: Config, policy: ProcessPolicy, mechanism: str, ranks: Topology, logs: Path,
             scratch: Path, timeout_s: float) -> dict[str, Any]:
    name = hashlib.sha1(config.key.encode()).hexdigest()[:12]
    job, result = scratch / f"{name}.job.json", scratch / f"{name}.result.json"
    job.write_text(json.dumps({"config": config.to_dict(), "policy": policy.to_dict(), "mechanism": mechanism,
                               "ranks": ranks.to_dict()}))
    result.unlink(missing_ok=True)
    # -P: no script folder on sys.path, so bench's module names cannot shadow top-level ones.
    command = [*launch_prefix(policy, mechanism), sys.executable, "-P", str(Path(bootstrap.__file__)),
               str(job), str(result)]
    started = time.perf_counter()
    code, tail = _run_child(command, logs / f"{name}.log", timeout_s)
    outcome: dict[str, Any] = {"wall_s": time.perf_counter() - started, "returncode": code,
                               "log": f"logs/{name}.log"}
    if code == 0 and result.exists():
        return {**outcome, "status": "ok", **json.loads(result.read_text())}
    last = next((line for line in reversed(tail.splitlines()) if line.strip()), "no output")
    why = (f"timed out after {timeout_s:g} s; pass a larger --timeout" if code is None
           else f"child exited with status {code}: {last.strip()}")
    return {**outcome, "status": "error", "reason": why, "stderr_tail": tail}
