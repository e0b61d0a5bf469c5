"""Distillation and imitation arms resume exactly: a GKD arm whose steps mix the policy's
samples and the demonstrations (lambda 0.5, drawn from the row seeds) with packed forward
passes, and an OPD arm with its embedded teacher, stopped after a checkpoint and resumed,
write the uninterrupted run's metrics and evaluations."""

from __future__ import annotations

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

VOLATILE = ("time_s", "timing/", "throughput/", "labeler/")
TEACHER = {"embedded": {"sft_steps": 40, "sft_slip": 0.0}}


def _stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arm", "algorithm", "training"),
    [
        ("gkd", {"name": "gkd", "params": {"lmbda": 0.5, "beta": 0.5}}, {"packing": True}),
        ("opd", "opd", {"checkpoint_every": 3}),
    ],
)
def test_a_distillation_arm_stopped_after_a_checkpoint_resumes_exactly(
    write_experiment, tmp_path, arm, algorithm, training
) -> None:
    spec = tiny_experiment(
        budget={"steps": 5},
        model={"teacher": TEACHER},
        training=training,
        evaluation={"every": 2},
        arms={arm: {"algorithm": algorithm, "labeler": "arithmetic"}},
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, arm, 0, out).status == "finished"
    rows = read_jsonl(out / "metrics.jsonl")
    if arm == "gkd":  # premise: the run mixes both kinds of step, before and after the stop
        drawn = [r["batch/on_policy"] for r in rows]
        assert 0.0 in drawn[2:] and 1.0 in drawn[2:], drawn
    reference, evaluations = _stable(rows), _stable(read_jsonl(out / "eval.jsonl"))

    stop = 2 if arm == "gkd" else 3
    back_to_checkpoint(out, stop)
    assert run_one(loaded, arm, 0, out, resume=True).status == "finished"
    assert _stable(read_jsonl(out / "metrics.jsonl")) == reference
    assert _stable(read_jsonl(out / "eval.jsonl")) == evaluations
