"""GRPO: group-relative advantage properties, golden values of each variant, optimisation check."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from alignzoo.batch import PolicyOutputs
from alignzoo.errors import UserError
from alignzoo.plugins.algorithms.grpo import GRPO, group_advantages

from .helpers import (
    TinyPolicy,
    contrast_batch_ids,
    make_batch,
    online_batch,
    right_padded_mask,
    train_on_fixed_batch,
)

FAST = settings(max_examples=40, deadline=None)
reward = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def groups(draw, min_size: int = 1):
    """Rewards with group ids in shuffled order and unequal group sizes."""
    n_groups = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(min_size, 5), min_size=n_groups, max_size=n_groups))
    ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    ids = draw(st.permutations(ids))
    rewards = draw(st.lists(reward, min_size=len(ids), max_size=len(ids)))
    return torch.tensor(rewards), torch.tensor(ids)


# --------------------------------------------------------------------------- properties


@FAST
@given(groups(), st.sampled_from(["group", "none"]), st.floats(-5, 5, width=32), st.data())
def test_advantages_unchanged_by_adding_a_constant_to_a_group(inputs, scale, shift, data):
    rewards, ids = inputs
    target = data.draw(st.sampled_from(sorted(set(ids.tolist()))))
    for g in ids.unique():  # keep clear of groups whose spread is float rounding noise
        members = rewards[ids == g]
        assume(len(members) == 1 or members.std().item() == 0 or members.std().item() > 1e-2)
    shifted = torch.where(ids == target, rewards + shift, rewards)
    before = group_advantages(rewards, ids, scale)
    after = group_advantages(shifted, ids, scale)
    torch.testing.assert_close(before, after, atol=2e-3, rtol=1e-3)


@FAST
@given(groups(), st.sampled_from(["group", "batch", "none"]), st.data())
def test_advantages_are_zero_when_a_group_has_equal_rewards(inputs, scale, data):
    rewards, ids = inputs
    target = data.draw(st.sampled_from(sorted(set(ids.tolist()))))
    value = data.draw(reward)
    rewards = torch.where(ids == target, torch.tensor(value), rewards)
    advantages = group_advantages(rewards, ids, scale)
    assert torch.all(advantages[ids == target].abs() < 1e-5)


@FAST
@given(groups(min_size=2))
def test_group_std_scaling_gives_unit_std_within_each_group(inputs):
    rewards, ids = inputs
    advantages = group_advantages(rewards, ids, "group")
    for g in ids.unique():
        members = rewards[ids == g]
        assume(members.std().item() > 1e-2)
        adv = advantages[ids == g]
        assert adv.mean().item() == pytest.approx(0.0, abs=1e-4)
        assert adv.std().item() == pytest.approx(1.0, abs=1e-3)


@FAST
@given(groups())
def test_advantages_match_a_slow_per_group_loop(inputs):
    rewards, ids = inputs
    advantages = group_advantages(rewards, ids, "group", eps=1e-6)
    for i in range(len(ids)):
        members = [r for r, g in zip(rewards.tolist(), ids.tolist(), strict=True) if g == ids[i]]
        mean = sum(members) / len(members)
        std = (
            math.sqrt(sum((r - mean) ** 2 for r in members) / (len(members) - 1))
            if len(members) > 1
            else 0.0
        )
        expected = (rewards[i].item() - mean) / (std + 1e-6)
        assert advantages[i].item() == pytest.approx(expected, rel=1e-3, abs=1e-3)


# --------------------------------------------------------------------------- golden values


def test_grpo_advantage_scalings_golden():
    rewards = torch.tensor([1.0, 2.0, 2.0, 0.0])
    ids = torch.tensor([0, 1, 1, 0])  # group 0: [1, 0]; group 1: [2, 2]
    group_std = math.sqrt((0.5**2 + 0.5**2) / 1)  # unbiased std of [1, 0]
    assert group_advantages(rewards, ids, "group", eps=0.0).tolist() == pytest.approx(
        [0.5 / group_std, 0.0, 0.0, -0.5 / group_std], abs=1e-6
    )
    mean = 5.0 / 4
    batch_std = math.sqrt(sum((r - mean) ** 2 for r in (1.0, 2.0, 2.0, 0.0)) / 3)
    assert group_advantages(rewards, ids, "batch", eps=0.0).tolist() == pytest.approx(
        [0.5 / batch_std, 0.0, 0.0, -0.5 / batch_std], abs=1e-6
    )
    assert group_advantages(rewards, ids, "none").tolist() == pytest.approx(
        [0.5, 0.0, 0.0, -0.5], abs=1e-6
    )


def test_compute_advantages_broadcasts_over_response_tokens():
    mask = right_padded_mask([2, 3])
    batch = make_batch(mask, scores=[1.0, 0.0], group_ids=[7, 7])
    GRPO({"scale_rewards": "none"}).compute_advantages(batch)
    assert batch.advantages.tolist() == [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]]


def loss_case(log_ratio, advantages, mask=None, ref=None, **params):
    mask = torch.ones_like(log_ratio) if mask is None else mask
    old = torch.full_like(log_ratio, -1.0)
    logprobs = (old + log_ratio).requires_grad_()
    batch = make_batch(mask, old_logprobs=old, advantages=advantages, ref_logprobs=ref)
    algo = GRPO({"beta": 0.0, **params})
    out = algo.compute_loss(batch, PolicyOutputs(logprobs=logprobs), batch.loss_context())
    out.loss.backward()
    return out, logprobs.grad


def test_clip_higher_golden():
    ratio = torch.tensor([[1.25, 0.7]])
    adv = torch.tensor([[1.0, -1.0]])
    sym, _ = loss_case(ratio.log(), adv, loss_aggregation="token-mean")
    # symmetric 0.2: -min(1.25, 1.2) = -1.2 ; -min(-0.7, -0.8) = 0.8
    assert sym.loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert sym.metrics["actor/clipfrac_high"] == pytest.approx(0.5)
    assert sym.metrics["actor/clipfrac_low"] == pytest.approx(0.5)
    high, grad = loss_case(ratio.log(), adv, clip_eps_high=0.28, loss_aggregation="token-mean")
    # clip-higher 0.28: 1.25 < 1.28 so the token is not clipped: -1.25 ; the low side is unchanged
    assert high.loss.item() == pytest.approx((-1.25 + 0.8) / 2, abs=1e-6)
    assert high.metrics["actor/clipfrac_high"] == 0.0
    assert high.metrics["actor/clipfrac"] == pytest.approx(0.5)
    assert grad.flatten().tolist() == pytest.approx([-1.25 / 2, 0.0], abs=1e-6)


def test_gspo_sequence_ratio_golden():
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    log_ratio = torch.tensor([[0.1, 0.3], [0.1, 0.1]])
    out, grad = loss_case(log_ratio, adv, importance_ratio="sequence")
    # s_1 = exp(mean(0.1, 0.3)) = e^0.2 = 1.2214 > 1.2 -> clipped: -1.2, no gradient
    # s_2 = exp(0.1) inside the range: -e^0.1, d/dlogp_t = -e^0.1 / |y| per token
    s2 = math.exp(0.1)
    assert out.loss.item() == pytest.approx((-1.2 - s2) / 2, abs=1e-6)
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, -s2 / 4, -s2 / 4], abs=1e-6)
    assert out.metrics["actor/clipfrac_high"] == pytest.approx(0.5)
    token, _ = loss_case(log_ratio, adv, importance_ratio="token")
    # per-token ratios: e^0.1, clip(e^0.3) = 1.2 | e^0.1, e^0.1
    expected = ((-math.exp(0.1) - 1.2) / 2 + (-s2 - s2) / 2) / 2
    assert token.loss.item() == pytest.approx(expected, abs=1e-6)


def test_grpo_kl_golden_and_beta_zero():
    log_ratio = torch.zeros(1, 1)
    adv = torch.tensor([[2.0]])
    ref = torch.tensor([[-1.5]])  # logp = old = -1; log r = ref - logp = -0.5
    k3 = math.exp(-0.5) - 1 + 0.5
    out, _ = loss_case(log_ratio, adv, ref=ref, beta=0.04)
    assert out.loss.item() == pytest.approx(-2.0 + 0.04 * k3, abs=1e-6)
    assert out.metrics["grpo/kl_k3"] == pytest.approx(k3, abs=1e-6)
    assert out.metrics["actor/pg_loss"] == pytest.approx(-2.0, abs=1e-6)
    no_kl, _ = loss_case(log_ratio, adv, ref=ref, beta=0.0)
    assert no_kl.loss.item() == pytest.approx(-2.0, abs=1e-6)
    assert GRPO({"beta": 0.0}).algorithm_requirements().reference is False
    assert GRPO().algorithm_requirements().reference is True
    assert GRPO().params.beta == 0.04


def test_grpo_loss_aggregation_modes_golden():
    mask = right_padded_mask([1, 3])
    adv = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    zero = torch.zeros(2, 3)
    cases = {
        "token-mean": (-1.0 - 6.0) / 4,
        "seq-mean-token-mean": (-1.0 - 2.0) / 2,
        "seq-mean-token-sum": (-1.0 - 6.0) / 2,
    }
    for mode, expected in cases.items():
        out, _ = loss_case(zero, adv, mask=mask, loss_aggregation=mode)
        assert out.loss.item() == pytest.approx(expected, abs=1e-6), mode
    out, _ = loss_case(
        zero, adv, mask=mask, loss_aggregation="seq-mean-token-sum-norm", norm_constant=8.0
    )
    assert out.loss.item() == pytest.approx((-1.0 / 8 - 6.0 / 8) / 2, abs=1e-6)
    assert GRPO().params.loss_aggregation == "seq-mean-token-mean"


def test_grpo_sample_weights_multiply_the_per_sample_loss():
    mask = torch.ones(2, 1)
    old = torch.zeros(2, 1)
    batch = make_batch(mask, old_logprobs=old, advantages=torch.tensor([[1.0], [3.0]]))
    batch.weights = torch.tensor([0.5, 0.0])
    out = GRPO({"beta": 0.0}).compute_loss(
        batch, PolicyOutputs(logprobs=old.clone()), batch.loss_context()
    )
    assert out.loss.item() == pytest.approx((-1.0 * 0.5 + 0.0) / 2, abs=1e-6)


def test_grpo_missing_scores_is_a_clear_error():
    with pytest.raises(UserError, match="scores"):
        GRPO().compute_advantages(make_batch(torch.ones(1, 1)))


# --------------------------------------------------------------------------- optimisation


@pytest.mark.parametrize(
    "params",
    [{}, {"importance_ratio": "sequence", "scale_rewards": "none", "clip_eps_high": 0.28}],
)
def test_grpo_training_lowers_loss_and_raises_high_reward_tokens(params):
    policy = TinyPolicy(length=4, vocab=4)
    ids = contrast_batch_ids(4)
    mask = right_padded_mask([4, 3, 4, 2], 4)
    batch = online_batch(policy, ids, mask, scores=[1.0, 0.0, 1.0, 0.0], group_ids=[0, 0, 1, 1])
    result = train_on_fixed_batch(GRPO(params), policy, batch, steps=20, lr=0.05)
    assert result.last_loss < result.first_loss - 0.1
    valid = mask.bool()
    up, down = valid & (ids == 1), valid & (ids == 2)
    assert torch.all(result.logprobs_after[up] > result.logprobs_before[up])
    assert torch.all(result.logprobs_after[down] < result.logprobs_before[down])


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo", "reinforce_pp"])
def test_every_online_algorithm_requires_a_constant_for_the_norm_mode(name):
    from importlib import import_module

    from pydantic import ValidationError

    module = import_module(f"alignzoo.plugins.algorithms.{name}")
    cls = next(
        v
        for v in vars(module).values()
        if isinstance(v, type)
        and v.__module__ == module.__name__
        and hasattr(v, "kind")
        and v.kind == "algorithm"
    )
    with pytest.raises(ValidationError, match="norm_constant"):
        cls({"loss_aggregation": "seq-mean-token-sum-norm"})
    algo = cls({"loss_aggregation": "seq-mean-token-sum-norm", "norm_constant": 64})
    assert algo.params.norm_constant == 64.0
