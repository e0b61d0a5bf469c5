"""Fixtures: synthetic experiment folders laid out as the runner and engine write them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from alignzoo.config.schema import ExperimentSpec
from tests.core.experiment.fake_engine import make_spec

Builder = Callable[..., Path]


def write_experiment(
    root: Path,
    finals: dict[str, list[float]],
    failed: dict[tuple[str, int], str] | None = None,
    health: dict[tuple[str, int], list[dict]] | None = None,
    steps: int = 10,
    every: int = 5,
    baseline: str | None = None,
    running: tuple[tuple[str, int], ...] = (),
    target: float | None = None,
) -> Path:
    """An experiment folder whose runs end at the given final eval values (one per seed).

    Each run evaluates at 0, every, 2*every, ...; the last evaluation is the given value, earlier
    ones climb linearly to it from 0.1. ``failed`` runs get a failed status and that error.
    ``target``: the spec's ``evaluation.target``.
    """
    n_seeds = max(len(v) for v in finals.values())
    spec: ExperimentSpec = make_spec(
        {arm: 1e-4 for arm in finals}, seeds=tuple(range(n_seeds)), steps=steps, every=every
    )
    if baseline is not None:
        spec = spec.model_copy(update={"baseline": baseline})
    if target is not None:  # evaluation.target: the report's time to it
        evaluation = spec.evaluation.model_copy(update={"target": target})
        spec = spec.model_copy(update={"evaluation": evaluation})
    root.mkdir(parents=True, exist_ok=True)
    (root / "experiment.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    failed = failed or {}
    health = health or {}
    for arm, values in finals.items():
        for seed, final in enumerate(values):
            run = root / arm / f"seed-{seed}"
            run.mkdir(parents=True)
            eval_steps = list(range(0, steps + 1, every))
            with (run / "eval.jsonl").open("w") as fh:
                for i, step in enumerate(eval_steps):
                    value = 0.1 + (final - 0.1) * i / (len(eval_steps) - 1)
                    row = {
                        "step": step,
                        "time_s": step * (1.0 + seed),
                        "samples": step * 8,
                        "eval/exact_match": value,
                    }
                    fh.write(json.dumps(row) + "\n")
            with (run / "metrics.jsonl").open("w") as fh:
                for step in range(1, steps + 1):
                    row = {
                        "step": step,
                        "time_s": step * (1.0 + seed),
                        "samples": step * 8,
                        "reward/mean": final * step / steps,
                        "kl/ref": 0.01 * step,
                        "response_length/mean": 12.0,
                        "entropy": 0.4,
                    }
                    fh.write(json.dumps(row) + "\n")
            status = {
                "status": "finished",
                "error": None,
                "step": steps,
                "wall_clock_s": 10.0 * (1 + seed),
                "tokens_per_s": 500.0 + 100 * seed,
                "peak_memory_mb": 200.0 + seed,
                "samples": steps * 8,
            }
            if (arm, seed) in failed:
                status.update(status="failed", error=failed[(arm, seed)], step=3)
            if (arm, seed) in running:
                status.update(status="running", step=steps // 2)
            (run / "status.json").write_text(json.dumps(status))
            for line in health.get((arm, seed), []):
                with (run / "health.jsonl").open("a") as fh:
                    fh.write(json.dumps(line) + "\n")
    return root


@pytest.fixture
def experiment_dir(tmp_path: Path) -> Builder:
    """Build a synthetic experiment folder under tmp_path (see ``write_experiment``)."""

    def build(**kwargs: object) -> Path:
        return write_experiment(tmp_path / "exp", **kwargs)  # type: ignore[arg-type]

    return build
