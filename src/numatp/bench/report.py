"""From results lines to the paper's tables: mean times per configuration, speedups over the
baseline, the Table IV policy summary, the Fig. 9 scaling series, and ``summary.md`` beside the
PNG figures (drawn by ``numatp.bench.plots`` when matplotlib is installed); ``console_table`` is the
short form ``numatp bench`` prints when it ends. Tables and figures are numbered as in the paper,
:data:`numatp.cost.paper.CITATION`, which every report cites.

A configuration is a point (model, dtype, batch, seq); when a point was measured more than once in
a mode, its latest ``"ok"`` line counts. A numatp mode measured with quantized weights is a mode of its
own, labelled with the format (``numatp int8``, ``numatp int4:g64 keep-head``), so its speedups are taken
against the same baseline; :func:`decode_by_weights` sets the formats side by side (the decode-vs-weights
figure and table).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numatp.bench.spec import MODES, NUMATP_MODES, WEIGHTS, Point
from numatp.bench.sweep import read_results
from numatp.cost.paper import CITATION

__all__ = ["Point", "PolicyRow", "console_table", "decode_by_weights", "decode_rates", "mean_times", "policy_table",
           "scaling", "speedups", "write_report"]

SUMMARY = "summary.md"
_PLOT_HINT = "pip install 'numatp[plot]'"


@dataclass(frozen=True)
class PolicyRow:
    """One row of Table IV: a mode's speedups over the baseline, over the points both measured."""

    mode: str
    geomean: float
    median: float
    worse: int
    """Points where the mode was slower than the baseline (speedup < 1)."""
    count: int


def _label(record: Mapping[str, Any]) -> str:
    name = Path(record["model"]).name or record["model"]  # a checkpoint folder shows its last part
    return f"{name} (tiny)" if record.get("tiny") else name


def _mode(record: Mapping[str, Any]) -> str:
    """The mode as the report labels it: with its quantized weights, if any (``numatp int8``)."""
    weights = record.get("weights")
    return " ".join([record["mode"], *([weights] if weights else []),
                     *(["keep-head"] if weights and record.get("keep_head") else [])])


def _ok(records: Iterable[Mapping[str, Any]]) -> dict[tuple[str, Point], Mapping[str, Any]]:
    latest: dict[tuple[str, Point], Mapping[str, Any]] = {}
    for r in records:
        if r.get("status") == "ok":
            latest[(_mode(r), Point(_label(r), r["dtype"], r["batch"], r["seq"]))] = r
    return latest


def _mode_order(modes: Iterable[str]) -> list[str]:
    """Modes in ``MODES`` order, a mode's quantized variants after it (int8, then int4 by group)."""
    def key(label: str) -> tuple:
        mode, _, rest = label.partition(" ")
        return (MODES.index(mode) if mode in MODES else len(MODES), mode, rest != "", _weights_order(rest), rest)
    return sorted(set(modes), key=key)


def _weights_order(label: str) -> int:
    fmt = label.split(" ")[0]
    return WEIGHTS.index(fmt) if fmt in WEIGHTS else len(WEIGHTS)


def mean_times(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[Point, float]]:
    """Mean seconds per call, by mode then point."""
    table: dict[str, dict[Point, float]] = {}
    for (mode, point), r in _ok(records).items():
        table.setdefault(mode, {})[point] = r["timing"]["mean_s"]
    return {m: dict(sorted(table[m].items())) for m in _mode_order(table)}


def speedups(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[Point, float]]:
    """Baseline mean over mode mean, by mode then point, for the points both measured."""
    means = mean_times(records)
    base = means.get("baseline", {})
    return {
        mode: {p: base[p] / t for p, t in by_point.items() if p in base}
        for mode, by_point in means.items()
        if mode != "baseline"
    }


def decode_rates(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[Point, Mapping[str, float]]]:
    """Per mode then point, the generation measured by a ``--decode`` sweep: ``tokens_per_s``,
    ``first_token_s`` and ``new_tokens``."""
    table: dict[str, dict[Point, Mapping[str, float]]] = {}
    for (mode, point), r in _ok(records).items():
        if r.get("generation"):
            table.setdefault(mode, {})[point] = r["generation"]
    return {m: dict(sorted(table[m].items())) for m in _mode_order(table)}


def decode_by_weights(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[Point, Mapping[str, Any]]]:
    """Decode speed by how the weights are stored, where a ``--decode`` sweep measured quantized weights
    (else empty: nothing to set side by side). Per series then point (a panel per model and dtype: the
    dtype is the activations', and the plain weights'): ``"plain"`` (numatp, the model's dtype), each
    format (``"int8"``, ``"int4:g64"``; ``keep-head`` where the LM head stayed plain), numatp-auto's as
    ``"... (numatp-auto)"``, and ``"torch.compile"`` (the baseline) for reference; each the generation's
    ``tokens_per_s``, ``first_token_s``, ``new_tokens``, and ``socket_bytes`` (the weight bytes each
    socket held; None for the baseline and for lines from before they were recorded)."""
    ok = _ok(records)
    if not any(r.get("generation") and r.get("weights") for r in ok.values()):
        return {}
    table: dict[str, dict[Point, Mapping[str, Any]]] = {}
    for (label, point), r in ok.items():
        if not r.get("generation") or r["mode"] not in ("baseline", *NUMATP_MODES):
            continue
        if r["mode"] == "baseline":
            series = "torch.compile"
        else:
            series = label.partition(" ")[2] or "plain"
            if r["mode"] != "numatp":
                series += f" ({r['mode']})"
        stored = r.get("weight_storage") or {}
        table.setdefault(series, {})[point] = {**r["generation"], "socket_bytes": stored.get("socket_bytes")}
    def key(series: str) -> tuple:
        auto = series.endswith(")")
        name = series.split(" ")[0]
        return (series != "torch.compile", auto, name != "plain", _weights_order(series), series)
    return {s: dict(sorted(table[s].items())) for s in sorted(table, key=key)}


def policy_table(records: Iterable[Mapping[str, Any]]) -> list[PolicyRow]:
    """Table IV: per mode, geometric mean and median speedup, points slower than the baseline, and
    how many points were compared. Modes without a common point are left out."""
    return [
        PolicyRow(mode, statistics.geometric_mean(list(s.values())), statistics.median(s.values()),
                  sum(v < 1.0 for v in s.values()), len(s))
        for mode, s in speedups(records).items()
        if s
    ]


def scaling(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[int, float]]:
    """Fig. 9: per mode, the geometric mean speedup over all models, dtypes and batches at each
    sequence length."""
    series: dict[str, dict[int, float]] = {}
    for mode, s in speedups(records).items():
        by_seq: dict[int, list[float]] = {}
        for point, value in s.items():
            by_seq.setdefault(point.seq, []).append(value)
        if by_seq:
            series[mode] = {seq: statistics.geometric_mean(v) for seq, v in sorted(by_seq.items())}
    return series


def _nodes(records: Iterable[Mapping[str, Any]]) -> int:
    return max((len(r["topology"]["nodes"]) for r in records if "topology" in r), default=0)


def _machine_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    first = next((r for r in records if r.get("status") == "ok"), records[0] if records else None)
    if first is None:
        return ["No results yet."]
    ranks = first.get("ranks", {})
    sockets = len(ranks.get("sockets", []))
    kind = "virtual sockets on one node" if ranks.get("is_virtual") else "sockets"
    versions = ", ".join(f"{k} {v}" for k, v in first.get("versions", {}).items())
    mechanisms = sorted({r["policy"]["mechanism"] for r in records
                         if r.get("policy", {}).get("mechanism") not in (None, "none")})
    counts = {s: sum(r.get("status") == s for r in records) for s in ("ok", "skipped", "error")}
    return [
        f"- CPU: {first.get('host', {}).get('cpu_model', 'unknown')}; {_nodes(records)} NUMA node(s); "
        f"numatp ran on {sockets} {kind}",
        f"- Versions: {versions}",
        f"- Process policies applied by: {', '.join(mechanisms) or 'no policy mode measured'}",
        f"- Lines: {counts['ok']} ok, {counts['skipped']} skipped, {counts['error']} errors",
    ]


def _markdown(records: Sequence[Mapping[str, Any]], images: list[Path], plot_note: str | None) -> str:
    lines = ["# numatp bench summary", "", *_machine_lines(records), "",
             f"Tables and figures are numbered as in the paper: {CITATION} (https://arxiv.org/abs/2611.07105).", ""]
    rows = policy_table(records)
    lines += ["## Speedup over baseline by mode (the paper's Table IV)", ""]
    if rows:
        lines += ["| Mode | Geo. mean | Median | Worse than baseline | Configurations |", "|---|---|---|---|---|"]
        lines += [f"| {r.mode} | {r.geomean:.2f}x | {r.median:.2f}x | {r.worse}/{r.count} | {r.count} |" for r in rows]
    else:
        lines.append("No configuration has both a baseline and another mode measured.")
    ok = _ok(records)
    cvs: dict[str, list[float]] = {}
    for (mode, _), r in ok.items():
        cvs.setdefault(mode, []).append(r["timing"]["cv"])
    lines += ["", "## Coefficient of variation of the timed calls", "", "| Mode | Mean | Max |", "|---|---|---|"]
    lines += [f"| {m} | {100 * statistics.fmean(cvs[m]):.2f}% | {100 * max(cvs[m]):.2f}% |" for m in _mode_order(cvs)]
    means = mean_times(records)
    modes = list(means)
    points = sorted({p for by_point in means.values() for p in by_point})
    lines += ["", "## Mean prefill time per call (ms)", "",
              "| Model | dtype | Batch | Seq | " + " | ".join(modes) + " |", "|---|---|---|---|" + "---|" * len(modes)]
    for p in points:
        cells = [f"{1e3 * means[m][p]:.2f}" if p in means[m] else "-" for m in modes]
        lines.append(f"| {p.model} | {p.dtype} | {p.batch} | {p.seq} | " + " | ".join(cells) + " |")
    decode = decode_rates(records)
    if decode:
        dmodes = list(decode)
        dpoints = sorted({p for by_point in decode.values() for p in by_point})
        base = decode.get("baseline", {})
        lines += ["", "## Generation: decode tokens/s (time to first token, ms)", "",
                  "Greedy tokens after the prompt with a static cache; tokens/s per sequence, medians of three "
                  "generations. x: decode speed over the baseline's.", "",
                  "| Model | dtype | Batch | Prompt | New | " + " | ".join(dmodes) + " |",
                  "|---|---|---|---|---|" + "---|" * len(dmodes)]
        for p in dpoints:
            new = next(decode[m][p]["new_tokens"] for m in dmodes if p in decode[m])
            cells = []
            for m in dmodes:
                d = decode[m].get(p)
                if d is None:
                    cells.append("-")
                    continue
                ratio = f", {d['tokens_per_s'] / base[p]['tokens_per_s']:.2f}x" if m != "baseline" and p in base else ""
                cells.append(f"{d['tokens_per_s']:.1f} ({1e3 * d['first_token_s']:.0f}{ratio})")
            lines.append(f"| {p.model} | {p.dtype} | {p.batch} | {p.seq} | {new} | " + " | ".join(cells) + " |")
    lines += _weights_lines(records)
    lines += ["", "## Figures (after the paper's Fig. 7-9)", ""]
    lines += [f"![{image.stem}]({image.name})" for image in images] or [plot_note or "No figures."]
    problems = [r for r in records if r.get("status") in ("skipped", "error")]
    if problems:
        lines += ["", "## Skipped and failed", ""]
        lines += [f"- {r['status']}: {_label(r)} {r['dtype']} b{r['batch']} s{r['seq']} {_mode(r)}: "
                  f"{r.get('reason', '')}"
                  for r in problems]
    return "\n".join(lines) + "\n"


def _weights_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The decode-vs-weights table of summary.md (none without quantized decode lines)."""
    table = decode_by_weights(records)
    if not table:
        return []
    series = list(table)
    points = sorted({p for by_point in table.values() for p in by_point})
    lines = ["", "## Decode tokens/s by weights format", "",
             "numatp's decode speed with its weights in the model's dtype (plain) and quantized, each socket "
             "quantizing its own shard (the LM head and embeddings int8 unless keep-head), with torch.compile's "
             "for reference; in brackets the weight bytes the largest socket holds. Figure: decode-weights.png.", "",
             "| Model | dtype | Batch | Prompt | " + " | ".join(series) + " |",
             "|---|---|---|---|" + "---|" * len(series)]
    for p in points:
        cells = []
        for name in series:
            d = table[name].get(p)
            if d is None:
                cells.append("-")
                continue
            held = d.get("socket_bytes")
            cells.append(f"{d['tokens_per_s']:.1f}" + (f" ({max(held) / 2**20:.1f} MiB)" if held else ""))
        lines.append(f"| {p.model} | {p.dtype} | {p.batch} | {p.seq} | " + " | ".join(cells) + " |")
    return lines


def console_table(records: Iterable[Mapping[str, Any]]) -> str:
    """What ``numatp bench`` prints when it ends: the mean time per call of each configuration and mode,
    each mode's speedup over the baseline beside it, then the paper's Table IV summary."""
    records = list(records)
    means = mean_times(records)
    if not means:
        return "No configuration was measured: no results to show."
    modes = list(means)
    points = sorted({p for by_point in means.values() for p in by_point})
    base = means.get("baseline", {})

    def cell(mode: str, p: Point) -> str:
        t = means[mode].get(p)
        if t is None:
            return "-"
        ratio = f" ({base[p] / t:.2f}x)" if mode != "baseline" and p in base else ""
        return f"{1e3 * t:.2f}{ratio}"

    header = ["model", "dtype", "batch", "seq", *modes]
    body = [[p.model, p.dtype, str(p.batch), str(p.seq), *(cell(m, p) for m in modes)] for p in points]
    lines = ["Mean prefill time per call, ms (x: speedup over the baseline)", *_columns(header, body, left=2)]
    rows = policy_table(records)
    if rows:
        lines += ["", f"Speedup over the baseline by mode (as the paper's Table IV; {CITATION})",
                  *_columns(["mode", "geo. mean", "median", "worse than baseline"],
                            [[r.mode, f"{r.geomean:.2f}x", f"{r.median:.2f}x", f"{r.worse}/{r.count}"] for r in rows],
                            left=1)]
    return "\n".join(lines)


def _columns(header: list[str], rows: list[list[str]], *, left: int) -> list[str]:
    """Text columns: the first ``left`` left-aligned (names), the rest right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in [header, *rows]]


def write_report(results: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the figures and ``summary.md`` for ``results`` (a results.jsonl or its folder) into
    ``out_dir`` (default: the results folder). Returns the files written, summary.md last.

    Without matplotlib only summary.md is written, and it says how to get the figures.
    """
    results = Path(results)
    folder = results if results.is_dir() else results.parent
    out = Path(out_dir) if out_dir is not None else folder
    out.mkdir(parents=True, exist_ok=True)
    records = read_results(results)
    images: list[Path] = []
    plot_note = None
    try:
        from numatp.bench import plots
    except ImportError as e:
        if not (e.name or "").startswith("matplotlib"):
            raise
        plot_note = (f"Figures were not drawn: matplotlib is not installed. Run `{_PLOT_HINT}`, then "
                     f"`numatp report {folder}`.")
    else:
        images += plots.heatmaps(mean_times(records), out)
        images += plots.speedup_bars(speedups(records), out)
        images += plots.decode_bars(decode_rates(records), out)
        images += plots.decode_weights_bars(decode_by_weights(records), out)
        if _nodes(records) > 2:
            images += plots.scaling_plot(scaling(records), out)
    summary = out / SUMMARY
    summary.write_text(_markdown(records, images, plot_note))
    return [*images, summary]
