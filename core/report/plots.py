"""Report plots: evaluation and training curves of every arm, with a band over seeds.

Pure matplotlib with the Agg canvas (no pyplot, no global backend switch, no display). Every
curve is the mean over seeds at each step; the shaded band is the min–max over seeds. Output is
deterministic for the same inputs (fixed colours by arm order, no timestamps in the PNGs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

BAND = "min–max over seeds"
_COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


@dataclass
class Curve:
    """One arm's curve: for each x, the mean and the min and max over seeds."""

    arm: str
    x: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    seeds: int


def smoothing_window(n_points: int, target_points: int = 25) -> int:
    """Trailing-mean window for a training curve of ``n_points`` steps (1: no smoothing)."""
    return max(1, round(n_points / target_points))


def trailing_mean(
    points: Sequence[tuple[float, float, float]], window: int
) -> list[tuple[float, float, float]]:
    """Each ``(step, x, y)`` with y replaced by the mean of the last ``window`` ys (fewer at the start)."""
    ys = [p[2] for p in points]
    return [
        (step, x, float(np.mean(ys[max(0, i - window + 1) : i + 1])))
        for i, (step, x, _) in enumerate(points)
    ]


def aggregate(arm: str, series: Sequence[Sequence[tuple[float, float, float]]]) -> Curve | None:
    """Combine per-seed series of ``(step, x, y)`` into one curve over the steps.

    At each step, y is averaged over the seeds that reached it (and x too: for wall-clock plots,
    the mean time at which the seeds reached that step). ``None`` if there is no point at all.
    """
    by_step: dict[float, list[tuple[float, float]]] = {}
    for points in series:
        for step, x, y in points:
            by_step.setdefault(step, []).append((x, y))
    if not by_step:
        return None
    steps = sorted(by_step)
    xs = np.array([np.mean([p[0] for p in by_step[s]]) for s in steps])
    ys = [np.array([p[1] for p in by_step[s]]) for s in steps]
    return Curve(
        arm=arm,
        x=xs,
        mean=np.array([y.mean() for y in ys]),
        low=np.array([y.min() for y in ys]),
        high=np.array([y.max() for y in ys]),
        seeds=sum(1 for s in series if s),
    )


def line_plot(
    path: Path,
    curves: Sequence[Curve],
    colors: dict[str, str],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    markers: bool = False,
) -> Path:
    """Write one PNG (and an SVG beside it) with a mean line and a min–max band per arm."""
    fig = Figure(figsize=(7.0, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for curve in curves:
        color = colors.get(curve.arm, "#333333")
        label = f"{curve.arm} ({curve.seeds} seed{'s' if curve.seeds != 1 else ''})"
        ax.plot(
            curve.x,
            curve.mean,
            color=color,
            label=label,
            linewidth=1.6,
            marker="o" if markers else None,
            markersize=3.5,
        )
        if curve.seeds > 1:
            ax.fill_between(curve.x, curve.low, curve.high, color=color, alpha=0.18, linewidth=0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(loc="best", fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    with matplotlib.rc_context({"svg.hashsalt": "alignzoo"}):  # the same bytes every time
        fig.savefig(path.with_suffix(".svg"), format="svg", metadata={"Date": None})
    return path


def arm_colors(arms: Sequence[str]) -> dict[str, str]:
    """A fixed colour per arm, by the arm's position in the experiment."""
    return {arm: _COLORS[i % len(_COLORS)] for i, arm in enumerate(arms)}
