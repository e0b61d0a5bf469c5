"""A run from experiments/smoke.yaml (on the tiny world): the run folder the report reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.provenance import file_sha256, read_sessions

from .conftest import TINY_MODEL, TINY_TASK, read_jsonl

ROOT = Path(__file__).resolve().parents[3]
STABLE = ("reward/mean", "reward/std", "response_length/mean", "entropy", "actor/grad_norm", "loss")


def test_smoke_experiment_validates() -> None:
    loaded = load_experiment(ROOT / "experiments" / "smoke.yaml")
    assert loaded.spec.arms["grpo"].algorithm.name == "grpo"
    assert loaded.spec.budget.steps is not None


@pytest.mark.slow
def test_smoke_run_writes_the_run_folder(write_experiment, tmp_path) -> None:
    raw = yaml.safe_load((ROOT / "experiments" / "smoke.yaml").read_text())
    raw["model"]["embedded"] = dict(TINY_MODEL)
    raw["data"]["task"] = dict(TINY_TASK)
    loaded = load_experiment(write_experiment(raw))
    steps = loaded.spec.budget.steps
    out = tmp_path / "runs" / "smoke" / "grpo" / "seed-0"
    summary = run_one(loaded, "grpo", 0, out)

    assert summary.status == "finished", summary.error
    assert summary.steps == steps and summary.wall_clock_s > 0 and summary.peak_memory_mb > 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["seed"] == 0 and config["arm"] == "grpo"
    assert config["arm_spec"]["algorithm"]["name"] == "grpo" and "budget" in config

    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    per_step = loaded.spec.training.prompts_per_step * loaded.spec.training.samples_per_prompt
    assert [m["samples"] for m in metrics] == [per_step * s for s in range(1, steps + 1)]
    for m in metrics:
        for key in (
            *STABLE,
            "timing/generate",
            "timing/label",
            "timing/update",
            "time_s",
            "throughput/tokens_per_s",
            "actor/clipfrac",
        ):
            assert key in m and m[key] is not None, key
    evals = read_jsonl(out / "eval.jsonl")
    every = loaded.spec.evaluation.every
    assert [e["step"] for e in evals] == sorted({0, *range(every, steps + 1, every), steps})
    assert all(0.0 <= e["eval/exact_match"] <= 1.0 and "eval/score" in e for e in evals)
    samples = read_jsonl(out / "samples.jsonl")
    assert {s["step"] for s in samples} == set(range(1, steps + 1))
    assert all({"prompt", "response", "score"} <= set(s) for s in samples)

    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == steps and status["error"] is None
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert len(kept) == 2 and kept[-1] == f"step-{steps:06d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == kept[-1]

    (session,) = read_sessions(out)  # what produced the folder: code, libraries, machine
    assert session["threads"] >= 1 and session["torch"] and session["cpu"]
    assert session["experiment_sha256"] == file_sha256(Path(loaded.source))
    assert "embedded" in session["policy"] and len(session["policy_sha256"]) == 64


def test_resuming_a_finished_run_changes_nothing(write_experiment, tmp_path) -> None:
    loaded = load_experiment(write_experiment(budget={"steps": 3}))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    before = {n: (out / n).read_text() for n in ("metrics.jsonl", "eval.jsonl", "samples.jsonl")}
    summary = run_one(loaded, "grpo", 0, out, resume=True)
    assert summary.status == "finished" and summary.steps == 3
    assert {n: (out / n).read_text() for n in before} == before
    assert len(read_sessions(out)) == 2  # the resumed session is recorded beside the first


def test_sample_budget_stops_at_the_first_step_reaching_it(write_experiment, tmp_path) -> None:
    # 4 prompts x 4 samples = 16 per step: 40 samples need 3 steps.
    loaded = load_experiment(write_experiment(budget={"steps": None, "samples": 40}))
    summary = run_one(loaded, "grpo", 0, tmp_path / "run")
    assert summary.status == "finished" and summary.steps == 3 and summary.samples == 48


def test_a_bad_policy_path_fails_the_run_with_its_error(write_experiment, tmp_path) -> None:
    # Validation refuses a missing folder; one removed after validation fails the run.
    policy = tmp_path / "nowhere"
    policy.mkdir()
    loaded = load_experiment(write_experiment(model={"policy": str(policy)}))
    policy.rmdir()
    summary = run_one(loaded, "grpo", 0, tmp_path / "run")
    assert summary.status == "failed" and "nowhere" in summary.error
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and "model.policy" in status["error"]
    assert read_sessions(tmp_path / "run")  # a run that could not start still says where it ran
