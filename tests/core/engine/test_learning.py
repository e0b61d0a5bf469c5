"""The issue's "Done when": each algorithm, run from a YAML on the embedded task, improves.

Set-up: a tiny policy warm-started on 1-digit addition (about 90% greedy exact match), sampled at
temperature 1.5 so that its training reward starts near 0.45: there is room to learn by
sharpening the distribution. For each algorithm the training reward (for offline DPO the
preference accuracy) of the first window of steps is compared with the last window; the
improvement must exceed twice the standard error of the difference of the two window means,
computed from the step-to-step spread measured in those windows.

Offline DPO's first step is left out of its window: there the policy equals the reference, the
implicit rewards of chosen and rejected tie, and the accuracy is 0 by definition.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

from .conftest import read_jsonl, tiny_experiment

STEPS = 150
WINDOW = 30
ONLINE = ("ppo", "grpo", "rloo", "reinforce_pp", "dpo", "kto")


def _experiment(online: bool) -> dict:
    return tiny_experiment(
        name="learning-online" if online else "learning-offline",
        budget={"steps": STEPS},
        model={"embedded": {"sft_steps": 500}},
        data={"online": online},
        training={
            "lr": 5e-4,
            "warmup_steps": 3,
            "prompts_per_step": 16,
            "samples_per_prompt": 4,
            "micro_batch_size": 64,
            "checkpoint_every": STEPS,
            "sampling": {"max_new_tokens": 4, "temperature": 1.5},
        },
        evaluation={"every": STEPS, "num_prompts": 8},
        arms={name: {"algorithm": name} for name in (ONLINE if online else ("dpo",))},
    )


def improvement(values: list[float], window: int) -> tuple[float, float]:
    """(last-window mean - first-window mean, standard error of that difference)."""
    first, last = values[:window], values[-window:]
    se = (statistics.variance(first) / window + statistics.variance(last) / window) ** 0.5
    return statistics.mean(last) - statistics.mean(first), se


def test_improvement_measure() -> None:
    flat = [0.4, 0.5] * 30
    diff, se = improvement(flat, 10)
    assert diff == pytest.approx(0.0) and se > 0
    rising = [0.4 + 0.01 * i + (0.02 if i % 2 else -0.02) for i in range(60)]
    diff, se = improvement(rising, 10)
    assert diff == pytest.approx(0.5) and diff > 2 * se


def _run(write_experiment, tmp_path: Path, online: bool, arm: str) -> list[dict]:
    loaded = load_experiment(write_experiment(_experiment(online)))
    out = tmp_path / arm
    summary = run_one(loaded, arm, 0, out)
    assert summary.status == "finished", summary.error
    return read_jsonl(out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("arm", ONLINE)
def test_online_algorithm_improves_training_reward(write_experiment, tmp_path, arm) -> None:
    rows = _run(write_experiment, tmp_path, True, arm)
    assert len(rows) == STEPS
    diff, se = improvement([r["reward/mean"] for r in rows], WINDOW)
    assert diff > 2 * se, f"{arm}: reward changed by {diff:+.3f} (standard error {se:.3f})"


@pytest.mark.slow
def test_offline_dpo_improves_preference_accuracy(write_experiment, tmp_path) -> None:
    rows = _run(write_experiment, tmp_path, False, "dpo")
    assert "reward/mean" not in rows[0]  # nothing is sampled offline
    assert rows[0]["throughput/tokens_per_s"] > 0  # the dataset's response tokens are counted
    diff, se = improvement([r["dpo/rewards/accuracy"] for r in rows[1:]], WINDOW)
    assert diff > 2 * se, f"offline dpo: accuracy changed by {diff:+.3f} (standard error {se:.3f})"
