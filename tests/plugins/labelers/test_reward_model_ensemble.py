"""Reward-model ensembles: the members' scores aggregated by mean, mean - lambda * std and min
(Coste et al. 2024), the members' disagreement in Score.info and stats(); `train-rm --ensemble
2` trains two members (seeds, bootstraps) that the reward_model labeler loads as one."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from typing import Any

import pytest
import torch

from alignzoo.config.schema import DataConfig, ModelConfig, TaskConfig
from alignzoo.engine.policy import policy_path
from alignzoo.human.reward_model import ENSEMBLE_FILE, METRICS_FILE, aggregate, member_std
from alignzoo.plugins.labelers.reward_model import RewardModelLabeler
from alignzoo.types import LabelRequest
from alignzoo.world.task import make_examples

from ...core.engine.conftest import TINY_MODEL, TINY_TASK, engine_cache  # noqa: F401


def test_aggregate_mean_mean_minus_std_and_min() -> None:
    scores = [1.0, 2.0, 6.0]
    std = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 3)
    assert member_std(scores) == pytest.approx(std)
    assert aggregate(scores) == pytest.approx(3.0)
    assert aggregate(scores, "mean") == pytest.approx(3.0)
    assert aggregate(scores, "mean_minus_std") == pytest.approx(3.0 - std)
    assert aggregate(scores, "mean_minus_std", std_coef=0.5) == pytest.approx(3.0 - 0.5 * std)
    assert aggregate(scores, "mean_minus_std", std_coef=0.0) == pytest.approx(3.0)
    assert aggregate(scores, "min") == 1.0
    assert aggregate([4.0], "mean_minus_std") == 4.0  # one member: no disagreement
    with pytest.raises(ValueError):
        aggregate([], "mean")
    with pytest.raises(ValueError):
        aggregate([1.0], "median")  # type: ignore[arg-type]


class _Stub(torch.nn.Module):
    """A member whose score is a fixed offset plus the number of tokens."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.offset = torch.nn.Parameter(torch.tensor(offset))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        score = attention_mask.sum(dim=1, keepdim=True).float() + self.offset
        return type("Out", (), {"logits": score})()


class _Tokenizer:
    def __call__(self, texts: list[str], **_: Any) -> Any:
        width = max(len(t) for t in texts)
        ids = torch.zeros(len(texts), width, dtype=torch.long)
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])

        class Batch(dict):
            def to(self, _device: str) -> Batch:
                return self

        return Batch(input_ids=ids, attention_mask=mask)


def _stub_ensemble(offsets: list[float], **params: Any) -> RewardModelLabeler:
    labeler = RewardModelLabeler({"path": "unused", **params})
    labeler.members = [(_Tokenizer(), _Stub(o)) for o in offsets]
    labeler.tokenizer, labeler.model = labeler.members[0]
    labeler.is_ensemble = True
    labeler._freeze()
    return labeler


@pytest.mark.parametrize(
    ("how", "expected"),
    [("mean", 1.0), ("mean_minus_std", 1.0 - 2 * math.sqrt(14 / 3)), ("min", -1.0)],
)
def test_the_labeler_aggregates_its_members_and_logs_their_disagreement(how, expected) -> None:
    labeler = _stub_ensemble([-1.0, 0.0, 4.0], aggregate=how, std_coef=2.0)
    # Offsets -1, 0, 4 (mean 1, std sqrt(14/3)): "ab" + "c" is 3 tokens, the members score 2, 3
    # and 7; "a" + "" scores 0, 1 and 5. `expected` is the aggregate of the offsets.
    scores = labeler.score_batch(
        [LabelRequest(prompt="ab", response="c"), LabelRequest(prompt="a", response="")]
    )
    std = math.sqrt(14 / 3)
    assert scores[0].value == pytest.approx(expected + 3.0)
    assert scores[1].value == pytest.approx(expected + 1.0)
    assert scores[0].info["rm_members"] == pytest.approx([2.0, 3.0, 7.0])
    assert scores[0].info["rm_mean"] == pytest.approx(4.0)
    assert scores[0].info["rm_std"] == pytest.approx(std)
    assert scores[0].info["raw"] == pytest.approx(scores[0].value)
    assert labeler.stats() == {"rm_std": pytest.approx(std), "rm_members": 3.0}


def test_a_single_model_keeps_its_plain_scores_and_no_stats() -> None:
    labeler = _stub_ensemble([0.5], aggregate="min")
    labeler.is_ensemble = False
    (score,) = labeler.score_batch([LabelRequest(prompt="ab", response="c")])
    assert score.value == pytest.approx(3.5) and score.info == {"raw": pytest.approx(3.5)}
    assert labeler.stats() == {}


@pytest.mark.slow
def test_train_rm_ensemble_of_two_trains_and_loads_end_to_end(engine_cache, tmp_path) -> None:  # noqa: F811
    base = policy_path(
        ModelConfig(embedded=TINY_MODEL), DataConfig(task=TaskConfig(**TINY_TASK)), lambda _: None
    )
    rng = random.Random(0)
    examples = make_examples(TaskConfig(**{**TINY_TASK, "train_size": 40}), "train")
    rows = [
        {
            "prompt": e["prompt"],
            "chosen": str(2 * rng.randrange(50) + 1),
            "rejected": str(2 * rng.randrange(50)),
        }
        for e in examples
    ]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    cli = [sys.executable, "-m", "alignzoo", "train-rm", str(tmp_path / "prefs.jsonl")]
    args = ["--base", base, "--out", str(out), "--epochs", "2", "--lr", "3e-3", "--ensemble", "2"]
    done = subprocess.run(cli + args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / ENSEMBLE_FILE).read_text())
    assert manifest["members"] == ["member-0", "member-1"] and manifest["seeds"] == [0, 1]
    metrics = [json.loads((out / m / METRICS_FILE).read_text()) for m in manifest["members"]]
    assert [m["seed"] for m in metrics] == [0, 1] and all(m["bootstrap"] for m in metrics)
    assert metrics[0]["heldout_pairs"] == metrics[1]["heldout_pairs"]  # the same held-out set
    assert "ensemble of 2" in " ".join(done.stdout.split())

    requests = [
        LabelRequest(prompt="3+4=", response="7"),
        LabelRequest(prompt="3+4=", response="8"),
    ]
    members = []
    for m in manifest["members"]:
        one = RewardModelLabeler({"path": str(out / m)})
        one.load("cpu")
        assert not one.is_ensemble and one.stats() == {}
        members.append([s.value for s in one.score_batch(requests)])
    for how in ("mean", "mean_minus_std", "min"):
        labeler = RewardModelLabeler({"path": str(out), "aggregate": how})
        labeler.load("cpu")
        assert labeler.is_ensemble and len(labeler.members) == 2
        scores = labeler.score_batch(requests)
        for i, score in enumerate(scores):
            column = [members[0][i], members[1][i]]
            assert score.value == pytest.approx(aggregate(column, how), abs=1e-5)
            assert score.info["rm_std"] == pytest.approx(member_std(column), abs=1e-5)
        stats = labeler.stats()
        assert stats["rm_members"] == 2.0
        assert stats["rm_std"] == pytest.approx(sum(s.info["rm_std"] for s in scores) / len(scores))
    # The run records the ensemble it scored with.
    labeler._record(tmp_path)
    recorded = json.loads((tmp_path / "reward_model.json").read_text())
    assert recorded["ensemble"]["members"] == ["member-0", "member-1"]
    assert recorded["ensemble"]["aggregate"] == "min"
