"""PPO: clipped surrogate properties, golden values of every variant, and a real optimisation check."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from alignzoo.batch import PolicyOutputs
from alignzoo.plugins.algorithms.ppo import PPO, AdaptiveKLController, value_loss

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
EPS = 0.2
PG_ONLY = {"kl_in_reward": False, "vf_coef": 0.0, "whiten_advantages": False}


def pg_case(mask, log_ratio, advantages, **params):
    """Loss and gradient w.r.t. the policy log-probs for given log-ratios and advantages."""
    old = torch.full_like(mask, -1.0)
    logprobs = (old + log_ratio).requires_grad_()
    zeros = torch.zeros_like(mask)
    batch = make_batch(mask, old_logprobs=old, advantages=advantages, values=zeros, returns=zeros)
    algo = PPO({**PG_ONLY, **params})
    outputs = PolicyOutputs(logprobs=logprobs, values=zeros.clone().requires_grad_())
    out = algo.compute_loss(batch, outputs, batch.loss_context())
    out.loss.backward()
    return out, logprobs.grad


@st.composite
def pg_inputs(draw):
    mask = draw(padded_masks())
    log_ratio = floats_tensor(draw, tuple(mask.shape), -1.0, 1.0)
    advantages = floats_tensor(draw, tuple(mask.shape), -2.0, 2.0) * mask
    return mask, log_ratio, advantages


# --------------------------------------------------------------------------- properties


@FAST
@given(pg_inputs())
def test_clipped_objective_equals_unclipped_at_ratio_one(inputs):
    mask, _, advantages = inputs
    out, grad = pg_case(mask, torch.zeros_like(mask), advantages)
    n = mask.sum()
    # unclipped surrogate -mean(r * A) at r = 1, and its gradient -A * r / N
    assert out.loss.item() == pytest.approx(-(advantages * mask).sum().item() / n.item(), abs=1e-5)
    torch.testing.assert_close(grad, -advantages * mask / n, atol=1e-6, rtol=1e-5)
    assert out.metrics["actor/clipfrac"] == 0.0


@FAST
@given(pg_inputs())
def test_gradient_is_zero_exactly_where_the_clip_binds(inputs):
    mask, log_ratio, advantages = inputs
    ratio = log_ratio.exp()
    assume(
        bool(((ratio - (1 + EPS)).abs() > 1e-3).all() and ((ratio - (1 - EPS)).abs() > 1e-3).all())
    )
    _, grad = pg_case(mask, log_ratio, advantages)
    blocked = ((advantages > 0) & (ratio > 1 + EPS)) | ((advantages < 0) & (ratio < 1 - EPS))
    n = mask.sum()
    expected = torch.where(blocked, 0.0, -advantages * ratio / n) * mask
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-4)
    assert torch.all(grad[blocked] == 0)


# --------------------------------------------------------------------------- golden values


def test_ppo_clip_golden():
    mask = torch.ones(1, 2)
    ratio = torch.tensor([[1.5, 0.5]])
    adv = torch.tensor([[1.0, -1.0]])
    out, _ = pg_case(mask, ratio.log(), adv)
    # token 1: -min(1.5 * 1, 1.2 * 1) = -1.2; token 2: -min(0.5 * -1, 0.8 * -1) = 0.8
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert out.metrics["actor/pg_loss"] == pytest.approx(-0.2, abs=1e-6)
    assert out.metrics["actor/clipfrac_high"] == pytest.approx(0.5)
    assert out.metrics["actor/clipfrac_low"] == pytest.approx(0.5)
    assert out.metrics["actor/clipfrac"] == pytest.approx(1.0)
    log_r = math.log(1.5)  # approx_kl: k3 of KL(old || new), log r = new - old
    k3 = [(math.exp(lr) - 1 - lr) for lr in (log_r, math.log(0.5))]
    assert out.metrics["actor/approx_kl"] == pytest.approx(sum(k3) / 2, abs=1e-6)


def test_ppo_dual_clip_golden():
    mask = torch.ones(1, 2)
    ratio = torch.tensor([[4.0, 2.0]])
    adv = torch.tensor([[-1.0, -1.0]])
    plain, _ = pg_case(mask, ratio.log(), adv)
    dual, grad = pg_case(mask, ratio.log(), adv, dual_clip=3.0)
    # without dual clip: -min(-4, -1.2) = 4 and -min(-2, -1.2) = 2; with c = 3: min(4, 3) = 3, 2
    assert plain.loss.item() == pytest.approx((4.0 + 2.0) / 2, abs=1e-6)
    assert dual.loss.item() == pytest.approx((3.0 + 2.0) / 2, abs=1e-6)
    assert grad[0, 0].item() == 0.0  # capped token: no gradient
    assert grad[0, 1].item() == pytest.approx(1.0 * 2.0 / 2, abs=1e-6)  # -A r / N, A = -1


def test_ppo_value_clip_golden():
    mask = torch.ones(1, 2)
    old_values = torch.tensor([[1.0, 1.0]])
    returns = torch.tensor([[3.0, 1.1]])
    values = torch.tensor([[2.0, 1.05]], requires_grad=True)
    batch = make_batch(
        mask,
        old_logprobs=torch.zeros(1, 2),
        advantages=torch.zeros(1, 2),
        values=old_values,
        returns=returns,
    )
    algo = PPO({**PG_ONLY, "vf_coef": 0.5, "cliprange_value": 0.2})
    out = algo.compute_loss(
        batch, PolicyOutputs(logprobs=torch.zeros(1, 2), values=values), batch.loss_context()
    )
    # token 1: unclipped (2 - 3)^2 = 1; clipped V = 1 + 0.2 = 1.2 -> (1.2 - 3)^2 = 3.24; max 3.24
    # token 2: unclipped (1.05 - 1.1)^2 = 0.0025; V inside the clip range -> same; max 0.0025
    vf = 0.5 * (3.24 + 0.0025) / 2
    assert out.metrics["critic/vf_loss"] == pytest.approx(vf, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.5 * vf, abs=1e-6)
    assert out.metrics["critic/vf_clipfrac"] == pytest.approx(0.5)
    out.loss.backward()
    assert values.grad[0, 0].item() == 0.0  # the clipped branch is constant in V


def value_clip_tokens(dtype: torch.dtype, c: float) -> tuple[torch.Tensor, ...]:
    """Old values, predictions and returns ``[1, N]`` in ``dtype``, and per token whether the
    prediction is clipped and its clipped term the larger one (computed exactly, in float64).

    Three kinds of token: strictly inside the clip range (near 0, where ``old + (V - old)``
    rounds away from V), exactly on its edge (|V - old| == c, representable), and outside it by
    a clear margin, with the return beyond V (the clipped term is larger: a clip that counts)
    or behind the old value (it is smaller)."""
    g = torch.Generator().manual_seed(0)
    n, margin = 3000, 0.02

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=g, dtype=torch.float64)

    def sign() -> torch.Tensor:
        return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)

    old_in = cast(uniform(-0.3, 0.3))
    v_in = cast(old_in.double() + uniform(-(c - margin), c - margin))
    r_in = cast(uniform(-1.0, 1.0))
    old_edge = torch.randint(-32, 33, (n,), generator=g).double() / 64  # exact in bf16 too
    s = sign()
    v_edge, r_edge = cast(old_edge + s * c), cast(uniform(-1.0, 1.0))
    s = sign()
    old_out = cast(uniform(-0.3, 0.3))
    v_out = cast(old_out.double() + s * uniform(c + margin, 2 * c))
    beyond = torch.rand(n, generator=g) < 0.5
    r_out = cast(torch.where(beyond, v_out.double() + s, old_out.double() - s))
    old = torch.cat([old_in, cast(old_edge), old_out]).unsqueeze(0)
    values = torch.cat([v_in, v_edge, v_out]).unsqueeze(0)
    returns = torch.cat([r_in, r_edge, r_out]).unsqueeze(0)
    # the reference, in float64 from the same numbers: a token is clipped when |V - old| > c
    v64, old64, r64 = values.double(), old.double(), returns.double()
    over = (v64 - old64).abs() > c
    clipped64 = torch.where(over, old64 + (v64 - old64).clamp(-c, c), v64)
    counts = over & ((clipped64 - r64).square() > (v64 - r64).square())
    assert counts.sum() == beyond.sum() and not over[0, : 2 * n].any()
    return old, values, returns, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_clip_fraction_counts_only_real_clips(dtype: torch.dtype) -> None:
    # Inside the clip range old + (V - old) may round one unit in the last place away from V;
    # that is no clip, and the metric must not count it (nor the loss take the rounded value).
    c = 0.25
    old, values, returns, counts = value_clip_tokens(dtype, c)
    mask = torch.ones(values.shape)
    vf_mat, clipped = value_loss(values, old, returns, mask, c)
    assert torch.equal(clipped, counts)
    unclipped = ~(values.double() - old.double()).abs().gt(c)
    own = 0.5 * (values - returns).square()
    assert torch.equal(vf_mat[unclipped], own[unclipped])  # an unclipped token's own loss
    batch = make_batch(
        mask,
        old_logprobs=torch.zeros(values.shape),
        advantages=torch.zeros(values.shape),
        values=old,
        returns=returns,
    )
    algo = PPO({**PG_ONLY, "vf_coef": 0.5, "cliprange_value": c})
    outputs = PolicyOutputs(logprobs=torch.zeros(values.shape), values=values)
    out = algo.compute_loss(batch, outputs, batch.loss_context())
    want = counts.sum().item() / counts.numel()
    assert out.metrics["critic/vf_clipfrac"] == pytest.approx(want, abs=1e-7)


def test_ppo_gae_golden_through_the_plugin():
    mask = right_padded_mask([3], 4)
    values = torch.tensor([[0.5, 1.0, 1.5, 7.0]])
    batch = make_batch(mask, scores=[2.0], values=values, old_logprobs=torch.zeros(1, 4))
    algo = PPO({"kl_in_reward": False, "whiten_advantages": False, "gamma": 0.9, "lam": 0.8})
    algo.compute_advantages(batch)
    gamma, lam = 0.9, 0.8
    d2 = 2.0 + gamma * 0.0 - 1.5  # the score is the reward of the last valid token
    d1 = 0.0 + gamma * 1.5 - 1.0
    d0 = 0.0 + gamma * 1.0 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    assert batch.advantages[0].tolist() == pytest.approx([a0, a1, a2, 0.0], abs=1e-6)
    assert batch.returns[0].tolist() == pytest.approx([a0 + 0.5, a1 + 1.0, a2 + 1.5, 0.0], abs=1e-6)
    assert batch.token_rewards[0].tolist() == [0.0, 0.0, 2.0, 0.0]


def test_ppo_kl_in_reward_golden():
    mask = torch.ones(1, 2)
    old = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.5]])
    batch = make_batch(
        mask, scores=[1.0], values=torch.zeros(1, 2), old_logprobs=old, ref_logprobs=ref
    )
    PPO({"kl_coef": 0.1, "kl_estimator": "k1"}).compute_advantages(batch)
    # k1 = log pi - log pi_ref = [0.5, -0.5]; r_t = score * 1[last] - 0.1 * k1
    assert batch.token_rewards[0].tolist() == pytest.approx([-0.05, 1.0 + 0.05], abs=1e-6)


def test_adaptive_kl_controller_golden():
    ctl = AdaptiveKLController(init_kl_coef=0.2, kl_target=6.0, horizon_steps=10)
    ctl.update(current_kl=6.6)  # e = 6.6 / 6 - 1 = 0.1 (inside the clip), one step
    assert ctl.value == pytest.approx(0.2 * (1 + 0.1 / 10), abs=1e-12)
    ctl.update(current_kl=1.2)  # e = 1.2 / 6 - 1 = -0.8 -> clipped to -0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.1 / 10) * (1 - 0.2 / 10), abs=1e-12)


def test_adaptive_kl_updates_from_observed_kl_and_resumes_from_state_dict():
    mask = torch.ones(2, 3)
    old = torch.zeros(2, 3)
    ref = torch.full((2, 3), -3.0)  # k1 = 3 per token, 9 per sequence

    def fresh_batch():
        return make_batch(
            mask, scores=[1.0, 0.0], values=torch.zeros(2, 3), old_logprobs=old, ref_logprobs=ref
        )

    params = {
        "kl_controller": "adaptive",
        "init_kl_coef": 0.2,
        "kl_target": 6.0,
        "kl_target_unit": "sequence",
        "kl_horizon_steps": 50,
    }
    algo = PPO(params)
    batch = algo.compute_advantages(fresh_batch())
    # the reward uses the coefficient before the update ...
    assert batch.token_rewards[1].tolist() == pytest.approx([-0.6, -0.6, -0.6], abs=1e-6)
    # ... then e = clip(9 / 6 - 1, -0.2, 0.2) = 0.2 and beta <- 0.2 * (1 + 0.2 / 50)
    expected = 0.2 * (1 + 0.2 / 50)
    assert algo.state_dict() == {"kl_controller": {"kl_coef": pytest.approx(expected)}}
    out = algo.compute_loss(
        batch,
        PolicyOutputs(logprobs=old.clone(), values=torch.zeros(2, 3, requires_grad=True)),
        batch.loss_context(),
    )
    assert out.metrics["kl/coef"] == 0.2  # the coefficient of this step's reward
    assert out.metrics["kl/measured"] == pytest.approx(9.0)  # nats per sequence
    assert out.metrics["kl/target"] == 6.0

    resumed = PPO(params)
    resumed.load_state_dict(algo.state_dict())
    algo.compute_advantages(fresh_batch())
    resumed.compute_advantages(fresh_batch())
    assert resumed.state_dict() == algo.state_dict()
    assert algo.state_dict()["kl_controller"]["kl_coef"] == pytest.approx(expected * 1.004)


def test_ppo_kl_loss_term_golden():
    mask = torch.ones(1, 2)
    zeros = torch.zeros(1, 2)
    ref = torch.tensor([[-1.0, 0.0]])
    batch = make_batch(
        mask, old_logprobs=zeros, advantages=zeros, values=zeros, returns=zeros, ref_logprobs=ref
    )
    algo = PPO({**PG_ONLY, "kl_loss_coef": 0.5, "kl_estimator": "k3"})
    assert algo.algorithm_requirements().reference
    out = algo.compute_loss(
        batch, PolicyOutputs(logprobs=zeros.clone(), values=zeros.clone()), batch.loss_context()
    )
    k3 = (math.exp(-1.0) - 1 + 1.0 + 0.0) / 2  # log r = ref - logp = [-1, 0]
    assert out.loss.item() == pytest.approx(0.5 * k3, abs=1e-6)
    assert out.metrics["ppo/kl_penalty"] == pytest.approx(k3, abs=1e-6)


def test_ppo_whitening_and_entropy_bonus():
    mask = right_padded_mask([3, 2])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, 0.0]])
    batch = make_batch(mask, scores=[1.0, -2.0], values=values, old_logprobs=torch.zeros(2, 3))
    PPO({"kl_in_reward": False}).compute_advantages(batch)
    valid = batch.advantages[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-4)
    assert torch.all(batch.advantages[~mask.bool()] == 0)

    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    zeros = torch.zeros(2, 3)
    batch = make_batch(mask, old_logprobs=zeros, advantages=zeros, values=zeros, returns=zeros)
    outputs = PolicyOutputs(logprobs=zeros.clone(), entropy=entropy, values=zeros.clone())
    out = PPO({**PG_ONLY, "entropy_coef": 0.1}).compute_loss(batch, outputs, batch.loss_context())
    assert out.loss.item() == pytest.approx(-0.1 * 15.0 / 5, abs=1e-6)
    assert "entropy" not in out.metrics  # the engine reports entropy, the same for every arm


def test_ppo_explained_variance_and_metric_names():
    mask = torch.ones(2, 2)
    returns = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    batch = make_batch(
        mask,
        old_logprobs=torch.zeros(2, 2),
        advantages=torch.zeros(2, 2),
        values=returns,
        returns=returns,
        ref_logprobs=torch.zeros(2, 2),
    )
    outputs = PolicyOutputs(logprobs=torch.zeros(2, 2), entropy=torch.ones(2, 2), values=returns)
    out = PPO().compute_loss(batch, outputs, batch.loss_context())
    assert out.metrics["critic/explained_variance"] == pytest.approx(1.0)
    outputs.values = torch.full((2, 2), 2.5)  # predicting the mean explains nothing
    assert PPO().compute_loss(batch, outputs, batch.loss_context()).metrics[
        "critic/explained_variance"
    ] == pytest.approx(0.0, abs=1e-6)
    expected = {
        "actor/pg_loss",
        "actor/clipfrac",
        "actor/clipfrac_low",
        "actor/clipfrac_high",
        "actor/approx_kl",
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/explained_variance",
        "ppo/kl_penalty",
        "kl/coef",
    }
    assert expected <= set(out.metrics)
    assert not {"kl", "entropy", "kl/ref"} & set(out.metrics)  # canonical names are the engine's
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.metrics.values())


def test_ppo_requirements_and_params():
    assert PPO().algorithm_requirements().reference  # kl_coef 0.02 in the reward by default
    req = PPO({"kl_coef": 0.0}).algorithm_requirements()
    assert not req.reference and req.critic and req.data == "online"
    assert not PPO({"kl_in_reward": False}).algorithm_requirements().reference
    assert PPO({"kl_in_reward": False, "kl_loss_coef": 0.1}).algorithm_requirements().reference
    with pytest.raises(ValidationError, match="kl_in_reward"):
        PPO({"kl_controller": "adaptive", "kl_in_reward": False})
    with pytest.raises(ValidationError):
        PPO({"dual_clip": 0.5})
    with pytest.raises(ValidationError):
        PPO({"clip_epsilon": 0.2})


def test_ppo_missing_inputs_are_clear_errors():
    from alignzoo.errors import UserError

    batch = make_batch(torch.ones(1, 2), scores=[1.0])
    with pytest.raises(UserError, match="values"):
        PPO().compute_advantages(batch)


# --------------------------------------------------------------------------- optimisation


def test_ppo_training_lowers_loss_and_raises_high_reward_tokens():
    torch.manual_seed(0)
    policy = TinyPolicy(length=4, vocab=4)
    ids = contrast_batch_ids(4)
    mask = right_padded_mask([4, 3, 4, 2], 4)
    batch = online_batch(policy, ids, mask, scores=[1.0, -1.0, 1.0, -1.0])
    algo = PPO()
    result = train_on_fixed_batch(algo, policy, batch, steps=30, lr=0.05)
    assert result.last_loss < result.first_loss - 0.1
    valid = mask.bool()
    up = valid & (ids == 1)
    down = valid & (ids == 2)
    assert torch.all(result.logprobs_after[up] > result.logprobs_before[up])
    assert torch.all(result.logprobs_after[down] < result.logprobs_before[down])
    # the critic moved towards the returns too (TinyPolicy(4, 4) rebuilds the initial weights)
    trained = algo.compute_loss(batch, policy(ids), batch.loss_context()).metrics["critic/vf_loss"]
    initial = algo.compute_loss(
        batch, TinyPolicy(length=4, vocab=4)(ids), batch.loss_context()
    ).metrics["critic/vf_loss"]
    assert trained < 0.8 * initial  # value clipping keeps V within 0.2 of the rollout values
