"""alignzoo train-rm: a Bradley-Terry reward model on the embedded model that ranks held-out
pairs far above chance, saved so that the reward_model labeler loads it and scores the same
input the same way; synthetic near-miss negatives; the metrics written beside it; probes beyond pairwise accuracy
(top-1 over candidate sets, out-of-distribution scores, a too-small held-out set); --base
embedded refused without the experiment."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignzoo.config.schema import TaskConfig
from alignzoo.human.reward_model import (
    METRICS_FILE,
    Pair,
    calibration,
    candidates,
    heldout_warning,
    split_by_prompt,
    wilson,
    with_negatives,
)
from alignzoo.plugins.labelers.reward_model import RewardModelLabeler
from alignzoo.types import LabelRequest
from alignzoo.world.task import make_examples, near_miss, wrong_answer

from ..engine.conftest import TINY_TASK

pytestmark = pytest.mark.slow


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


def _shortcut_pairs(path: Path) -> None:
    """A shortcut-prone set: every rejected answer is the right one minus 10 (negative below
    10), so "no minus sign" or "the larger number" ranks every pair without any arithmetic."""
    examples = make_examples(TaskConfig(**{**TINY_TASK, "train_size": 60}), "train")
    rows = [
        {"prompt": e["prompt"], "chosen": e["answer"], "rejected": str(int(e["answer"]) - 10)}
        for e in examples
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_the_top1_probe_catches_a_shortcut_that_pairwise_accuracy_misses(base, tmp_path) -> None:
    _shortcut_pairs(tmp_path / "prefs.jsonl")
    cli = [sys.executable, "-m", "alignzoo", "train-rm", str(tmp_path / "prefs.jsonl")]
    args = ["--base", base, "--out", str(tmp_path / "rm"), "--epochs", "3", "--lr", "3e-3"]
    done = subprocess.run(
        [*cli, *args, "--perturbations", "arithmetic"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "rm" / METRICS_FILE).read_text())
    probes = metrics["probes"]
    # The pairs are ranked all but perfectly ...
    assert metrics["heldout_accuracy"] >= 0.9, metrics
    assert metrics["synthetic_negatives"] == 0  # the perturbations only probe
    # ... but the right answer does not stand out among its near misses (chance is ~1/4).
    assert probes["top1_sets"] == metrics["heldout_pairs"] and probes["top1_candidates"] > 2
    assert probes["top1_accuracy"] <= 0.5, probes
    assert set(probes["ood"]) == {"empty", "constant", "long"}
    for row in probes["ood"].values():
        assert 0 <= row["share_above_chosen"] <= 1
    # 12 held-out pairs are too few: the interval and the warning are in the JSON and printed.
    lo, hi = metrics["heldout_interval"]
    assert 0 <= lo <= metrics["heldout_accuracy"] <= hi <= 1 and hi - lo > 0.2
    assert metrics["warnings"] and "too small" in metrics["warnings"][0]
    out = " ".join(done.stdout.split())
    assert "top-1 accuracy" in out and "95% interval" in out and "too small" in out
    assert "out-of-distribution 'empty'" in out


def test_base_embedded_is_refused_when_the_data_does_not_say_which_experiment(tmp_path) -> None:
    _pairs(tmp_path / "prefs.jsonl")
    cli = [sys.executable, "-m", "alignzoo", "train-rm", str(tmp_path / "prefs.jsonl")]
    done = subprocess.run(
        [*cli, "--base", "embedded", "--out", str(tmp_path / "rm")], capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr[-3000:]
    err = " ".join(done.stderr.split())
    assert "--base embedded" in err and "--base experiments/NAME.yaml" in err
    assert not (tmp_path / "rm").exists()


def test_the_wilson_interval_and_the_small_heldout_warning() -> None:
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)
    assert wilson(10, 10)[1] == 1.0
    warning = heldout_warning(0.8, 10)
    assert warning is not None and "[0.490, 0.943]" in warning
    assert heldout_warning(0.95, 400) is None  # interval about 0.04 wide
    assert heldout_warning(0.5, 100) is None  # [0.404, 0.596]: 0.19 wide
    assert heldout_warning(0.5, 60) is not None  # 60 pairs but 0.25 wide
    assert heldout_warning(float("nan"), 0) is not None


def test_candidate_sets_chain_the_perturbation() -> None:
    sets = candidates("12+7=", "19", near_miss, k=4)
    assert sets[0] == "19" and len(sets) == len(set(sets)) and 2 <= len(sets) <= 5
    assert sets[1] == near_miss("12+7=", "19")
    assert candidates("12+7=", "no idea", near_miss) == ["no idea"]


def test_shifted_answers_leave_no_bigger_is_better_shortcut() -> None:
    from alignzoo.world.task import NEGATIVES, SHIFTS, shifted_answers

    made = shifted_answers("12+7=", "it is 19.")
    assert "it is 18." in made and "it is 119." in made and "it is 9." in made
    values = [int(m.split()[-1].rstrip(".")) for m in made]
    assert min(values) >= 0 and 19 not in values  # never negative, never the answer
    assert any(v > 19 for v in values) and any(v < 19 for v in values)  # both directions
    assert len(shifted_answers("1+1=", "150")) == len(SHIFTS)
    assert shifted_answers("1+1=", "no idea") == []
    assert set(NEGATIVES) == {"arithmetic", "arithmetic-shifts"}
    # several perturbations: each is a negative, and all of them form the top-1 candidate set
    pairs, added = with_negatives([Pair("12+7=", "19", "9")], shifted_answers)
    assert added == len(shifted_answers("12+7=", "19")) - 1  # "9" was the rejected one already
    assert len({p.rejected for p in pairs}) == len(pairs)
    assert candidates("12+7=", "19", shifted_answers) == ["19", *shifted_answers("12+7=", "19")]


def test_max_negatives_draws_a_seeded_subset_of_each_pairs_perturbations() -> None:
    from alignzoo.world.task import shifted_answers

    pairs = [Pair("12+7=", "19", "9"), Pair("3+4=", "7", "8")]
    capped, added = with_negatives(pairs, shifted_answers, max_per_pair=3, seed=1)
    assert added == 6 and len(capped) == 8
    again, _ = with_negatives(pairs, shifted_answers, max_per_pair=3, seed=1)
    assert again == capped  # the same draw for the same seed
    other, _ = with_negatives(pairs, shifted_answers, max_per_pair=3, seed=2)
    assert other != capped
    for pair in capped[2:]:
        assert pair.rejected in shifted_answers(pair.prompt, pair.chosen)
