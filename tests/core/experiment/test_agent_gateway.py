"""experiments/agent_gateway.yaml end to end at a tiny size: the example agent, unchanged, trains
through the gateway as a program per episode (command:), in-process (function:) and from
asynchronous producers, in worker processes (--jobs 2), and the report compares the arms. Nothing here depends on how far a
few steps move the policy: the experiment's result at full size is the README's, from a run
recorded in docs/results/agent-gateway.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[3]
AGENT = "examples/agents/calculator_agent.py"


def test_the_shipped_experiment_differs_between_arms_only_in_the_broken_calculator():
    loaded = load_experiment(ROOT / "experiments" / "agent_gateway.yaml")
    spec = loaded.spec
    tool, broken = spec.arms["tool"], spec.arms["broken_tool"]
    assert spec.baseline_arm == "broken_tool" and len(spec.seeds) >= 3
    params = {arm: loaded.components[arm]["environment"].params for arm in spec.arms}
    assert params["tool"].function == f"{AGENT}:episode"
    assert params["broken_tool"].function == f"{AGENT}:broken_episode"
    assert params["tool"].model_dump(exclude={"function"}) == params["broken_tool"].model_dump(
        exclude={"function"}
    )
    same = ("algorithm", "labeler", "backend", "training", "model", "episodes")
    assert all(getattr(tool, k) == getattr(broken, k) for k in same)


def test_the_example_agent_runs_as_a_program_against_a_real_api_shape(tmp_path):
    """The agent's own tool: its calculator reads what the embedded one reads."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("calculator_agent", ROOT / AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.calculate("47*86") == "4042" and module.calculate("(2+3)*-4") == "-20"
    assert module.calculate("__import__('os')").startswith("error:")


@pytest.mark.slow
def test_the_agent_trains_as_a_program_in_process_and_from_async_producers(tmp_path, monkeypatch):
    spec = yaml.safe_load((ROOT / "experiments" / "agent_gateway.yaml").read_text())
    spec["seeds"], spec["budget"] = [0], {"steps": 2}
    spec["model"]["embedded"].update(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_steps=60,
        sft_tool_share=0.5,
    )  # fmt: skip
    spec["data"]["task"].update(train_size=64, eval_size=4)
    spec["training"].update(prompts_per_step=2, samples_per_prompt=2)
    spec["evaluation"].update(every=2)
    program = {"name": "agent", "params": {"command": ["python", str(ROOT / AGENT)]}}
    spec["arms"]["program"] = {**spec["arms"]["tool"], "environment": program}
    spec["arms"]["producers"] = {
        **spec["arms"]["tool"],
        "training": {"async": {"max_staleness": 1, "producers": 1, "producer_threads": 1}},
    }
    path = tmp_path / "agent_gateway.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(ROOT)  # the shipped experiment names the agent relative to the checkout
    # --jobs 2: each run in a worker process of its own, its gateway and agents with it
    result = run_experiment(load_experiment(path), out_dir=tmp_path / "out", jobs=2)
    assert not result.failed, [r.error for r in result.runs]
    for arm in ("tool", "broken_tool", "program", "producers"):
        folder = tmp_path / "out" / arm / "seed-0"
        steps = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
        evals = [json.loads(line) for line in (folder / "eval.jsonl").open()]
        assert [s["step"] for s in steps] == [1, 2], arm
        for s in steps:  # every agent called the gateway, and none failed (a long answer to
            # a bad call may spend an episode's 32 tokens: truncated, which is no failure)
            assert s["env/agent/calls"] >= 1, (arm, s)
            assert s["env/done_frac"] + s["env/truncated_frac"] == 1.0, (arm, s)
            assert s["env/kept_frac"] == 1.0
        assert all("eval/env/agent/calls" in e and "eval/exact_match" in e for e in evals)
        samples = [json.loads(line) for line in (folder / "samples.jsonl").open()]
        assert samples and all("messages" in json.dumps(s) for s in samples)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "broken_tool" in report and "eval/exact_match" in report
