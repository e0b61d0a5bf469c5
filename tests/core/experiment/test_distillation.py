"""experiments/distillation.yaml: GRPO, on-policy distillation, GKD and SFT (on the answers and
on the teacher's samples) from one warm start under one sample budget. The shipped file's arms
differ only where they must; at a tiny size all five train to the same number of samples and
are reported together. The result at full size is docs/experiments.md's, from a recorded run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[3]


def test_the_arms_share_warm_start_budget_and_evaluation_and_sample_alike():
    spec = load_experiment(ROOT / "experiments" / "distillation.yaml").spec
    arms = spec.arms
    assert set(arms) == {"grpo", "opd", "sft", "sft_teacher", "gkd"}
    assert spec.baseline_arm == "grpo"
    assert spec.budget.samples is not None and len(spec.seeds) >= 3
    teacher = arms["opd"].model.teacher
    assert teacher is not None and teacher.embedded is not None
    assert teacher.embedded.sft_slip == 0.0 < arms["opd"].model.embedded.sft_slip
    assert all(arm.model.embedded == arms["grpo"].model.embedded for arm in arms.values())
    per_step = {name: arm.training.prompts_per_step * (arm.training.samples_per_prompt
                if name in ("grpo", "opd") else 1) for name, arm in arms.items()}  # fmt: skip
    assert len(set(per_step.values())) == 1, per_step  # as many samples a step, each arm


@pytest.mark.slow
def test_the_five_arms_train_to_the_same_samples_at_a_tiny_size(tmp_path, monkeypatch):
    spec = yaml.safe_load((ROOT / "experiments" / "distillation.yaml").read_text())
    tiny = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
    spec["seeds"], spec["budget"] = [0], {"samples": 16}
    spec["model"]["embedded"].update(tiny, sft_steps=30)
    spec["data"]["task"].update(train_size=64, eval_size=4)
    spec["training"].update(prompts_per_step=2, samples_per_prompt=4)
    for arm in ("sft", "sft_teacher", "gkd"):
        spec["arms"][arm]["training"]["prompts_per_step"] = 8
    spec["evaluation"]["every"] = 1
    path = tmp_path / "distillation.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    result = run_experiment(load_experiment(path), out_dir=tmp_path / "out")
    assert not result.failed, [r.error for r in result.runs]
    for arm, key in (("grpo", "grpo/"), ("opd", "opd/reverse_kl"), ("sft", "sft/nll"),
                     ("sft_teacher", "timing/teacher_generate"), ("gkd", "gkd/jsd")):  # fmt: skip
        rows = [
            json.loads(line)
            for line in (tmp_path / "out" / arm / "seed-0" / "metrics.jsonl").open()
        ]
        assert [r["samples"] for r in rows] == [8, 16], arm  # the same samples, every arm
        assert all(any(k.startswith(key) for k in r) for r in rows), arm
    report = (tmp_path / "out" / "report.md").read_text()
    assert all(f"| {arm}" in report for arm in ("opd", "sft", "sft_teacher", "gkd"))
