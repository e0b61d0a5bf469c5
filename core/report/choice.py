"""A comparison metric chosen after the run: ``alignzoo report RUN_DIR --metric M``.

The report compares arms on the experiment's ``evaluation.metric``. After the run, any other
metric the runs recorded in ``eval.jsonl`` can be compared the same way (the same statistics,
from the same files, no training): this module resolves the name the user gave to an
``eval.jsonl`` key, refuses a metric no run recorded (naming those that are) or one some runs
lack (naming them: a comparison on part of the runs would not be the experiment's), and names
the files such a report is written to, beside the default report and never over it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from alignzoo import metrics as canonical
from alignzoo.errors import UserError
from alignzoo.runfolder import RunStatus
from alignzoo.runfolder.runfiles import RunData, number

BOOKKEEPING = frozenset({"step", "time_s", "samples"})
"""Keys of every eval.jsonl row that say when it was written, not how the policy did."""


@dataclass(frozen=True)
class MetricChoice:
    """The metric a report compares on when it is not the experiment's own comparison."""

    key: str
    """The eval.jsonl key compared on ('eval/score')."""
    higher: bool
    """Its direction."""
    direction: str
    """Where the direction came from: 'given' (the option) or 'guessed' (from the name)."""
    experiment_key: str
    """The experiment's own metric (the one report.md compares on)."""
    stem: str
    """The report's file name without suffix ('report-score'); its plots go to
    ``plots-<stem without 'report-'>/``."""

    @property
    def plot_dir(self) -> str:
        return "plots-" + self.stem.removeprefix("report-")


def short_name(key: str) -> str:
    """How ``evaluation.metric`` names a key ('eval/score' -> 'score'; others unchanged)."""
    return key.removeprefix("eval/")


def recorded_metrics(runs: list[RunData]) -> set[str]:
    """Every eval.jsonl key with a number in some row of some run (bookkeeping left out)."""
    return {
        key
        for run in runs
        for row in run.evals
        for key, value in row.items()
        if key not in BOOKKEEPING and number(value) is not None
    }


def _has(run: RunData, key: str) -> bool:
    return any(number(row.get(key)) is not None for row in run.evals)


def resolve_key(metric: str, runs: list[RunData], run_dir: Path) -> str:
    """The eval.jsonl key ``metric`` names ('score' and 'eval/score' -> 'eval/score'; a key
    recorded as is, without a namespace, also names itself); a metric no run recorded is a
    :class:`UserError` naming the folder, the metrics recorded and the closest of them."""
    key = canonical.evaluation_key(metric)
    recorded = recorded_metrics(runs)
    if key in recorded:
        return key
    if metric in recorded:
        return metric
    if not recorded:
        raise UserError(
            f"--metric {metric}: no run in {run_dir} has recorded an evaluation yet "
            "(eval.jsonl), so there is no metric to compare on"
        )
    names = sorted(short_name(k) for k in recorded)
    pool = sorted(recorded) if "/" in metric else names
    close = difflib.get_close_matches(metric, pool, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else "."
    raise UserError(
        f"--metric {metric}: no run in {run_dir} recorded {key} in eval.jsonl{hint} "
        f"Recorded: {', '.join(names)}"
    )


def check_every_run(metric: str, key: str, runs: list[RunData], run_dir: Path) -> None:
    """Refuse a metric that some runs lack (the finished runs, and the unfinished ones that
    have evaluated; failed runs are not compared): the report would compare part of them."""
    checked = [
        r
        for r in runs
        if r.status != RunStatus.FAILED and (r.status == RunStatus.FINISHED or r.evals)
    ]
    lacking = [r for r in checked if not _has(r, key)]
    if not lacking:
        return
    common = {k for k in recorded_metrics(checked) if all(_has(r, k) for r in checked)}
    instead = (
        f"; every run recorded {', '.join(sorted(short_name(k) for k in common))}" if common else ""
    )
    raise UserError(
        f"--metric {metric}: {key} is missing from {len(lacking)} of {len(checked)} runs in "
        f"{run_dir} ({', '.join(r.name for r in lacking)}); comparing the others would use "
        f"partial data{instead}"
    )


_UNSAFE = re.compile(r"[^A-Za-z0-9._@+=-]")


def report_stem(key: str, higher: bool, default_higher: bool) -> str:
    """The file name (without suffix) of a report on ``key``: 'report-score' for eval/score,
    with '-lower-is-better' / '-higher-is-better' appended when the direction was given
    against the metric's own (so no report overwrites one in the other direction)."""
    slug = _UNSAFE.sub("_", short_name(key).replace("/", "-"))
    stem = f"report-{slug}"
    if higher != default_higher:
        stem += "-higher-is-better" if higher else "-lower-is-better"
    return stem
