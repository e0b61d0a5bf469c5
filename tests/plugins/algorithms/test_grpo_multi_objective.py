"""GRPO with several rewards (TRL's multi_objective_aggregation and reward_weights): the
default trains on the labeler's score exactly as before; reward_weights weigh the raw rewards;
normalize_then_sum (GDPO) normalises each reward in its group first, so rescaling one reward
changes nothing; a reward that does not apply (NaN) is left out as TRL leaves it out; a wrong
number of weights fails naming the field; the contract suite, direction included, holds.
TRL parity: tests/parity/test_trl_grpo_multi_objective.py."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from alignzoo.errors import UserError
from alignzoo.plugins.algorithms.grpo import GRPO, group_advantages
from alignzoo.testing.contract import check_algorithm

from .helpers import make_batch

NAN = math.nan
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
# Two rewards per sample: correctness (0/1) and a format score on another scale.
REWARDS = torch.tensor(
    [[1, 0.2], [0, 0.9], [1, 0.5], [0, 0.1], [1, 0.3], [1, 0.8], [0, 0.6], [0, 0.6]]
)


def batch_of(rewards: torch.Tensor | None, scores: torch.Tensor | None = None, groups=GROUPS):
    size = len(groups)
    if scores is None:
        assert rewards is not None
        scores = torch.nansum(rewards, dim=-1)
    batch = make_batch(torch.ones(size, 3), scores=scores, group_ids=groups)
    if rewards is not None:
        batch.reward_components = rewards.float()
        batch.reward_names = tuple(f"r{k}" for k in range(rewards.shape[1]))
    return batch


def advantages(params: dict, batch) -> torch.Tensor:
    out = GRPO(params).compute_advantages(batch).advantages
    assert out is not None
    return out[:, 0]


def test_the_default_trains_on_the_labelers_score_as_before_and_reads_no_rewards() -> None:
    scores = torch.tensor([0.3, 1.0, 0.2, 0.0, 5.0, 1.0, 2.0, 0.5])
    ours = advantages({}, batch_of(REWARDS, scores))
    assert torch.equal(ours, group_advantages(scores, GROUPS))
    assert GRPO({}).algorithm_requirements().reward_components is None


def test_reward_weights_weigh_the_raw_rewards_under_sum_then_normalize() -> None:
    weights = [2.0, -0.5]
    summed = REWARDS @ torch.tensor(weights)
    for scale in ("group", "batch", "none"):
        params = {"reward_weights": weights, "scale_rewards": scale}
        ours = advantages(params, batch_of(REWARDS, scores=torch.zeros(8)))  # score unread
        torch.testing.assert_close(ours, group_advantages(summed, GROUPS, scale))
    assert GRPO({"reward_weights": weights}).algorithm_requirements().reward_components == 2


def test_a_labeler_without_rewards_is_one_reward_its_score() -> None:
    scores = torch.tensor([0.3, 1.0, 0.2, 0.0, 5.0, 1.0, 2.0, 0.5])
    ours = advantages({"reward_weights": [3.0]}, batch_of(None, scores))
    torch.testing.assert_close(ours, group_advantages(3.0 * scores, GROUPS))
    gdpo = advantages({"multi_objective_aggregation": "normalize_then_sum"}, batch_of(None, scores))
    per_group = group_advantages(scores, GROUPS)
    torch.testing.assert_close(gdpo, (per_group - per_group.mean()) / (per_group.std() + 1e-6))


def test_normalize_then_sum_normalises_each_reward_in_its_group_then_the_sum_over_the_batch():
    weights = torch.tensor([1.0, 0.5])
    ours = advantages(
        {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": weights.tolist()},
        batch_of(REWARDS),
    )
    per_reward = torch.stack([group_advantages(REWARDS[:, k], GROUPS) for k in range(2)], -1)
    summed = per_reward @ weights
    torch.testing.assert_close(ours, (summed - summed.mean()) / (summed.std() + 1e-6))


def test_normalize_then_sum_does_not_let_one_rewards_scale_drown_the_other() -> None:
    """GDPO's point: rescaling or shifting one reward leaves its advantages as they were
    (up to eps), while the summed score lets the larger scale decide."""
    stretched = REWARDS * torch.tensor([1.0, 100.0]) + torch.tensor([0.0, 7.0])
    gdpo = {"multi_objective_aggregation": "normalize_then_sum"}
    before, after = advantages(gdpo, batch_of(REWARDS)), advantages(gdpo, batch_of(stretched))
    torch.testing.assert_close(before, after, atol=1e-4, rtol=0)
    summed = {"reward_weights": [1.0, 1.0]}
    assert not torch.allclose(advantages(summed, batch_of(REWARDS)),
                              advantages(summed, batch_of(stretched)), atol=1e-2)  # fmt: skip


@pytest.mark.parametrize(
    "params",
    [
        {"multi_objective_aggregation": "normalize_then_sum"},
        {"reward_weights": [1.0, 2.0]},
        {"reward_weights": [1.0, 2.0], "scale_rewards": "batch"},
    ],
)
def test_a_sample_no_reward_applies_to_gets_zero_and_counts_in_no_statistic(params) -> None:
    """As TRL: its row is left out of the group and batch statistics (the others' advantages
    are those of the batch without it) and its advantage is 0."""
    rewards = REWARDS.clone()
    rewards[2] = NAN
    ours = advantages(params, batch_of(rewards))
    keep = [i for i in range(8) if i != 2]
    without = advantages(params, batch_of(rewards[keep], groups=GROUPS[keep]))
    assert ours[2] == 0.0
    torch.testing.assert_close(ours[keep], without)


def test_a_reward_that_does_not_apply_is_left_out_of_its_statistics_and_the_sum() -> None:
    """Sample 0's second reward is NaN: its first still counts, and the second reward's group
    statistics are those of the other three samples."""
    rewards = REWARDS.clone()
    rewards[0, 1] = NAN
    gdpo = {"multi_objective_aggregation": "normalize_then_sum"}
    ours = advantages(gdpo, batch_of(rewards))
    first = group_advantages(rewards[:, 0], GROUPS)
    second = torch.zeros(8)
    second[1:] = group_advantages(rewards[1:, 1], GROUPS[1:])
    summed = first + second  # sample 0: its first reward only
    torch.testing.assert_close(ours, (summed - summed.mean()) / (summed.std() + 1e-6))
    weighted = advantages({"reward_weights": [1.0, 1.0]}, batch_of(rewards))
    torch.testing.assert_close(weighted, group_advantages(torch.nansum(rewards, -1), GROUPS))


@pytest.mark.parametrize(
    ("params", "rewards"),
    [
        ({"reward_weights": [1.0, 2.0, 3.0]}, REWARDS),
        ({"reward_weights": [1.0, 2.0], "multi_objective_aggregation": "normalize_then_sum"}, None),
    ],
)
def test_a_step_whose_labeler_reports_another_number_of_rewards_fails_naming_the_field(
    params, rewards
) -> None:
    batch = batch_of(rewards, scores=torch.ones(8))
    with pytest.raises(UserError, match=r"reward_weights has \d weights.*reports [12] reward"):
        GRPO(params).compute_advantages(batch)


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "none"},
         "scale_rewards 'none' is not read by multi_objective_aggregation"),
        ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": False},
         "scale_rewards 'none'"),
        ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "batch"},
         "scale_rewards 'batch'"),
        ({"multi_objective_aggregation": "sum_then_sum"}, "multi_objective_aggregation"),
        ({"reward_weights": []}, "reward_weights"),
        ({"reward_weights": [1.0, math.inf]}, "reward_weights must be finite"),
    ],
)  # fmt: skip
def test_unreadable_combinations_and_bad_weights_are_refused(params: dict, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        GRPO.Params(**params)


def test_trls_defaults() -> None:
    params = GRPO.Params()
    assert params.multi_objective_aggregation == "sum_then_normalize"
    assert params.reward_weights is None and not params.reads_reward_components
    requirements = GRPO({"multi_objective_aggregation": "normalize_then_sum"})
    assert requirements.algorithm_requirements().reward_components == 0  # any number


@pytest.mark.parametrize(
    "params",
    [
        {"multi_objective_aggregation": "normalize_then_sum"},
        {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": [2.0]},
        {"reward_weights": [0.5], "scale_rewards": "batch"},
    ],
)
def test_grpo_with_several_rewards_passes_the_contract(params: dict) -> None:
    """The suite's batches carry a score each (one reward): direction holds, the best sample
    of each group rises, also after GDPO's batch normalisation."""
    failed = [r for r in check_algorithm(GRPO(params), max_examples=25) if not r.passed]
    assert failed == [], [(r.name, r.detail) for r in failed]
