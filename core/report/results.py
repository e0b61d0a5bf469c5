"""A report's figures as one JSON file: what the documentation quotes from an experiment, tied to
the run that produced it (``docs/results/<figure>.json``, written by ``make figures``).

``alignzoo report RUN_DIR --results FILE`` writes, beside the report it rewrites:

- ``experiment``: the experiment's name, the compared metric and its direction, the baseline;
- ``tables``: every table of report.md as it prints them (strings), each with the heading of
  the section it sits under;
- ``evaluations``: per run (``arm/seed-N``) every evaluation's numbers (the step and each
  ``eval/*`` metric it recorded);
- ``curves``: per arm the compared metric's mean over its runs at each evaluation step (what
  the report's evaluation plot draws), ``[[step, mean, runs], ...]``;
- ``training``: per run, each learning metric's (not timing, throughput, labeler or batch
  bookkeeping) mean over the first and over the last
  :data:`EDGE_STEPS` steps (``{"metric": [first, last]}``): where a curve started and ended;
- ``runs``: per run its status, steps, wall clock, tokens per second and peak memory;
- ``wall_clock_s``: from the start of the first ``alignzoo run`` session of the folder to the
  last run's final write (a resumed experiment counts its pause);
- ``provenance``: the experiment's sessions (command, start, experiment file hash) and every
  distinct setting its runs ran under (versions, commit, lock, CPU model and kernels, threads:
  :mod:`alignzoo.provenance`), each with the runs that share it.

Numbers the documentation quotes from the run are checked against this file by the test suite
(tests/core/test_figures.py), so a figure that no longer matches its run fails it.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from alignzoo.provenance import COMPARED, distinct_settings, read_sessions
from alignzoo.report.document import Block
from alignzoo.runfolder import RunFolder, RunStatus, write_atomic
from alignzoo.runfolder.runfiles import RunData, number

RESULTS_FORMAT = 1
EDGE_STEPS = 5
# Training metrics of bookkeeping rather than learning, left out of ``training``.
_NOT_LEARNING = (
    "step",
    "time_s",
    "lr",
    "samples",
    "timing/",
    "throughput/",
    "labeler/",
    "label/",
    "batch/",
)


def _tables(blocks: list[Block]) -> list[dict[str, Any]]:
    tables, section = [], ""
    for block in blocks:
        if block.kind in ("h1", "h2"):
            section = block.text
        elif block.kind == "table":
            tables.append({"section": section, "headers": block.headers, "rows": block.rows})
    return tables


def _edges(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each metric's mean over the first and the last :data:`EDGE_STEPS` rows that hold it."""
    series: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if not key.startswith(_NOT_LEARNING) and number(value) is not None:
                series.setdefault(key, []).append(float(value))
    return {
        key: [
            sum(values[:EDGE_STEPS]) / len(values[:EDGE_STEPS]),
            sum(values[-EDGE_STEPS:]) / len(values[-EDGE_STEPS:]),
        ]
        for key, values in sorted(series.items())
    }


def _curves(exp: Any) -> dict[str, list[list[float]]]:
    curves = {}
    for arm in exp.arms:
        at: dict[int, list[float]] = {}
        for run in exp.runs:
            if run.arm != arm:
                continue
            for row in run.evals:
                value = number(row.get(exp.key))
                if value is not None and isinstance(row.get("step"), int):
                    at.setdefault(row["step"], []).append(value)
        curves[arm] = [[step, sum(v) / len(v), len(v)] for step, v in sorted(at.items())]
    return curves


def _wall_clock(run_dir: Path, runs: list[RunData]) -> float | None:
    sessions = read_sessions(run_dir)
    ends = [RunFolder(run.path).status.stat().st_mtime for run in runs]
    ends = [end for end, run in zip(ends, runs, strict=True) if run.status == RunStatus.FINISHED]
    if not sessions or not ends:
        return None
    try:
        start = datetime.fromisoformat(str(sessions[0]["started"])).timestamp()
    except (KeyError, ValueError):
        return None
    return round(max(ends) - start, 1)


def results_document(exp: Any, blocks: list[Block]) -> dict[str, Any]:
    """The results document of an experiment folder (``exp``: the report's view of it) whose
    report is ``blocks``."""
    runs: list[RunData] = exp.runs
    run_dir: Path = exp.run_dir
    return {
        "format": RESULTS_FORMAT,
        "experiment": {
            "name": exp.name,
            "metric": exp.key,
            "higher_is_better": exp.higher,
            "baseline": exp.baseline,
            "arms": exp.arms,
        },
        "tables": _tables(blocks),
        "evaluations": {
            run.name: [
                {k: v for k, v in row.items() if k == "step" or number(v) is not None}
                for row in run.evals
            ]
            for run in runs
        },
        "curves": _curves(exp),
        "training": {run.name: _edges(run.metrics) for run in runs},
        "runs": {
            run.name: {
                "status": run.status,
                "steps": run.info.get("step"),
                **{
                    k: number(run.info.get(k))
                    for k in ("wall_clock_s", "tokens_per_s", "peak_memory_mb")
                },
            }
            for run in runs
        },
        "wall_clock_s": _wall_clock(run_dir, runs),
        "provenance": {
            "compared_on": list(COMPARED),
            "sessions": [
                {k: entry.get(k) for k in ("command", "started", "experiment_sha256")}
                for entry in read_sessions(run_dir)
            ],
            "settings": distinct_settings({run.name: run.path for run in runs}),
        },
    }


def write_results(path: Path, document: dict[str, Any]) -> Path:
    """Write ``document`` as indented JSON (stable key order, so reruns diff cleanly)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(document, indent=1, sort_keys=True) + "\n")
    return path


def write_measurement(path: Path, document: dict[str, Any]) -> Path:
    """Write a benchmark's figures (:func:`write_results`) with this process's provenance
    (commit, lock, CPU and its kernels, threads), as the docs' figures check expects."""
    from alignzoo import provenance

    return write_results(path, {**document, "provenance": {"settings": [provenance.collect()]}})
