"""experiments/tool_use.yaml end to end at a tiny size: both arms run multi-turn episodes with
the embedded calculator from one scripted warm start, the tool-call rate is measured in
training and in the held-out evaluation, and the report compares the arms. Nothing here
depends on how far a few steps move the policy: the experiment's result at full size is the
README's, from a run recorded there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[3]


def test_the_shipped_experiment_differs_between_arms_only_in_the_calculator():
    loaded = load_experiment(ROOT / "experiments" / "tool_use.yaml")
    spec = loaded.spec
    tool, no_tool = spec.arms["tool"], spec.arms["no_tool"]
    assert spec.baseline_arm == "no_tool" and len(spec.seeds) >= 3
    assert tool.model.embedded.sft_tool_share > 0
    assert spec.data.task.operations == ["*"]
    environments = {arm: loaded.components[arm]["environment"].params for arm in spec.arms}
    assert environments["tool"].enabled and not environments["no_tool"].enabled
    same = ("algorithm", "labeler", "backend", "training", "model", "episodes")
    assert all(getattr(tool, k) == getattr(no_tool, k) for k in same)


def tiny_tool_use(seeds: list[int], steps: int) -> dict:
    """experiments/tool_use.yaml with a tiny policy and data, ``seeds`` and a ``steps`` budget
    (checkpoints and evaluations every 2 steps)."""
    spec = yaml.safe_load((ROOT / "experiments" / "tool_use.yaml").read_text())
    spec["seeds"], spec["budget"] = seeds, {"steps": steps}
    spec["model"]["embedded"].update(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_steps=60,
        sft_tool_share=0.5,
    )  # fmt: skip
    spec["data"]["task"].update(train_size=64, eval_size=8)
    spec["training"].update(prompts_per_step=4, samples_per_prompt=2, checkpoint_every=2)
    spec["evaluation"].update(every=2)
    return spec


@pytest.mark.slow
def test_the_tool_use_experiment_runs_end_to_end_at_a_tiny_size(tmp_path, monkeypatch):
    spec = tiny_tool_use([0, 1], 2)
    path = tmp_path / "tool_use.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    result = run_experiment(load_experiment(path), out_dir=tmp_path / "out")
    assert not result.failed, [r.error for r in result.runs]
    for arm in ("tool", "no_tool"):
        for seed in (0, 1):
            folder = tmp_path / "out" / arm / f"seed-{seed}"
            steps = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
            evals = [json.loads(line) for line in (folder / "eval.jsonl").open()]
            assert [s["step"] for s in steps] == [1, 2]
            assert all("env/tool_calls" in s and "env/turns" in s for s in steps)
            assert [e["step"] for e in evals] == [0, 2]
            assert all("eval/env/tool_calls" in e and "eval/exact_match" in e for e in evals)
            samples = [json.loads(line) for line in (folder / "samples.jsonl").open()]
            assert samples and all("messages" in json.dumps(s) for s in samples)
    # One warm start serves both arms (the same cached policy).
    assert len(list((tmp_path / "cache" / "embedded").glob("*/config.json"))) == 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert "no_tool" in report and "tool" in report and "eval/exact_match" in report
