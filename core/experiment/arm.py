"""One arm x seed run as the runner and every executor start it: the engine's ``run_one``,
with any exception turned into a failed :class:`RunResult` (and the run folder's
``status.json`` saying why).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alignzoo.runfolder import RunFolder, RunStatus, seed_folder, write_atomic
from alignzoo.runfolder.runfiles import read_status

if TYPE_CHECKING:
    from alignzoo.config.loader import LoadedExperiment

RunFn = Callable[..., Any]
"""The function that runs one arm x seed (the engine's ``run_one``, or a test's stand-in)."""


@dataclass
class RunResult:
    """How one arm x seed run ended."""

    arm: str
    seed: int
    out_dir: Path
    status: RunStatus  # finished or failed
    error: str | None = None
    skipped: bool = False
    steps: int | None = None
    wall_clock_s: float | None = None

    @property
    def name(self) -> str:
        return f"{self.arm}/{seed_folder(self.seed)}"


def run_engine(
    loaded: LoadedExperiment,
    arm: str,
    seed: int,
    out_dir: Path,
    resume: bool = False,
    console: Any = None,
    resume_from: Path | None = None,
) -> Any:
    """The engine's run_one (imported late: it pulls in torch)."""
    from alignzoo.engine.loop import run_one
    from alignzoo.human.iterate import Rounds

    return run_one(
        loaded,
        arm,
        seed,
        out_dir,
        resume=resume,
        console=console,
        resume_from=resume_from,
        rounds=Rounds,
    )


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def record_failure(run_dir: Path, error: str) -> None:
    """Make status.json say failed with ``error`` (keeping what the engine wrote)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    status = read_status(run_dir)
    if status.get("status") == RunStatus.FAILED and status.get("error"):
        return
    status.update(status=RunStatus.FAILED.value, error=error)
    write_atomic(RunFolder(run_dir).status, json.dumps(status, indent=2))


def execute_run(
    run_fn: RunFn,
    loaded: LoadedExperiment,
    arm: str,
    seed: int,
    run_dir: Path,
    resume: bool,
    console: Any,
) -> RunResult:
    """Run one arm x seed; any exception (not an interrupt) becomes a failed result."""
    try:
        summary = run_fn(loaded, arm, seed, run_dir, resume=resume, console=console)
    except Exception as exc:
        message = error_text(exc)
        record_failure(run_dir, message)
        return RunResult(arm, seed, run_dir, RunStatus.FAILED, message)
    ended = getattr(summary, "status", None) or read_status(run_dir).get("status")
    status = RunStatus.FINISHED if ended == RunStatus.FINISHED else RunStatus.FAILED
    error: str | None = getattr(summary, "error", None)
    if status is RunStatus.FAILED:
        error = str(error or read_status(run_dir).get("error") or "the run did not finish")
        record_failure(run_dir, error)
    return RunResult(
        arm,
        seed,
        run_dir,
        status,
        error,
        steps=getattr(summary, "steps", None),
        wall_clock_s=getattr(summary, "wall_clock_s", None),
    )
