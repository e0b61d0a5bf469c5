"""RLOO: leave-one-out baseline properties and golden values, KL in the reward, optimisation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignzoo.batch import PolicyOutputs
from alignzoo.plugins.algorithms.rloo import RLOO, leave_one_out_advantages

from .helpers import (
    TinyPolicy,
    contrast_batch_ids,
    make_batch,
    online_batch,
    right_padded_mask,
    train_on_fixed_batch,
)

FAST = settings(max_examples=40, deadline=None)


@st.composite
def groups(draw):
    ids = draw(st.lists(st.integers(0, 3), min_size=1, max_size=10))
    rewards = draw(st.lists(st.floats(-10, 10, width=32), min_size=len(ids), max_size=len(ids)))
    return torch.tensor(rewards), torch.tensor(ids)


@FAST
@given(groups())
def test_leave_one_out_matches_a_slow_loop(inputs):
    rewards, ids = inputs
    advantages = leave_one_out_advantages(rewards, ids)
    r, g = rewards.tolist(), ids.tolist()
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if g[j] == g[i] and j != i]
        expected = r[i] - sum(others) / len(others) if others else 0.0
        assert advantages[i].item() == pytest.approx(expected, abs=1e-4)


@FAST
@given(groups())
def test_leave_one_out_is_a_scaled_centred_reward_and_sums_to_zero(inputs):
    rewards, ids = inputs
    advantages = leave_one_out_advantages(rewards, ids)
    for gid in ids.unique():
        members = ids == gid
        k = int(members.sum())
        if k == 1:
            assert advantages[members].item() == 0.0
            continue
        centred = rewards[members] - rewards[members].mean()
        torch.testing.assert_close(advantages[members], k / (k - 1) * centred, atol=1e-4, rtol=1e-4)
        assert advantages[members].sum().item() == pytest.approx(0.0, abs=1e-3)


def test_rloo_baseline_golden():
    rewards = torch.tensor([1.0, 5.0, 2.0, 6.0, 3.0])
    ids = torch.tensor([0, 9, 0, 4, 0])  # group 0: [1, 2, 3] (not contiguous); 4 and 9 alone
    advantages = leave_one_out_advantages(rewards, ids)
    expected = [1 - (2 + 3) / 2, 0.0, 2 - (1 + 3) / 2, 0.0, 3 - (1 + 2) / 2]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)


def test_rloo_kl_in_reward_golden():
    mask = right_padded_mask([2, 1])
    old = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    ref = torch.tensor([[-2.0, -1.5], [-1.25, 7.0]])  # k1 sums: 1 + 0.5 = 1.5 and 0.25
    batch = make_batch(
        mask, scores=[1.0, 0.0], group_ids=[0, 0], old_logprobs=old, ref_logprobs=ref
    )
    RLOO({"kl_coef": 0.1}).compute_advantages(batch)
    r0, r1 = 1.0 - 0.1 * 1.5, 0.0 - 0.1 * 0.25
    assert batch.advantages[0].tolist() == pytest.approx([r0 - r1, r0 - r1], abs=1e-6)
    assert batch.advantages[1].tolist() == pytest.approx([r1 - r0, 0.0], abs=1e-6)
    assert batch.token_rewards[1].tolist() == pytest.approx([r1, 0.0], abs=1e-6)


def test_rloo_loss_golden_and_requirements():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[2.0, 2.0, 0.0]])
    logprobs = torch.tensor([[math.log(1.1), math.log(1.5), 3.0]], requires_grad=True)
    batch = make_batch(mask, old_logprobs=old, advantages=adv)
    out = RLOO({"kl_coef": 0.0}).compute_loss(
        batch, PolicyOutputs(logprobs=logprobs), batch.loss_context()
    )
    # seq-mean-token-sum (the paper's sequence-level REINFORCE): -(1.1 * 2) - (1.2 * 2) clipped
    assert out.loss.item() == pytest.approx(-(2.2 + 2.4), abs=1e-6)
    assert out.metrics["actor/clipfrac_high"] == pytest.approx(0.5)
    assert not RLOO({"kl_coef": 0.0}).algorithm_requirements().reference
    assert RLOO().algorithm_requirements().reference


def test_rloo_training_lowers_loss_and_raises_high_reward_tokens():
    policy = TinyPolicy(length=4, vocab=4)
    ids = contrast_batch_ids(4)
    mask = right_padded_mask([4, 3, 4, 2], 4)
    batch = online_batch(policy, ids, mask, scores=[1.0, 0.0, 1.0, 0.0], group_ids=[0, 0, 1, 1])
    result = train_on_fixed_batch(RLOO(), policy, batch, steps=20, lr=0.05)
    assert result.last_loss < result.first_loss - 0.1
    valid = mask.bool()
    up, down = valid & (ids == 1), valid & (ids == 2)
    assert torch.all(result.logprobs_after[up] > result.logprobs_before[up])
    assert torch.all(result.logprobs_after[down] < result.logprobs_before[down])
