"""The over-optimisation section: the training reward (the proxy) against the gold metric.

With ``evaluation.labeler`` set, every arm is evaluated by one labeler (the gold) while each
trains on its own (the proxy: a reward model, say). Optimising a learned reward first raises
both, then the proxy keeps rising while the gold falls (Gao et al. 2022, "Scaling Laws for
Reward Model Overoptimization"). This section draws, per arm, the gold metric and the proxy
against the distance from the reference policy, √KL, and against steps, marks each arm's peak
gold step, and says per arm and seed whether the gold fell from its peak by the final step.

KL here is per response: the canonical ``kl/ref`` (a per-token mean) times the mean response
length, at the training step of each evaluation; an arm without a reference model has no
``kl/ref`` and is drawn against steps only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from alignzoo import metrics as canonical
from alignzoo.report import plots
from alignzoo.report.document import Block
from alignzoo.runfolder import RunStatus
from alignzoo.runfolder.runfiles import RunData, number

FELL_BY = 0.05
"""A seed counts as over-optimised when its final gold value is this far below its peak."""


@dataclass
class GoldPoint:
    """One evaluation of one run: the gold metric and, at the same step, the proxy and KL."""

    step: int
    gold: float
    proxy: float | None
    sqrt_kl: float | None


def _train_row_at(metrics: list[dict[str, Any]], step: int) -> dict[str, Any] | None:
    """The training metrics of the last step at or before ``step`` (None before the first)."""
    found = None
    for row in metrics:
        at = number(row.get("step"))
        if at is not None and at <= step:
            found = row
    return found


def gold_points(run: RunData, key: str) -> list[GoldPoint]:
    """Every evaluation of ``run`` that has ``key``, with the proxy and √KL of its step."""
    points = []
    for row in run.evals:
        step, gold = number(row.get("step")), number(row.get(key))
        if step is None or gold is None:
            continue
        train = _train_row_at(run.metrics, int(step)) if step > 0 else None
        proxy = sqrt_kl = None
        if train is not None:
            proxy = number(train.get(canonical.REWARD_MEAN))
            kl = number(train.get(canonical.KL_REF))
            length = number(train.get(canonical.RESPONSE_LENGTH))
            if kl is not None and length is not None:
                sqrt_kl = math.sqrt(max(kl * length, 0.0))
        elif step == 0:
            sqrt_kl = 0.0  # the start policy is the reference
        points.append(GoldPoint(int(step), gold, proxy, sqrt_kl))
    return sorted(points, key=lambda p: p.step)


@dataclass
class SeedSummary:
    """One run's gold at the start, at its peak and at the end."""

    seed: int
    start: float
    peak: float
    peak_step: int
    final: float

    @property
    def fell(self) -> bool:
        return self.final < self.peak - FELL_BY


def summarise(points: list[GoldPoint], seed: int) -> SeedSummary | None:
    """Start, peak (the first step reaching the highest gold) and final gold of one run."""
    if not points:
        return None
    peak = max(points, key=lambda p: (p.gold, -p.step))
    return SeedSummary(seed, points[0].gold, peak.gold, peak.step, points[-1].gold)


def _plot(path: Path, arms: list[str], series: dict[str, list[list[GoldPoint]]], key: str) -> None:
    """Gold and proxy against √KL (left) and against step (right); peaks marked."""
    colors = plots.arm_colors(arms)
    fig = Figure(figsize=(11.0, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    by_kl, by_step = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    proxy_axis = by_step.twinx()
    for arm in arms:
        color = colors.get(arm, "#333333")
        for i, points in enumerate(series.get(arm, [])):
            label = arm if i == 0 else None
            with_kl = [p for p in points if p.sqrt_kl is not None]
            if with_kl:
                by_kl.plot(
                    [float(p.sqrt_kl or 0.0) for p in with_kl],
                    [p.gold for p in with_kl],
                    "-o",
                    color=color,
                    markersize=3,
                    linewidth=1.2,
                    alpha=0.8,
                    label=label,
                )
            by_step.plot(
                [p.step for p in points],
                [p.gold for p in points],
                "-o",
                color=color,
                markersize=3,
                linewidth=1.2,
                alpha=0.8,
                label=label,
            )
            proxied = [p for p in points if p.proxy is not None]
            proxy_axis.plot(
                [p.step for p in proxied],
                [float(p.proxy or 0.0) for p in proxied],
                "--",
                color=color,
                linewidth=1.0,
                alpha=0.6,
            )
            best = summarise(points, 0)
            if best is not None:
                by_step.plot([best.peak_step], [best.peak], "*", color=color, markersize=11)
    by_kl.set_title(f"gold ({key}) against √KL to the reference")
    by_kl.set_xlabel("√KL (nats per response)")
    by_kl.set_ylabel(key)
    by_step.set_title("gold (solid, ★ peak) and proxy reward (dashed)")
    by_step.set_xlabel("step")
    by_step.set_ylabel(key)
    proxy_axis.set_ylabel("training reward (reward/mean)")
    for ax in (by_kl, by_step):
        ax.grid(True, alpha=0.3)
    by_step.legend(loc="best", fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def in_words(arm: str, summaries: list[SeedSummary], series: list[list[GoldPoint]]) -> str:
    """One arm's outcome in plain words: did the gold improve over the start on every seed,
    did it fall from its peak (over-optimisation), and did the proxy rise meanwhile."""
    n = len(summaries)
    changes = [s.final - s.start for s in summaries]
    up = sum(c > 0 for c in changes)
    span = f"{min(changes):+.3f} to {max(changes):+.3f}"
    if up == n:
        text = f"{arm} improved the gold over its start on every seed ({n}), by {span}"
    elif up == 0:
        text = f"{arm} improved the gold on no seed ({n}): its change was {span}"
    else:
        text = f"{arm} improved the gold on {up} of {n} seeds (change {span})"
    fell = [s for s in summaries if s.fell]
    if fell:
        peaks = ", ".join(str(s.peak_step) for s in fell)
        text += (
            f"; it over-optimised on {len(fell)} of {n} seeds, whose final gold is more than "
            f"{FELL_BY} below the peak (reached at step {peaks})"
        )
    else:
        text += f"; no seed fell more than {FELL_BY} below its peak"
    proxies = [[p.proxy for p in points if p.proxy is not None] for points in series]
    proxies = [p for p in proxies if len(p) >= 2]
    if proxies:
        first, last = _mean([p[0] for p in proxies]), _mean([p[-1] for p in proxies])
        text += f". Its training reward went from {first:.3g} to {last:.3g}"
        if last > first and _mean(changes) < 0:
            text += " while the gold fell: the proxy was optimised against the gold"
    return text + "."


def overoptimisation_blocks(
    run_dir: Path,
    arms: list[str],
    runs: list[RunData],
    key: str,
    gold: str | None,
    compare_at: str = "final",
    plot_dir: str = "plots",
) -> list[Block]:
    """The report's section; ``gold`` is the evaluation labeler's name (None: not set);
    ``compare_at``: where the comparisons above are made (``evaluation.compare_at``);
    ``plot_dir``: the folder under ``run_dir`` its plot goes to."""
    blocks = [Block("h2", "Gold against proxy (over-optimisation)")]
    if gold is None:
        blocks.append(
            Block(
                "p",
                (
                    "Not drawn: the experiment sets no evaluation.labeler, so each arm is evaluated by "
                    "its own training labeler and there is no gold to compare the training reward with."
                ),
            )
        )
        return blocks
    series: dict[str, list[list[GoldPoint]]] = {}
    rows = []
    words = []
    for arm in arms:
        summaries = []
        for run in runs:
            if run.arm != arm or run.status == RunStatus.FAILED:
                continue
            points = gold_points(run, key)
            if points:
                series.setdefault(arm, []).append(points)
                summary = summarise(points, run.seed)
                if summary is not None:
                    summaries.append(summary)
        if not summaries:
            continue
        n = len(summaries)
        fell = sum(s.fell for s in summaries)
        words.append(in_words(arm, summaries, series.get(arm, [])))
        rows.append(
            [
                arm,
                f"{sum(s.start for s in summaries) / n:.3f}",
                f"{sum(s.peak for s in summaries) / n:.3f}",
                ", ".join(str(s.peak_step) for s in summaries),
                f"{sum(s.final for s in summaries) / n:.3f}",
                f"{fell} of {n}",
            ]
        )
    if not rows:
        blocks.append(Block("p", f"No evaluation with {key} written yet."))
        return blocks
    blocks.append(
        Block(
            "p",
            (
                f"Every arm is evaluated by the gold labeler {gold!r} ({key}) and trains on its own "
                "labeler's reward (the proxy). Peak: each seed's highest gold value (mean over seeds) "
                f"and the step it was first reached; 'fell': seeds whose final gold is more than "
                f"{FELL_BY} below their peak, the mark of a proxy optimised past the point where it "
                "tracks the gold. The comparisons above are at "
                + (
                    "each run's best kept checkpoint (evaluation.compare_at); the final gold "
                    "here is the last evaluation."
                    if compare_at == "best_checkpoint"
                    else "the final step."
                )
            ),
        )
    )
    headers = ["arm", "gold at start", "peak gold", "peak step per seed", "final gold", "fell"]
    blocks.append(Block("table", headers=headers, rows=rows))
    blocks.append(Block("ul", items=words))
    path = run_dir / plot_dir / "gold_vs_proxy.png"
    _plot(path, arms, series, key)
    blocks.append(
        Block(
            "img",
            (
                "Gold (solid) and proxy (dashed) per seed: left against √KL to the reference (kl/ref x "
                "mean response length, at the evaluation's step), right against step, ★ the peak."
            ),
            path=f"{plot_dir}/gold_vs_proxy.png",
        )
    )
    return blocks
