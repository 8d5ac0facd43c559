"""The report's PNG figures, after the paper: mean-time heatmaps over batch x sequence (Fig. 7),
speedup bars per configuration (Fig. 8), and speedup against sequence length (Fig. 9); beside them,
decode tokens/s per mode and, where quantized weights were measured, per weights format.

Importing this module imports matplotlib (the ``plot`` extra); ``numatp.bench.report`` imports it
only when drawing. Figures are built as ``matplotlib.figure.Figure`` objects, not through pyplot,
so no GUI backend and no global figure state are involved.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from numatp.bench.spec import Point

__all__ = ["decode_bars", "decode_weights_bars", "heatmaps", "scaling_plot", "speedup_bars"]

_DPI = 120
_HEATMAP_COLUMNS = 3  # panels per row: six modes make two rows, not one strip


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    return path


def heatmaps(means: Mapping[str, Mapping[Point, float]], out: Path) -> list[Path]:
    """One PNG per (model, dtype): a heatmap per mode, batch sizes as rows and sequence lengths as
    columns, each cell annotated with the mean seconds per call. The colour scale is logarithmic
    and shared by the figure's panels, so modes compare by colour."""
    groups = sorted({(p.model, p.dtype) for by_point in means.values() for p in by_point})
    paths = []
    for model, dtype in groups:
        panels = [(m, {p: t for p, t in by_point.items() if (p.model, p.dtype) == (model, dtype)})
                  for m, by_point in means.items()]
        panels = [(m, cells) for m, cells in panels if cells]
        batches = sorted({p.batch for _, cells in panels for p in cells})
        seqs = sorted({p.seq for _, cells in panels for p in cells})
        values = [t for _, cells in panels for t in cells.values()]
        lo, hi = min(values), max(values) * (1.0001 if min(values) == max(values) else 1)
        norm = LogNorm(vmin=lo, vmax=hi)
        cols = min(len(panels), _HEATMAP_COLUMNS)
        rows = math.ceil(len(panels) / cols)
        # a panel is never narrower than its axis label and 3-4 tick labels: a one-cell quick sweep too
        panel_w, panel_h = max(2.4, 0.9 * len(seqs)), max(1.6, 0.9 + 0.5 * len(batches))
        fig = Figure(figsize=(2.0 + panel_w * cols, 1.0 + panel_h * rows), layout="constrained")
        axes = list(fig.subplots(rows, cols, squeeze=False).flat)
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        for ax, (mode, cells) in zip(axes, panels):
            grid = np.full((len(batches), len(seqs)), np.nan)
            for p, t in cells.items():
                grid[batches.index(p.batch), seqs.index(p.seq)] = t
            image = ax.imshow(np.ma.masked_invalid(grid), norm=norm, cmap="viridis", aspect="auto")
            for (i, j), t in np.ndenumerate(grid):
                if not math.isnan(t):
                    ax.text(j, i, f"{t:.3g}", ha="center", va="center", fontsize=8,
                            color="white" if norm(t) < 0.5 else "black")
            ax.set_title(mode)
            ax.set_xticks(range(len(seqs)), [str(s) for s in seqs])
            ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        # one axis label for all panels: per-panel labels collide between narrow neighbours
        fig.supxlabel("sequence length")
        fig.supylabel("batch size")
        bar = fig.colorbar(image, ax=axes[: len(panels)], label="mean prefill time (s)")
        # plain numbers at a few even steps: a log bar over less than a decade otherwise labels its minor
        # ticks in crowded powers of ten
        ticks = [float(t) for t in np.geomspace(lo, hi, 5)]
        bar.set_ticks(ticks, labels=[f"{t:.3g}" for t in ticks])
        bar.minorticks_off()
        fig.suptitle(f"{model} {dtype}: mean prefill time per call")
        paths.append(_save(fig, out / f"heatmap-{_slug(model)}-{_slug(dtype)}.png"))
    return paths


def speedup_bars(speedups: Mapping[str, Mapping[Point, float]], out: Path) -> list[Path]:
    """One PNG with a panel per (model, dtype): a group of bars per (batch, seq), one bar per mode,
    and a dashed line at parity."""
    return _bar_panels(speedups, "speedup over baseline", "", lambda p: f"b{p.batch}\ns{p.seq}",
                       out / "speedup.png", parity=True)


def decode_bars(rates: Mapping[str, Mapping[Point, Mapping[str, float]]], out: Path) -> list[Path]:
    """One PNG with a panel per (model, dtype): decode tokens/s per (batch, prompt), one bar per mode."""
    values = {m: {p: r["tokens_per_s"] for p, r in by_point.items()} for m, by_point in rates.items()}
    return _bar_panels(values, "decode tokens/s", ": decode", lambda p: f"b{p.batch}\nprompt {p.seq}",
                       out / "decode.png", parity=False)


def decode_weights_bars(rates: Mapping[str, Mapping[Point, Mapping[str, float]]], out: Path) -> list[Path]:
    """One PNG (``decode-weights.png``) with a panel per (model, dtype): decode tokens/s per (batch, prompt),
    one bar per weights format (:func:`numatp.bench.report.decode_by_weights`: plain, int8, int4, and
    torch.compile for reference); nothing where no quantized weights were measured."""
    values = {s: {p: r["tokens_per_s"] for p, r in by_point.items()} for s, by_point in rates.items()}
    return _bar_panels(values, "decode tokens/s", ": decode by weights format (plain: in this dtype)",
                       lambda p: f"b{p.batch}\nprompt {p.seq}",
                       out / "decode-weights.png", parity=False)


def _bar_panels(values: Mapping[str, Mapping[Point, float]], ylabel: str, title: str, tick, path: Path, *,
                parity: bool) -> list[Path]:
    groups = sorted({(p.model, p.dtype) for v in values.values() for p in v})
    if not groups:
        return []
    modes = [m for m, v in values.items() if v]
    widest = max(len({p for v in values.values() for p in v if (p.model, p.dtype) == g}) for g in groups)
    fig = Figure(figsize=(max(10.0, 0.5 * widest), 2.6 * len(groups)), layout="constrained")
    axes = fig.subplots(len(groups), 1, squeeze=False)[:, 0]
    colour = {m: f"C{k}" for k, m in enumerate(modes)}   # a mode keeps its colour in every panel
    for ax, (model, dtype) in zip(axes, groups):
        points = sorted({p for v in values.values() for p in v if (p.model, p.dtype) == (model, dtype)})
        here = [m for m in modes if any(p in values[m] for p in points)]
        width = 0.8 / len(here)
        for k, mode in enumerate(here):
            # a mode not measured at a point leaves a gap (NaN bars upset the axis limits)
            at = [i for i, p in enumerate(points) if p in values[mode]]
            ax.bar(np.array(at, dtype=float) + (k - (len(here) - 1) / 2) * width,
                   [values[mode][points[i]] for i in at], width, color=colour[mode])
        if parity:
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xlim(-0.5, len(points) - 0.5)
        ax.set_xticks(range(len(points)), [tick(p) for p in points], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{model} {dtype}{title}")
    fig.legend(handles=[Patch(color=colour[m], label=m) for m in modes], ncols=min(len(modes), 6), fontsize=8,
               loc="outside upper center")
    return [_save(fig, path)]


def scaling_plot(series: Mapping[str, Mapping[int, float]], out: Path) -> list[Path]:
    """One PNG: geometric-mean speedup against sequence length per mode, parity dashed, the region
    above parity shaded."""
    if not series:
        return []
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for mode, by_seq in series.items():
        ax.plot(list(by_seq), list(by_seq.values()), marker="o", label=mode)
    ax.set_xscale("log", base=2)
    seqs = sorted({s for by_seq in series.values() for s in by_seq})
    ax.set_xticks(seqs, [str(s) for s in seqs])
    top = max(max(v.values()) for v in series.values()) * 1.1
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.axhspan(1.0, max(top, 1.1), color="tab:green", alpha=0.08)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("geo-mean speedup over baseline")
    ax.set_title("Speedup vs sequence length (all models and batches)")
    ax.legend(fontsize=8)
    return [_save(fig, out / "scaling.png")]
