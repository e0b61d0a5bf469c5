"""The runner's console view: one progress line per run, polled from the run folders.

Each line shows the arm, seed, status (queued, running, finished, skipped, failed), progress
against the budget with an ETA, and the latest training reward. Runs in worker processes write
only to their folders, so the view reads ``status.json`` and the tail of ``metrics.jsonl`` once
a quarter of a second rather than receiving messages. When runs live in worker processes
(``--jobs > 1``) the view also prints a line per finished evaluation, and the runner ends with
:func:`print_summary`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alignzoo.config.schema import ExperimentSpec
from alignzoo.metrics import evaluation_key
from alignzoo.runfolder import RunFolder, RunStatus
from alignzoo.runfolder.runfiles import read_status

if TYPE_CHECKING:
    from alignzoo.experiment.arm import RunResult

POLL_SECONDS = 0.25
"""How often the view reads the run folders (often enough for short runs to move the bar)."""


def print_summary(console: Any, run_dir: Path) -> None:
    """The experiment's outcome as one table: per arm, seeds, start, final, change, verdict."""
    from rich.table import Table

    from alignzoo.report.sections import summary_rows

    metric, rows = summary_rows(run_dir)
    table = Table(title=f"{metric} (final: mean ± 95% CI over seeds; verdict: the report's)")
    for header in ("arm", "seeds", "start", "final", "change", "verdict vs baseline"):
        table.add_column(header)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def last_row(path: Path) -> dict[str, Any] | None:
    """The last complete JSON line of a file, reading only its tail."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            tail = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict):
                return row
    return None


class ProgressView:
    """One line per run (arm, seed, status, progress, reward), polled from the run folders."""

    def __init__(self, console: Any, spec: ExperimentSpec, runs: list[tuple[str, int, Path]]):
        self.enabled = console is not None
        self.tasks: dict[tuple[str, int], Any] = {}
        self.dirs = {(a, s): d for a, s, d in runs}
        self.running: set[tuple[str, int]] = set()
        self.started: set[tuple[str, int]] = set()
        self.announce_evals = False  # set by the runner when runs live in worker processes
        self.metric = evaluation_key(spec.evaluation.metric)  # the compared metric's key
        self.evals_seen: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        budget = spec.budget
        if budget.steps is not None:
            self.total, self.field, self.unit = float(budget.steps), "step", "steps"
        elif budget.samples is not None:
            self.total, self.field, self.unit = float(budget.samples), "samples", "samples"
        else:
            self.total, self.field, self.unit = float(budget.wall_clock_s or 1), "time_s", "s"
        if not self.enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"),
            TextColumn("{task.fields[status]:<9}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn(self.unit),
            TimeRemainingColumn(),
            TextColumn("{task.fields[reward]}"),
            console=console,
            transient=False,
        )
        for arm, seed, _ in runs:
            self.tasks[(arm, seed)] = self.progress.add_task(
                f"{arm} seed {seed}", total=self.total, status="queued", reward="", start=False
            )

    def __enter__(self) -> ProgressView:
        if self.enabled:
            self.progress.start()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._refresh()
            self.progress.stop()

    def start(self, arm: str, seed: int) -> None:
        if self.enabled:
            self.running.add((arm, seed))
            self.started.add((arm, seed))
            self.progress.start_task(self.tasks[(arm, seed)])
            self.progress.update(self.tasks[(arm, seed)], status=RunStatus.RUNNING.value)

    def done(self, result: RunResult) -> None:
        key = (result.arm, result.seed)
        self.running.discard(key)
        if not self.enabled:
            return
        self._update(key)
        status = "skipped" if result.skipped else result.status
        colors = {RunStatus.FINISHED: "green", "skipped": "green", RunStatus.FAILED: "red"}
        color = colors.get(status, "white")
        update: dict[str, Any] = {"status": f"[{color}]{status}[/{color}]"}
        if result.status == RunStatus.FINISHED:
            update["completed"] = self.total
        self.progress.update(self.tasks[key], **update)
        self.progress.stop_task(self.tasks[key])

    def queue(self, arm: str, seed: int) -> None:
        """Submitted to a worker pool: shown as running once its folder says so."""
        self.running.add((arm, seed))

    def _update(self, key: tuple[str, int]) -> None:
        task = self.tasks[key]
        status = read_status(self.dirs[key]).get("status")
        if key not in self.started and status == RunStatus.RUNNING:
            self.started.add(key)
            self.progress.start_task(task)
            self.progress.update(task, status=RunStatus.RUNNING.value)
        if self.announce_evals:
            self._announce_eval(key)
        row = last_row(RunFolder(self.dirs[key]).metrics)
        if row is None:
            return
        done = row.get(self.field)
        reward = row.get("reward/mean")
        update: dict[str, Any] = {}
        if isinstance(done, (int, float)):
            update["completed"] = min(float(done), self.total)
        if isinstance(reward, (int, float)):
            update["reward"] = f"reward {reward:.3f}"
        self.progress.update(self.tasks[key], **update)

    def _announce_eval(self, key: tuple[str, int]) -> None:
        """Print one line when a worker's run writes a new evaluation (its own console is off)."""
        row = last_row(RunFolder(self.dirs[key]).eval)
        if row is None or not isinstance(row.get("step"), int):
            return
        step = int(row["step"])
        if self.evals_seen.get(key, -1) >= step:
            return
        self.evals_seen[key] = step
        value = row.get(self.metric)
        shown = f"{value:.4g}" if isinstance(value, (int, float)) else "n/a"
        self.progress.console.print(
            f"{key[0]} seed {key[1]} eval @ step {step}: {self.metric} {shown}", highlight=False
        )

    def _refresh(self) -> None:
        for key in list(self.running):
            self._update(key)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self._refresh()
