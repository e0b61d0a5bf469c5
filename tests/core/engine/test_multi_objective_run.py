"""A combine labeler's parts reach GRPO apart in a real tiny run: every batch GRPO computes
advantages for carries the parts' raw values, in the parts' order, as the labeler reported
them (through the look-ahead labeling, and in groups the replay modifier mixes back in), and
normalize_then_sum's advantages are GDPO's of those values, not the summed score's."""

from __future__ import annotations

import math

import pytest
import torch

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.plugins.algorithms.grpo import GRPO, group_advantages

from .conftest import read_jsonl, tiny_experiment

WEIGHTS = [1.0, 0.5]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_a_combines_parts_reach_grpo_apart(write_experiment, tmp_path, monkeypatch, overlap):
    seen: list[dict] = []
    original = GRPO._sequence_advantages

    def spy(self, batch):
        out = original(self, batch)
        seen.append(
            {
                "names": batch.reward_names,
                "rewards": None
                if batch.reward_components is None
                else batch.reward_components.clone(),
                "info": [dict(info.get("rewards", {})) for info in batch.label_info],
                "scores": batch.scores.clone(),
                "groups": batch.group_ids.clone(),
                "advantages": out.clone(),
            }
        )
        return out

    monkeypatch.setattr(GRPO, "_sequence_advantages", spy)
    params = {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": WEIGHTS}
    parts = ["arithmetic", {"name": "format", "params": {"pattern": "[0-9]"}}]
    spec = tiny_experiment(
        budget={"steps": 3},
        arms={
            "grpo": {
                "algorithm": {"name": "grpo", "params": params},
                "labeler": {"name": "combine", "params": {"labelers": parts}},
                "labeling": {"overlap": overlap},
                "modifiers": [{"name": "replay", "params": {"ratio": 0.5}}],
            }
        },
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("reward/arithmetic" in r and "reward/format" in r for r in rows)
    assert len(seen) == 3
    assert max(len(s["scores"]) for s in seen) > 16, "premise: replayed groups joined a batch"
    differs = False
    for s in seen:
        assert s["names"] == ("arithmetic", "format")
        rewards = s["rewards"]
        assert rewards is not None and not torch.isnan(rewards).any()  # replayed ones too
        given = torch.tensor([[info["arithmetic"], info["format"]] for info in s["info"]])
        assert torch.equal(rewards, given.float())  # the raw parts, as the labeler said
        torch.testing.assert_close(s["scores"], rewards.sum(-1))  # combine's value: their sum
        # GDPO of the parts: each normalised in its group, weighed, normalised over the batch
        per_part = torch.stack(
            [group_advantages(rewards[:, k], s["groups"]) for k in range(2)], dim=-1
        )
        summed = per_part @ torch.tensor(WEIGHTS)
        gdpo = (summed - summed.mean()) / (summed.std() + 1e-6)
        torch.testing.assert_close(s["advantages"], gdpo)
        score_path = group_advantages(s["scores"], s["groups"])
        differs |= not torch.allclose(s["advantages"], score_path, atol=1e-3)
    assert differs, "premise: the parts' advantages are not the summed score's"
    assert all(math.isfinite(r["loss"]) for r in rows)
