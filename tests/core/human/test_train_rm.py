"""alignzoo train-rm: a Bradley-Terry reward model on the embedded model that ranks held-out
pairs far above chance, saved so that the reward_model labeler loads it and scores the same
input the same way; synthetic near-miss negatives; the metrics written beside it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignzoo.config.schema import ModelConfig, TaskConfig
from alignzoo.engine.models import policy_path
from alignzoo.human.reward_model import (
    METRICS_FILE,
    Pair,
    calibration,
    split_by_prompt,
    with_negatives,
)
from alignzoo.plugins.labelers.reward_model import RewardModelLabeler
from alignzoo.types import LabelRequest
from alignzoo.world.task import make_examples, near_miss, wrong_answer

from ..engine.conftest import TINY_MODEL, TINY_TASK

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(engine_cache: Path) -> str:
    return policy_path(ModelConfig(embedded=TINY_MODEL), TaskConfig(**TINY_TASK), lambda _: None)


def _pairs(path: Path) -> None:
    """A preference set with a rule behind it: an odd number is preferred to an even one."""
    rng = random.Random(0)
    examples = make_examples(TaskConfig(**{**TINY_TASK, "train_size": 60}), "train")
    rows = [
        {
            "prompt": e["prompt"],
            "chosen": str(2 * rng.randrange(50) + 1),
            "rejected": str(2 * rng.randrange(50)),
        }
        for e in examples
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_train_rm_ranks_held_out_pairs_and_the_labeler_loads_it(base, tmp_path) -> None:
    _pairs(tmp_path / "prefs.jsonl")
    cli = [sys.executable, "-m", "alignzoo", "train-rm", str(tmp_path / "prefs.jsonl")]
    args = ["--base", base, "--out", str(tmp_path / "rm"), "--epochs", "4", "--lr", "3e-3"]
    done = subprocess.run(cli + args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "rm" / METRICS_FILE).read_text())
    assert metrics["heldout_pairs"] >= 8 and metrics["synthetic_negatives"] == 0
    # Chance is 0.5; the rule (the last digit's parity) is learnable from 48 training prompts.
    assert metrics["heldout_accuracy"] >= 0.75, metrics
    assert 0 <= metrics["heldout_ece"] <= 1 and 0 <= metrics["heldout_brier"] <= 1
    assert "held-out accuracy" in done.stdout

    labeler = RewardModelLabeler({"path": str(tmp_path / "rm")})
    labeler.load("cpu")
    requests = [
        LabelRequest(prompt="3+4=", response="7"),
        LabelRequest(prompt="3+4=", response="8"),
    ]
    first = [s.value for s in labeler.score_batch(requests)]
    again = [s.value for s in labeler.score_batch(list(reversed(requests)))][::-1]
    assert first == pytest.approx(again, abs=1e-5)  # the same input, the same score

    refused = subprocess.run([*cli, *args], capture_output=True, text=True)
    assert refused.returncode == 2 and "exists; choose a new folder" in refused.stderr


def test_held_out_prompts_are_never_trained_on() -> None:
    pairs = [Pair(f"{i}+{j}=", "a", "b") for i in range(5) for j in range(2)]
    train, held = split_by_prompt(pairs, 0.3, seed=1)
    assert held and train and not {p.prompt for p in train} & {p.prompt for p in held}
    assert len(train) + len(held) == len(pairs)


def test_calibration_of_a_confident_right_and_a_hesitant_model() -> None:
    ece, brier = calibration(torch.tensor([0.0, 0.0]))  # P = 0.5 for both orders: calibrated
    assert ece == pytest.approx(0.0) and brier == pytest.approx(0.25)
    ece, brier = calibration(torch.tensor([20.0, 20.0]))  # certain and right
    assert ece == pytest.approx(0.0, abs=1e-6) and brier == pytest.approx(0.0, abs=1e-6)
    ece, _ = calibration(torch.tensor([-20.0]))  # certain and wrong
    assert ece == pytest.approx(1.0, abs=1e-6)


def test_synthetic_negatives_pair_each_chosen_response_with_a_near_miss() -> None:
    pairs = [Pair("12+7=", "19", "5"), Pair("1+1=", "2", "3"), Pair("2+2=", "four", "5")]
    out, added = with_negatives(pairs, near_miss)
    assert added == 2 and out[:3] == pairs  # "four" has no number to perturb
    assert [(p.chosen, p.rejected) for p in out[3:]] == [
        ("19", wrong_answer("12+7=", "19")),
        ("2", wrong_answer("1+1=", "2")),
    ]
    assert with_negatives(pairs, None) == (pairs, 0)


def test_a_near_miss_changes_only_the_last_number() -> None:
    assert near_miss("12+7=", "19") == wrong_answer("12+7=", "19") != "19"
    assert near_miss("12+7=", "it is 19.") == f"it is {wrong_answer('12+7=', '19')}."
    assert near_miss("12+7=", "no idea") is None
