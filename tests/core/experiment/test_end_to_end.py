"""The runner with the real engine: an A/A pair is "no detectable difference"; lr 0 is worse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.experiment.runner import run_experiment

# A tiny policy trained on four fixed prompts (and evaluated on them): GRPO reliably lifts
# greedy exact match from 0.75 to 1.0 within 40 steps on every seed, so a learning rate of 0
# must come out worse. Four seeds per arm let the exact permutation test reach p < 0.05.
PROMPTS = [("8+7=", "15"), ("9+6=", "15"), ("7+9=", "16"), ("8+5=", "13")]
SPEC = {
    "name": "aa",
    "seeds": [0, 1, 2, 3],
    "baseline": "grpo",
    "budget": {"steps": 40},
    "model": {
        "embedded": {
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "intermediate_size": 64,
            "sft_steps": 500,
            "sft_batch_size": 64,
        }
    },
    "data": {"task": {"digits": 1, "operations": ["+"], "train_size": 80, "eval_size": 20}},
    "training": {
        "lr": 1.0e-3,
        "warmup_steps": 3,
        "prompts_per_step": 16,
        "samples_per_prompt": 4,
        "micro_batch_size": 64,
        "checkpoint_every": 40,
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
    },
    "evaluation": {"every": 20},
    "logging": {"sinks": ["jsonl"]},
    "arms": {
        "grpo": {"algorithm": "grpo"},
        "grpo_again": {"algorithm": "grpo"},
        "lr0": {"algorithm": "grpo", "training": {"lr": 0.0}},
    },
}


def write_spec(root: Path) -> Path:
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PROMPTS * 20))
    spec = {**SPEC, "data": {**SPEC["data"], "train": str(data), "eval": str(data)}}
    path = root / "aa.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def verdicts(md: str) -> dict[str, str]:
    part = md[md.index("## Against the baseline") : md.index("## Health warnings")]
    out = {}
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] not in ("arm", "---"):
            out[cells[0]] = cells[6]
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("e2e")
    path = write_spec(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALIGNZOO_CACHE", str(root / "cache"))
        result = run_experiment(load_experiment(path), out_dir=root / "out")
    assert not result.failed, [r.error for r in result.runs]
    return (root / "out" / "report.md").read_text()


@pytest.mark.slow
def test_aa_pair_is_no_detectable_difference(report: str) -> None:
    assert verdicts(report)["grpo_again"] == "no detectable difference"


@pytest.mark.slow
def test_learning_rate_zero_is_worse(report: str) -> None:
    assert verdicts(report)["lr0"] == "worse"


def test_spec_is_valid(tmp_path: Path) -> None:
    assert list(load_experiment(write_spec(tmp_path)).spec.arms) == ["grpo", "grpo_again", "lr0"]
