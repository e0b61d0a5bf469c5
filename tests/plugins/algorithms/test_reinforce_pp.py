"""REINFORCE++: token-level KL reward, returns, global advantage normalisation, optimisation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from alignzoo.batch import PolicyOutputs
from alignzoo.plugins.algorithms.reinforce_pp import ReinforcePlusPlus

from .helpers import (
    TinyPolicy,
    contrast_batch_ids,
    floats_tensor,
    make_batch,
    online_batch,
    padded_masks,
    right_padded_mask,
    train_on_fixed_batch,
)

FAST = settings(max_examples=40, deadline=None)


def golden_batch():
    mask = right_padded_mask([2, 1])
    old = torch.tensor([[-1.0, -1.0], [-1.0, 5.0]])
    ref = torch.tensor([[-1.2, -1.4], [-1.6, 0.0]])  # k1 = old - ref = [0.2, 0.4], [0.6, -]
    return make_batch(mask, scores=[1.0, 0.0], old_logprobs=old, ref_logprobs=ref)


def test_reinforce_pp_normalisation_golden():
    batch = ReinforcePlusPlus({"kl_coef": 0.5}).compute_advantages(golden_batch())
    # r_t = 1[t = T] score - 0.5 * k1_t
    rewards = [-0.1, 1.0 - 0.2, -0.3, 0.0]
    assert batch.token_rewards.flatten().tolist() == pytest.approx(rewards, abs=1e-6)
    # gamma = 1: returns-to-go [0.7, 0.8] and [-0.3]
    assert batch.returns.flatten().tolist() == pytest.approx([0.7, 0.8, -0.3, 0.0], abs=1e-6)
    mean = (0.7 + 0.8 - 0.3) / 3
    std = math.sqrt(((0.7 - mean) ** 2 + (0.8 - mean) ** 2 + (-0.3 - mean) ** 2) / 2 + 1e-8)
    expected = [(0.7 - mean) / std, (0.8 - mean) / std, (-0.3 - mean) / std, 0.0]
    assert batch.advantages.flatten().tolist() == pytest.approx(expected, abs=1e-6)


def test_reinforce_pp_discount_golden():
    batch = ReinforcePlusPlus({"kl_coef": 0.5, "gamma": 0.5}).compute_advantages(golden_batch())
    assert batch.returns.flatten().tolist() == pytest.approx(
        [-0.1 + 0.5 * 0.8, 0.8, -0.3, 0.0], abs=1e-6
    )


@FAST
@given(padded_masks(max_b=5), st.data())
def test_advantages_are_normalised_over_the_whole_batch(mask, data):
    scores = floats_tensor(data.draw, (mask.shape[0],), -3, 3)
    batch = make_batch(mask, scores=scores)
    ReinforcePlusPlus({"kl_coef": 0.0}).compute_advantages(batch)
    valid = mask.bool()
    assume(valid.sum() > 1 and batch.returns[valid].std() > 1e-2)
    assert batch.advantages[valid].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert batch.advantages[valid].std().item() == pytest.approx(1.0, abs=1e-4)
    assert torch.all(batch.advantages[~valid] == 0)
    # with gamma = 1 and no KL every token of a sequence carries the same return: its score
    torch.testing.assert_close(batch.returns, scores.unsqueeze(-1) * mask)


def test_reinforce_pp_loss_golden_and_requirements():
    mask = torch.ones(1, 2)
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[math.log(0.7), 0.0]], requires_grad=True)
    batch = make_batch(mask, old_logprobs=old, advantages=torch.tensor([[-1.0, 0.5]]))
    out = ReinforcePlusPlus().compute_loss(
        batch, PolicyOutputs(logprobs=logprobs), batch.loss_context()
    )
    # token-mean of -min(rA, clip(r)A): 0.7 < 0.8 with A < 0 -> 0.8; ratio 1 -> -0.5
    assert out.loss.item() == pytest.approx((0.8 - 0.5) / 2, abs=1e-6)
    assert out.metrics["actor/clipfrac_low"] == pytest.approx(0.5)
    assert ReinforcePlusPlus().algorithm_requirements().reference
    assert not ReinforcePlusPlus({"kl_coef": 0.0}).algorithm_requirements().reference


def test_reinforce_pp_training_lowers_loss_and_raises_high_reward_tokens():
    policy = TinyPolicy(length=4, vocab=4)
    ids = contrast_batch_ids(4)
    mask = right_padded_mask([4, 3, 4, 2], 4)
    batch = online_batch(policy, ids, mask, scores=[1.0, 0.0, 1.0, 0.0])
    result = train_on_fixed_batch(ReinforcePlusPlus(), policy, batch, steps=20, lr=0.05)
    assert result.last_loss < result.first_loss - 0.1
    valid = mask.bool()
    up, down = valid & (ids == 1), valid & (ids == 2)
    assert torch.all(result.logprobs_after[up] > result.logprobs_before[up])
    assert torch.all(result.logprobs_after[down] < result.logprobs_before[down])
