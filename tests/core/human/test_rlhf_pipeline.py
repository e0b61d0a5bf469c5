"""The classic RLHF pipeline at a tiny size, through the commands a user runs: the warm
start's samples queued as pairs, judged by simulated annotators, the agreed pairs exported,
a reward model trained on them, and PPO against it compared with PPO against the rule, both
evaluated by the rule (evaluation.labeler); the report shows both arms and the reward model's
held-out accuracy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..engine.conftest import read_jsonl, tiny_experiment

pytestmark = pytest.mark.slow

ODD = {"name": "regex", "params": {"pattern": "[13579]"}}
ANNOTATORS = {
    "rule": ODD,
    "seed": 0,
    "tie_margin": 0.2,
    "annotators": [
        {"name": "careful", "noise": 0.05},
        {"name": "hurried", "noise": 0.3, "cannot_judge": 0.1},
        {"name": "generous", "noise": 0.15, "bias": 0.2},
    ],
}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "alignzoo", *args], cwd=cwd, capture_output=True, text=True
    )
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done


def test_the_pipeline_runs_end_to_end(tmp_path: Path, engine_cache: Path) -> None:
    spec = tiny_experiment(
        name="rlhf",
        budget={"steps": 3},
        training={"prompts_per_step": 4, "samples_per_prompt": 4, "checkpoint_every": 3},
        evaluation={"every": 3, "num_prompts": 8, "labeler": ODD, "metric": "score"},
        arms={
            "ppo_rule": {"algorithm": "ppo", "labeler": ODD},
            "ppo_rm": {
                "algorithm": "ppo",
                "labeler": {"name": "reward_model", "params": {"path": "rm"}},
            },
        },
        baseline="ppo_rule",
    )
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    (tmp_path / "annotators.yaml").write_text(yaml.safe_dump(ANNOTATORS), encoding="utf-8")

    pooled = _cli(
        "annotate", "pool", "exp.yaml", "queue", "--prompts", "40", "--raters", "3", cwd=tmp_path
    )
    assert "pair items queued in queue" in pooled.stdout
    judged = _cli("annotate", "simulate", "queue", "annotators.yaml", cwd=tmp_path)
    assert "simulated annotators" in judged.stdout
    status = json.loads(_cli("annotate", "status", "queue", cwd=tmp_path).stdout)
    assert set(status["annotators"]) == set()  # simulated annotators need no sign-in
    assert status["queue"]["complete"] == status["queue"]["items"] > 0
    _cli("annotate", "export", "queue", "prefs", cwd=tmp_path)
    exported = json.loads((tmp_path / "prefs" / "alignzoo_export.json").read_text())
    assert exported["rows"] >= 4, f"premise: enough agreed, non-tied pairs ({exported})"
    assert exported["agreement"]["pairs"]["annotator_pairs"] > 0
    # The pool recorded which experiment and arm sampled the pairs; the export carries it, so
    # --base embedded is that experiment's warm start (not the default embedded settings).
    assert Path(exported["experiment"]) == (tmp_path / "exp.yaml").resolve()
    assert exported["arm"] == next(iter(spec["arms"]))  # annotate pool's default: the first
    trained_rm = _cli(
        "train-rm",
        "prefs",
        "--base",
        "embedded",
        "--out",
        "rm",
        "--epochs",
        "3",
        "--lr",
        "3e-3",
        cwd=tmp_path,
    )
    assert f"exp.yaml (arm {exported['arm']})" in " ".join(trained_rm.stdout.split())
    trained = json.loads((tmp_path / "rm" / "train_rm.json").read_text())

    _cli("run", "exp.yaml", "--out", "ab", cwd=tmp_path)
    report = (tmp_path / "ab" / "report.md").read_text(encoding="utf-8")
    assert "ppo_rule" in report and "ppo_rm" in report
    assert "## Reward models" in report
    low, high = trained["heldout_interval"]
    assert f"{trained['heldout_accuracy']:.3f} [{low:.3f}, {high:.3f}]" in report
    for arm in ("ppo_rule", "ppo_rm"):
        evals = read_jsonl(tmp_path / "ab" / arm / "seed-0" / "eval.jsonl")
        assert evals and all("eval/score" in e for e in evals), arm
    # The reward model trains the ppo_rm arm (its scores are logits, not the rule's 0 and 1),
    # while evaluation scores both arms with the rule.
    scores = {
        row["score"] for row in read_jsonl(tmp_path / "ab" / "ppo_rm" / "seed-0" / "samples.jsonl")
    }
    assert not scores <= {0.0, 1.0}
    assert {e["eval/score"] for e in evals} <= {x / 8 for x in range(9)}
