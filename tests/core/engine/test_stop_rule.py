"""evaluation.stop_after_falls: a run ends once its metric has been worse than its best so far
for N evaluations in a row, says so in status.json and keeps a checkpoint there; and the
report compares arms at the final evaluation or at each run's best kept checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import fell_from_best, run_one

from .conftest import read_jsonl, tiny_experiment

# An evaluation labeler whose score falls by construction: every call scores all responses
# 1 / (number of calls so far), counted in a file beside it.
FALLING = """
from pathlib import Path

def falling(prompts, completions, **columns):
    counter = Path(__file__).with_suffix(".calls")
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    return [1.0 / calls] * len(completions)
"""


def _falling_run(tmp_path: Path, name: str, **overrides: Any) -> Any:
    """Run the tiny GRPO arm, evaluated every step by the falling labeler, into tmp/run."""
    (tmp_path / "falling.py").write_text(FALLING, encoding="utf-8")
    labeler = {"name": "python", "params": {"function": f"{tmp_path / 'falling.py'}:falling"}}
    evaluation = {"every": 1, "num_prompts": 4, "labeler": labeler, "metric": "score"}
    evaluation.update(overrides.pop("evaluation", {}))
    spec = tiny_experiment(name=name, evaluation=evaluation, **overrides)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return run_one(load_experiment(path), "grpo", 0, tmp_path / "run")


def test_fell_from_best_counts_the_evaluations_below_the_best_before_them() -> None:
    assert fell_from_best([0.5, 0.4, 0.3], 2, higher=True) is not None
    assert fell_from_best([0.5, 0.4], 2, higher=True) is None  # nothing before the two
    assert fell_from_best([0.5, 0.4, 0.6], 2, higher=True) is None  # a new best
    assert fell_from_best([0.5, 0.6, 0.4, 0.5], 2, higher=True) is not None  # best 0.6 earlier
    assert fell_from_best([0.5, 0.4, 0.5], 2, higher=True) is None  # equal to the best
    assert fell_from_best([1.0, 1.5, 2.0], 2, higher=False) is not None  # a loss that rises
    assert "for 2 evaluations in a row" in str(fell_from_best([3, 2, 1], 2, higher=True))


@pytest.mark.slow
def test_a_run_stops_once_its_metric_fell_twice_and_keeps_a_checkpoint_there(
    tmp_path: Path, engine_cache: Path
) -> None:
    summary = _falling_run(
        tmp_path,
        "stop",
        budget={"steps": 8},
        training={"checkpoint_every": 4},
        evaluation={"stop_after_falls": 2},
    )
    assert summary.status == "finished", summary.error
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
    scores = [e["eval/score"] for e in evals]
    assert scores[0] > scores[1] > scores[2], f"premise: the labeler's score falls ({scores})"
    # steps 0, 1, 2 evaluated; at step 2 the last two are below step 0's best: stop there
    assert [e["step"] for e in evals] == [0, 1, 2]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["step"] == 2 and summary.steps == 2
    assert status["stopped_early"].startswith("stopped early at step 2: eval/score")
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "state.json").is_file()
    # provenance names every component of the arm and what provided it
    session = json.loads((tmp_path / "run" / "provenance.json").read_text())["sessions"][-1]
    components = session["components"]
    assert components["algorithm"]["name"] == "grpo"
    assert components["algorithm"]["distribution"] == "alignzoo"
    assert {"labeler", "backend", "devices"} <= set(components)


def test_the_report_compares_at_the_best_kept_checkpoint_when_asked(tmp_path: Path) -> None:
    from alignzoo.report.sections import compared_value, kept_checkpoint_steps
    from alignzoo.runfolder.runfiles import read_run

    run_dir = tmp_path / "arm" / "seed-0"
    run_dir.mkdir(parents=True)
    rows = [(0, 0.2), (25, 0.7), (50, 0.9), (75, 0.4), (100, 0.3)]
    (run_dir / "eval.jsonl").write_text(
        "".join(json.dumps({"step": s, "eval/exact_match": v}) + "\n" for s, v in rows)
    )
    (run_dir / "status.json").write_text(json.dumps({"status": "finished", "step": 100}))
    for step in (25, 75, 100):  # step 50, the peak, has no checkpoint kept
        (run_dir / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step-{step:06d}" / "state.json").write_text("{}")
    (run_dir / "checkpoints" / "step-000050").mkdir()  # incomplete: no state.json
    run = read_run("arm", 0, run_dir)
    assert kept_checkpoint_steps(run) == {25, 75, 100}
    assert compared_value(run, "eval/exact_match", True) == 0.3  # final
    assert compared_value(run, "eval/exact_match", True, "best_checkpoint") == 0.7
    assert compared_value(run, "eval/exact_match", False, "best_checkpoint") == 0.3


@pytest.mark.slow
def test_pruning_keeps_the_best_evaluated_checkpoint_for_export_step_best(
    tmp_path: Path, engine_cache: Path
) -> None:
    from alignzoo.experiment.export import choose_checkpoint

    summary = _falling_run(tmp_path, "keep", budget={"steps": 5}, training={"checkpoint_every": 1})
    assert summary.status == "finished", summary.error
    scores = [e["eval/score"] for e in read_jsonl(tmp_path / "run" / "eval.jsonl")]
    assert scores == sorted(scores, reverse=True), f"premise: the score falls ({scores})"
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    # the last two, and step 1: the best evaluation that has a checkpoint (step 0 has none)
    assert kept == ["step-000001", "step-000004", "step-000005"]
    best = choose_checkpoint(tmp_path / "run", "best", "eval/score", True).folder
    assert best.name == "step-000001"
