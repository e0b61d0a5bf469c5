"""Reading an experiment folder as the runner and engine write it.

``<run_dir>/experiment.yaml`` (the resolved spec) and one folder per run,
``<run_dir>/<arm>/seed-<n>/`` with ``status.json``, ``metrics.jsonl``, ``eval.jsonl`` and
``health.jsonl``. Readers are forgiving: a missing or unreadable status is ``{}``, a torn last
JSON line (a killed writer) is skipped, and a step written twice (a resumed run) keeps its last
row. Shared by the runner (what is finished) and the report (what to show).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from alignzoo import metrics as canonical
from alignzoo.config.schema import ExperimentSpec
from alignzoo.errors import UserError
from alignzoo.runfolder import ATTEMPT_NOTE, SEED_FOLDER, RunFolder, RunStatus, seed_folder
from alignzoo.types import append_jsonl as append_jsonl

EXPERIMENT_FILE = "experiment.yaml"


def read_status(run_dir: Path, problems: list[str] | None = None) -> dict[str, Any]:
    """A run's status.json ({} if absent or unreadable; an unreadable one is described in
    ``problems`` when given)."""
    path = RunFolder(Path(run_dir)).status
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # ValueError: bad UTF-8 or bad JSON
        if problems is not None:
            problems.append(f"{path}: not a JSON status file ({type(exc).__name__}); ignored")
        return {}
    if not isinstance(data, dict):
        if problems is not None:
            problems.append(f"{path}: expected a JSON object, got {type(data).__name__}; ignored")
        return {}
    return data


@dataclass
class RunData:
    """What one arm x seed folder holds."""

    arm: str
    seed: int
    path: Path
    status: str
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    health: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Files of the folder that could not be read whole (each names the file and why)."""
    swaps: list[dict[str, Any]] = field(default_factory=list)
    """Labeler changes requested during the run (``swaps.jsonl``), applied or rejected."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Earlier attempts kept in ``attempts/<n>/`` (a restart, or the lines a resume cut back):
    each ``attempt.json`` with ``n``, ``folder`` and, from its metrics.jsonl, ``steps``
    (the first and last step it recorded)."""

    @property
    def name(self) -> str:
        return f"{self.arm}/{seed_folder(self.seed)}"


def read_jsonl(path: Path, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file, one per line.

    A torn last line (a killed writer) is skipped silently; any other line that is not a JSON
    object (bytes that are not UTF-8, text that is not JSON) is skipped and described in
    ``problems`` when given, naming the file and the line.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        if problems is not None:
            problems.append(f"{path}: cannot be read ({exc}); ignored")
        return []
    lines = data.splitlines()
    rows: list[dict[str, Any]] = []
    bad: list[int] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except ValueError:
            if number < len(lines) or data.endswith(b"\n"):
                bad.append(number)
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(number)
    if bad and problems is not None:
        shown = ", ".join(str(n) for n in bad[:5]) + (" ..." if len(bad) > 5 else "")
        problems.append(
            f"{path}: {len(bad)} line(s) are not JSON objects (line {shown}); expected one "
            "JSON object per line, those lines were skipped"
        )
    return rows


def by_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step (the last one written wins: a resumed run rewrites steps), by step."""
    latest: dict[int, dict[str, Any]] = {}
    for row in rows:
        if isinstance(row.get("step"), (int, float)):
            latest[int(row["step"])] = row
    return [latest[s] for s in sorted(latest)]


def read_run(arm: str, seed: int, path: Path) -> RunData:
    """Read one run folder."""
    problems: list[str] = []
    folder = RunFolder(path)
    info = read_status(path, problems)
    metrics = by_step(read_jsonl(folder.metrics, problems))
    evals = by_step(read_jsonl(folder.eval, problems))
    running = RunStatus.RUNNING if metrics or evals else RunStatus.PENDING
    status = str(info.get("status") or running)
    health: dict[tuple[str, int], dict[str, Any]] = {}
    for row in read_jsonl(folder.stream("health"), problems):
        step = number(row.get("began_step", row.get("step")))
        if step is None:  # not a warning this version wrote: skip it rather than fail
            continue
        health.setdefault((str(row.get("signal")), int(step)), row)
    return RunData(
        arm=arm,
        seed=seed,
        path=path,
        status=status,
        error=info.get("error"),
        info=info,
        metrics=metrics,
        evals=evals,
        health=[health[k] for k in sorted(health, key=lambda k: (k[1], k[0]))],
        problems=problems,
        swaps=by_step_all(read_jsonl(folder.stream("swaps"), problems)),
        attempts=read_attempts(path),
    )


def read_attempts(path: Path) -> list[dict[str, Any]]:
    """What each ``attempts/<n>/`` of a run folder holds (see :attr:`RunData.attempts`)."""
    out = []
    root = RunFolder(path).attempts
    folders = sorted((p for p in root.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    for folder in folders:
        try:
            note = json.loads((folder / ATTEMPT_NOTE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            note = {"kind": "restarted", "reason": "(no attempt.json: an older alignzoo)"}
        steps = [r["step"] for r in read_jsonl(RunFolder(folder).metrics) if number(r.get("step"))]
        row = dict(note) if isinstance(note, dict) else {}
        row.update(n=int(folder.name), folder=str(folder.relative_to(path)))
        row["steps"] = (min(steps), max(steps)) if steps else None
        out.append(row)
    return out


def by_step_all(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in step order, all of them (several may share a step)."""
    return sorted(rows, key=lambda r: number(r.get("step")) or 0)


def load_spec(run_dir: Path) -> ExperimentSpec | None:
    """The resolved spec the runner wrote, or None if the folder has none."""
    path = run_dir / EXPERIMENT_FILE
    if not path.exists():
        return None
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
        return ExperimentSpec.model_validate(data)
    except UnicodeDecodeError:
        raise UserError(
            f"{path}: not a UTF-8 text file; expected the resolved experiment"
        ) from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (yaml.YAMLError, ValidationError) as exc:
        raise UserError(f"{path}: not a valid resolved experiment ({exc})") from None


def find_runs(run_dir: Path, arms: list[str]) -> list[RunData]:
    """Every run folder of the given arms, ordered by arm then seed."""
    runs = []
    for arm in arms:
        arm_dir = run_dir / arm
        if not arm_dir.is_dir():
            continue
        seeds = []
        for child in arm_dir.iterdir():
            match = SEED_FOLDER.match(child.name)
            if match and child.is_dir():
                seeds.append(int(match.group(1)))
        runs += [
            read_run(arm, seed, RunFolder.of(run_dir, arm, seed).path) for seed in sorted(seeds)
        ]
    return runs


def metric_key(metric: str) -> str:
    """The eval.jsonl key of the spec's evaluation metric ('exact_match' -> 'eval/exact_match')."""
    return canonical.evaluation_key(metric)


def number(value: Any) -> float | None:
    """A finite int or float as float; anything else (bool, str, NaN, None) is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
