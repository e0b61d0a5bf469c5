"""A stand-in for ``alignzoo.engine.loop.run_one`` that writes synthetic run folders.

Top-level functions only, so that spawned worker processes can import them. The numbers are a
deterministic function of (arm's learning rate, seed, step): an arm with ``lr: 0`` does not
learn, two arms with the same config give the same numbers, and a run stopped and resumed
writes exactly what an uninterrupted run writes (timings included).
"""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from alignzoo.config.schema import ExperimentSpec
from alignzoo.errors import RunError

KILL_ENV = "ALIGNZOO_FAKE_KILL"  # "arm:seed:step": raise KeyboardInterrupt there
DIE_ENV = "ALIGNZOO_FAKE_DIE"  # "arm:seed:step": the process kills itself (SIGKILL) there
LOG_ENV = "ALIGNZOO_FAKE_LOG"  # a file each call appends "arm seed resume threads" to
DIE_ONCE_ENV = "ALIGNZOO_FAKE_DIE_ONCE"  # "arm:seed:step:FLAG": SIGKILL there while FLAG exists


@dataclass
class FakeSummary:
    status: str
    error: str | None
    steps: int
    wall_clock_s: float
    tokens_per_s: float
    peak_memory_mb: float


def make_spec(
    arms: dict[str, float],
    seeds: tuple[int, ...] = (0, 1, 2),
    steps: int = 6,
    every: int = 2,
    name: str = "exp",
    fail: tuple[str, ...] = (),
    output_dir: str = "runs",
) -> ExperimentSpec:
    """An experiment whose arms differ only in learning rate; arms in ``fail`` crash."""
    return ExperimentSpec.model_validate(
        {
            "name": name,
            "seeds": list(seeds),
            "budget": {"steps": steps},
            "evaluation": {"every": every},
            "output_dir": output_dir,
            "arms": {
                arm: {
                    "algorithm": {"name": "grpo", "params": {}},
                    "training": {"lr": lr},
                    "description": "fail" if arm in fail else "",
                }
                for arm, lr in arms.items()
            },
        }
    )


def noise(seed: int) -> float:
    return 0.05 * math.sin(seed * 12.9898 + 1.0)


def eval_value(lr: float, seed: int, step: int) -> float:
    gain = 0.4 if lr > 0 else 0.0
    return round(0.3 + gain * (1 - math.exp(-step / 3)) + noise(seed), 6)


def train_metrics(lr: float, seed: int, step: int) -> dict[str, float]:
    gain = 0.5 if lr > 0 else 0.0
    return {
        "reward/mean": round(0.2 + gain * (1 - math.exp(-step / 4)) + noise(seed) / 2, 6),
        "reward/std": 0.4,
        "kl/ref": round(0.01 * step if lr > 0 else 0.0, 6),
        "response_length/mean": 10.0 + seed,
        "entropy": 0.5,
        "loss": 0.1,
    }


def _append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, sort_keys=True) + "\n")


def write_run(spec: ExperimentSpec, arm: str, seed: int, out_dir: Path, resume: bool) -> int:
    """Write (or continue) one synthetic run; return the number of steps."""
    lr = spec.arms[arm].training.lr
    steps = spec.budget.steps or 1
    every = spec.evaluation.every
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics, evals = out_dir / "metrics.jsonl", out_dir / "eval.jsonl"
    start = 0
    if resume and metrics.exists():
        done = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip()]
        start = max(done, default=0)
    else:
        for path in (metrics, evals):
            path.unlink(missing_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(spec.arms[arm].model_dump(mode="json")))
        _append(
            evals,
            {"step": 0, "time_s": 0.0, "samples": 0, "eval/exact_match": eval_value(lr, seed, 0)},
        )
    status = out_dir / "status.json"
    kill = os.environ.get(KILL_ENV, "")
    for step in range(start + 1, steps + 1):
        if kill == f"{arm}:{seed}:{step}":
            raise KeyboardInterrupt
        if os.environ.get(DIE_ENV) == f"{arm}:{seed}:{step}":
            os.kill(os.getpid(), signal.SIGKILL)  # as the OS does to a process out of memory
        where, _, flag = os.environ.get(DIE_ONCE_ENV, "").rpartition(":")
        if where == f"{arm}:{seed}:{step}" and Path(flag).exists():
            Path(flag).unlink()  # the next attempt gets past this step
            os.kill(os.getpid(), signal.SIGKILL)
        row = {"step": step, "time_s": step * 0.5, "samples": step * 32}
        row.update(train_metrics(lr, seed, step))
        _append(metrics, row)
        if step % every == 0 or step == steps:
            _append(
                evals,
                {
                    "step": step,
                    "time_s": step * 0.5,
                    "samples": step * 32,
                    "eval/exact_match": eval_value(lr, seed, step),
                },
            )
        status.write_text(json.dumps({"status": "running", "step": step, "error": None}))
    return steps


def fake_run_one(
    loaded: Any, arm: str, seed: int, out_dir: Path, resume: bool = False, console: Any = None
) -> FakeSummary:
    """Same signature as the engine's run_one."""
    log = os.environ.get(LOG_ENV)
    if log:
        threads = os.environ.get("OMP_NUM_THREADS", "")
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"{arm} {seed} {int(resume)} {threads} {os.getpid()}\n")
    spec: ExperimentSpec = loaded.spec
    if spec.arms[arm].description == "fail":
        out_dir.mkdir(parents=True, exist_ok=True)
        raise RunError(f"loss is NaN at step 1 ({arm})")
    steps = write_run(spec, arm, seed, Path(out_dir), resume)
    wall = steps * 0.5
    summary = FakeSummary("finished", None, steps, wall, 1000.0 + seed, 123.0)
    (Path(out_dir) / "status.json").write_text(
        json.dumps(
            {
                "status": "finished",
                "error": None,
                "step": steps,
                "wall_clock_s": wall,
                "tokens_per_s": summary.tokens_per_s,
                "peak_memory_mb": summary.peak_memory_mb,
                "samples": steps * 32,
            }
        )
    )
    return summary
