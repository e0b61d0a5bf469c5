"""Metrics that arms are compared on are computed by the engine, one way for every arm.

Premises built in: at step 1 every arm's behaviour snapshot *is* the starting weights, which
are also the reference, so ``kl/ref`` is exactly 0 there; and every online arm of a seed samples
the same responses to the same prompts at step 1 (same weights, same RNG state), so the
engine's ``entropy`` of step 1 is the same number in every online arm, whatever the algorithm.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from alignzoo import metrics as canonical
from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

from .conftest import read_jsonl, tiny_experiment

ENGINE = Path(__file__).resolve().parents[3] / "core" / "engine"
# Rewards that vary within groups from step 1 (the tiny warm start is rarely right), so every
# arm moves away from its reference (named for grpo too: the base experiment's grpo arm says
# arithmetic).
ODD = {"name": "regex", "params": {"pattern": "[13579]"}}
ARMS = {
    "grpo": {"algorithm": "grpo", "labeler": ODD},
    "ppo": {"algorithm": "ppo"},
    "dpo_online": {"algorithm": "dpo"},
    "kto_online": {"algorithm": "kto"},
    "simpo_online": {"algorithm": "simpo"},
    "dpo_offline": {"algorithm": "dpo", "online": False},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, engine_cache: Path) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("canonical")
    spec = tiny_experiment(
        name="canonical",
        budget={"steps": 3},
        training={"lr": 1e-3, "checkpoint_every": 3},
        evaluation={"every": 3, "num_prompts": 4},
        defaults={"labeler": ODD},
        arms=ARMS,
    )
    path = root / "exp.yaml"
    import yaml

    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    loaded = load_experiment(path)
    out = {}
    for arm in ARMS:
        summary = run_one(loaded, arm, 0, root / arm)
        assert summary.status == "finished", summary.error
        out[arm] = read_jsonl(root / arm / "metrics.jsonl")
    return out


def test_kl_to_the_reference_is_the_engines_in_every_arm_that_has_a_reference(runs) -> None:
    for arm in ("grpo", "ppo", "dpo_online", "kto_online", "dpo_offline"):
        rows = runs[arm]
        assert all(canonical.KL_REF in row for row in rows), arm
        assert rows[0][canonical.KL_REF] == 0.0, (arm, "premise: step 1 is the reference itself")
        assert rows[-1][canonical.KL_REF] > 0.0, (arm, "the policy has left the reference")
    assert all(canonical.KL_REF not in row for row in runs["simpo_online"])  # no reference
    for rows in runs.values():  # the old per-algorithm "kl" is gone; their own values are named
        assert all("kl" not in row for row in rows)
    assert "grpo/kl_k3" in runs["grpo"][0] and "ppo/kl_penalty" in runs["ppo"][0]


def test_entropy_of_step_one_is_the_same_number_in_every_online_arm(runs) -> None:
    online = [arm for arm in ARMS if arm != "dpo_offline"]
    first = {arm: runs[arm][0] for arm in online}
    responses = {arm: row["response_length/mean"] for arm, row in first.items()}
    assert len(set(responses.values())) == 1, ("premise: the same samples at step 1", responses)
    entropies = {arm: row[canonical.ENTROPY] for arm, row in first.items()}
    assert len(set(entropies.values())) == 1, entropies
    assert canonical.ENTROPY in runs["dpo_offline"][0]  # offline arms report it too


def test_the_engine_never_asks_the_embedded_task_what_is_correct() -> None:
    """Correctness (exact match, online KTO's desirability) comes from the labeler's
    ``Score.info["correct"]``; only data loading may build the embedded task's rows."""
    for module in ENGINE.rglob("*.py"):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "alignzoo.world.task":
                assert module.name == "datasets.py", module
                assert {a.name for a in node.names} <= {"make_examples", "wrong_answer"}, module
