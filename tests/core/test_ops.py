"""Shared ops: GAE, KL estimators, loss aggregation, group statistics, the clipped surrogate."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignzoo import ops
from tests.plugins.algorithms.helpers import (
    any_masks,
    floats_tensor,
    padded_masks,
    right_padded_mask,
)

FAST = settings(max_examples=40, deadline=None)


# --------------------------------------------------------------------------- GAE


def slow_gae(rewards, values, mask, gamma, lam):
    """Reference GAE: for each row, the textbook recursion over its valid tokens only."""
    b, r = mask.shape
    adv = torch.zeros(b, r)
    for i in range(b):
        idx = [t for t in range(r) if mask[i, t] > 0]
        running = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_value = float(values[i, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            adv[i, t] = running
    return adv, (adv + values) * mask


@st.composite
def gae_inputs(draw):
    mask = draw(any_masks())
    rewards = floats_tensor(draw, tuple(mask.shape), -3, 3)
    values = floats_tensor(draw, tuple(mask.shape), -3, 3)
    return rewards, values, mask


@FAST
@given(gae_inputs())
def test_gae_with_gamma_lambda_one_is_returns_minus_values(inputs):
    rewards, values, mask = inputs
    advantages, returns = ops.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    masked_rewards = rewards * mask
    reward_to_go = masked_rewards.flip(-1).cumsum(-1).flip(-1)  # sum_{s >= t} r_s
    expected = (reward_to_go - values) * mask
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(returns, reward_to_go * mask, atol=1e-4, rtol=1e-5)


@FAST
@given(gae_inputs(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_slow_reference_loop(inputs, gamma, lam):
    rewards, values, mask = inputs
    advantages, returns = ops.gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected_adv, expected_ret = slow_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected_adv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(returns, expected_ret, atol=1e-4, rtol=1e-4)


def test_gae_golden_value():
    # One sequence of 3 tokens, the third is padding; gamma = 0.9, lambda = 0.8.
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.25, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    gamma, lam = 0.9, 0.8
    delta1 = 1.0 + gamma * 0.0 - 0.25  # last valid token: next value is 0
    delta0 = 0.0 + gamma * 0.25 - 0.5
    a1 = delta1
    a0 = delta0 + gamma * lam * a1
    advantages, returns = ops.gae(rewards, values, mask, gamma, lam)
    assert advantages[0].tolist() == pytest.approx([a0, a1, 0.0], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.25, 0.0], abs=1e-6)


# --------------------------------------------------------------------------- KL estimators


@FAST
@given(st.lists(st.floats(-30, 0, allow_nan=False, width=32), min_size=1, max_size=8))
def test_kl_estimators_are_zero_when_policy_equals_reference(logps):
    logprobs = torch.tensor(logps)
    for estimator in ("k1", "k2", "k3"):
        kl = ops.kl_penalty(logprobs, logprobs.clone(), estimator)
        assert torch.all(kl == 0), estimator


@FAST
@given(
    st.lists(
        st.tuples(st.floats(-30, 0, width=32), st.floats(-30, 0, width=32)),
        min_size=1,
        max_size=8,
    )
)
def test_k2_and_k3_are_non_negative(pairs):
    logprobs = torch.tensor([p for p, _ in pairs])
    ref = torch.tensor([q for _, q in pairs])
    assert torch.all(ops.kl_penalty(logprobs, ref, "k2") >= 0)
    assert torch.all(ops.kl_penalty(logprobs, ref, "k3") >= 0)


def test_kl_estimators_golden():
    logprobs, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log r = ref - logp = -1
    assert ops.kl_penalty(logprobs, ref, "k1").item() == pytest.approx(1.0, abs=1e-6)
    assert ops.kl_penalty(logprobs, ref, "k2").item() == pytest.approx(0.5, abs=1e-6)
    k3 = (math.exp(-1.0) - 1.0) - (-1.0)
    assert ops.kl_penalty(logprobs, ref, "k3").item() == pytest.approx(k3, abs=1e-6)


# --------------------------------------------------------------------------- aggregation


@st.composite
def uniform_length_batches(draw):
    b = draw(st.integers(1, 4))
    r = draw(st.integers(1, 6))
    length = draw(st.integers(1, r))
    mask = right_padded_mask([length] * b, r)
    loss = floats_tensor(draw, (b, r), -5, 5)
    return loss, mask


@FAST
@given(uniform_length_batches())
def test_token_mean_equals_seq_mean_token_mean_on_uniform_lengths(inputs):
    loss, mask = inputs
    token_mean = ops.aggregate_loss(loss, mask, "token-mean")
    seq_mean = ops.aggregate_loss(loss, mask, "seq-mean-token-mean")
    torch.testing.assert_close(token_mean, seq_mean, atol=1e-5, rtol=1e-5)


@FAST
@given(padded_masks(), st.floats(0.5, 100.0), st.data())
def test_seq_mean_token_sum_norm_is_token_sum_over_constant(mask, constant, data):
    loss = floats_tensor(data.draw, tuple(mask.shape), -5, 5)
    token_sum = ops.aggregate_loss(loss, mask, "seq-mean-token-sum")
    norm = ops.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=constant)
    torch.testing.assert_close(norm, token_sum / constant, atol=1e-5, rtol=1e-5)


@FAST
@given(uniform_length_batches())
def test_token_sum_is_length_times_token_mean_on_uniform_lengths(inputs):
    loss, mask = inputs
    length = mask[0].sum()
    token_sum = ops.aggregate_loss(loss, mask, "seq-mean-token-sum")
    token_mean = ops.aggregate_loss(loss, mask, "token-mean")
    torch.testing.assert_close(token_sum, length * token_mean, atol=1e-4, rtol=1e-5)


def test_aggregation_modes_golden_on_ragged_batch():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert ops.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert ops.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(
        (2.0 + 4.0) / 2
    )
    assert ops.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(
        (6.0 + 4.0) / 2
    )
    assert ops.aggregate_loss(
        loss, mask, "seq-mean-token-sum-norm", norm_constant=5.0
    ).item() == pytest.approx((6.0 / 5 + 4.0 / 5) / 2)
    # default constant: the padded length R = 3
    assert ops.aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(
        (6.0 / 3 + 4.0 / 3) / 2
    )


def test_weight_samples_scales_rows():
    loss = torch.ones(2, 3)
    weighted = ops.weight_samples(loss, torch.tensor([2.0, 0.5]))
    assert weighted.tolist() == [[2.0] * 3, [0.5] * 3]
    assert ops.weight_samples(loss, None) is loss


# --------------------------------------------------------------------------- group stats


@FAST
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5, width=32)), min_size=1, max_size=10))
def test_group_mean_std_matches_slow_loop_for_unordered_groups(items):
    group_ids = torch.tensor([g for g, _ in items])
    values = torch.tensor([v for _, v in items])
    mean, std, count = ops.group_mean_std(values, group_ids)
    for i, (g, _) in enumerate(items):
        members = [v for h, v in items if h == g]
        m = sum(members) / len(members)
        s = (
            math.sqrt(sum((v - m) ** 2 for v in members) / (len(members) - 1))
            if len(members) > 1
            else 0.0
        )
        assert mean[i].item() == pytest.approx(m, abs=1e-4)
        assert std[i].item() == pytest.approx(s, abs=1e-4)
        assert count[i].item() == len(members)


def test_last_token_scores_places_score_on_last_valid_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    placed = ops.last_token_scores(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert placed.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]


# --------------------------------------------------------------------------- clipped surrogate


def test_clipped_surrogate_golden_and_clip_masks():
    ratio = torch.tensor([1.5, 0.5, 0.9, 1.1, 4.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0])
    loss, low, high = ops.clipped_surrogate(ratio.log(), adv, 0.2, 0.2)
    # -min(rA, clip(r)A): 1.5 -> -1.2; 0.5 with A<0 -> 0.8; inside the range -> -rA
    assert loss.tolist() == pytest.approx([-1.2, 0.8, -0.9, 1.1, 4.0], abs=1e-6)
    assert low.tolist() == [False, True, False, False, False]
    assert high.tolist() == [True, False, False, False, False]
    dual, _, high_dual = ops.clipped_surrogate(ratio.log(), adv, 0.2, 0.2, dual_clip=3.0)
    # dual clip caps the A<0 loss at -c A = 3 (Ye et al. 2020): only the last token changes
    assert dual.tolist() == pytest.approx([-1.2, 0.8, -0.9, 1.1, 3.0], abs=1e-6)
    assert high_dual.tolist() == [True, False, False, False, True]


def test_clipped_surrogate_is_finite_for_extreme_log_ratios():
    log_ratio = torch.tensor([-1e4, 1e4, 0.0], requires_grad=True)
    loss, _, _ = ops.clipped_surrogate(log_ratio, torch.tensor([1.0, 1.0, -1.0]), 0.2, 0.2)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(log_ratio.grad).all()


@st.composite
def surrogate_cases(draw):
    """Log-ratios (some beyond the [-20, 20] clamp), advantages of either sign or 0, asymmetric
    clip ranges and, half the time, a dual-clip constant; float64."""
    n = draw(st.integers(1, 12))
    log_ratios = st.one_of(st.floats(-1.0, 1.0), st.floats(-30.0, 30.0))
    log_ratio = torch.tensor(
        draw(st.lists(log_ratios, min_size=n, max_size=n)), dtype=torch.float64
    )
    advantage = st.one_of(st.just(0.0), st.floats(-10.0, 10.0))
    advantages = torch.tensor(
        draw(st.lists(advantage, min_size=n, max_size=n)), dtype=torch.float64
    )
    clip_low = draw(st.floats(0.01, 0.99))
    clip_high = draw(st.floats(0.01, 5.0))
    dual_clip = draw(st.one_of(st.none(), st.floats(1.01, 10.0)))
    return log_ratio, advantages, clip_low, clip_high, dual_clip


@FAST
@given(surrogate_cases())
def test_clipped_surrogate_is_the_textbook_formula(case):
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token (PPO eq. 7), with the dual clip
    min(that, -c A) for A < 0 (Ye et al. 2020), written out with Python floats; the masks mark
    exactly the tokens whose gradient the clip removes."""
    log_ratio, advantages, clip_low, clip_high, dual_clip = case
    leaf = log_ratio.clone().requires_grad_(True)
    loss, clipped_low, clipped_high = ops.clipped_surrogate(
        leaf, advantages, clip_low, clip_high, dual_clip
    )
    loss.sum().backward()
    for i, (lr, a) in enumerate(zip(log_ratio.tolist(), advantages.tolist(), strict=True)):
        r = math.exp(min(max(lr, -20.0), 20.0))
        expected = -min(r * a, min(max(r, 1.0 - clip_low), 1.0 + clip_high) * a)
        if dual_clip is not None and a < 0:
            expected = min(expected, -dual_clip * a)
        assert loss[i].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        low = r < 1.0 - clip_low and a < 0
        high = r > 1.0 + clip_high and a > 0
        dual = dual_clip is not None and a < 0 and -r * a > -dual_clip * a
        assert bool(clipped_low[i]) == low
        assert bool(clipped_high[i]) == (high or dual)
        # d/d log r of -r A is -r A where no clip binds (and the clamp does not), else 0
        inside = -20.0 <= lr <= 20.0 and not (low or high or dual)
        assert leaf.grad[i].item() == pytest.approx(-r * a if inside else 0.0, rel=1e-12, abs=1e-12)


def test_approx_kl_and_clip_fractions_golden():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    new, old = torch.tensor([[-1.0, -2.0, 50.0]]), torch.tensor([[-1.5, -2.0, 0.0]])
    # k3 of KL(old || new): log r = new - old; (e^{log r} - 1) - log r averaged over valid tokens
    expected = ((math.exp(0.5) - 1 - 0.5) + 0.0) / 2
    assert ops.approx_kl(new, old, mask).item() == pytest.approx(expected, abs=1e-6)
    fracs = ops.clip_fractions(
        torch.tensor([[True, False, True]]), torch.tensor([[False, False, True]]), mask
    )
    assert fracs["actor/clipfrac_low"].item() == pytest.approx(0.5)
    assert fracs["actor/clipfrac_high"].item() == pytest.approx(0.0)
    assert fracs["actor/clipfrac"].item() == pytest.approx(0.5)


# --------------------------------------------------------------------------- from logits


def test_entropy_and_logprobs_from_logits_golden():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])  # p = [1/4, 3/4] and [1/2, 1/2]
    entropy = ops.entropy_from_logits(logits)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy.flatten().tolist() == pytest.approx([h, math.log(2.0)], abs=1e-6)
    logprobs = ops.logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    assert logprobs.flatten().tolist() == pytest.approx([math.log(0.75), math.log(0.5)], abs=1e-6)


def test_entropy_ignores_masked_vocabulary_entries_and_stays_differentiable():
    # A vocabulary entry masked to -inf has probability 0: it adds nothing, and no NaN.
    logits = torch.tensor([[[0.0, float("-inf"), math.log(3.0)]]], requires_grad=True)
    entropy = ops.entropy_from_logits(logits)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy.item() == pytest.approx(h, abs=1e-6)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 1].item() == 0.0


def test_masked_whiten_and_var_use_only_real_entries():
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, -50.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # real entries 1, 3, 5: mean 3, unbiased variance ((-2)^2 + 0 + 2^2) / 2 = 4
    assert ops.masked_var(values, mask).item() == pytest.approx(4.0)
    assert ops.masked_var(values, mask, unbiased=False).item() == pytest.approx(8.0 / 3)
    whitened = ops.masked_whiten(values, mask, eps=0.0)
    assert whitened.flatten().tolist() == pytest.approx([-1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    scaled = ops.masked_whiten(values, mask, shift_mean=False, eps=0.0)
    assert scaled.flatten().tolist() == pytest.approx([0.5, 1.5, 0.0, 2.5, 0.0, 0.0])


def test_masked_kl_penalty_is_zero_and_gradient_free_on_padding():
    mask = torch.tensor([[1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    ref = torch.tensor([[-2.0, 0.0]])
    for estimator in ("k1", "k2", "k3"):
        kl = ops.masked_kl_penalty(logprobs, ref, mask, estimator)
        assert kl[0, 1].item() == 0.0
        assert kl[0, 0].item() == pytest.approx(
            ops.kl_penalty(logprobs[:, :1], ref[:, :1], estimator).item()
        )
        logprobs.grad = None
        kl.sum().backward()
        assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 1].item() == 0.0


def test_token_level_rewards_put_the_score_last_and_the_kl_everywhere():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.5, -1.0, 9.0], [2.0, 9.0, 9.0]])
    rewards = ops.token_level_rewards(torch.tensor([1.0, 3.0]), mask, kl, kl_coef=0.1)
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 1.1, 0.0, 2.8, 0.0, 0.0])


# --------------------------------------------------------------------------- chunked LM head


def _head_case(dtype: torch.dtype, seed: int = 0, rows: int = 3, width: int = 7, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, 5, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, 5, generator=g, dtype=dtype, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, width), generator=g)
    return hidden, weight, tokens


@pytest.mark.parametrize("chunk", [1, 4, 21, 100])
def test_the_chunked_head_gives_the_log_probs_entropy_and_gradients_of_the_whole_logits(chunk):
    hidden, weight, tokens = _head_case(torch.float64)
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)

    logp, ent = ops.logprobs_and_entropy(hidden @ weight.t(), tokens, entropy_grad=True)
    ref = torch.autograd.grad(
        (logp * up_lp).sum() + (ent * up_ent).sum(), [hidden, weight], retain_graph=True
    )
    c_logp, c_ent = ops.head_logprobs(hidden, weight, tokens, chunk, entropy="grad")
    got = torch.autograd.grad((c_logp * up_lp).sum() + (c_ent * up_ent).sum(), [hidden, weight])
    torch.testing.assert_close(c_logp, logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c_ent, ent, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(got, ref, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-10)
    # Log-probs alone, and with the entropy for metrics only (no gradient through it).
    only, none = ops.head_logprobs(hidden, weight, tokens, chunk)
    assert none is None
    (grad_h,) = torch.autograd.grad((only * up_lp).sum(), [hidden])
    (ref_h,) = torch.autograd.grad((logp * up_lp).sum(), [hidden])
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-10, atol=1e-10)
    _, detached = ops.head_logprobs(hidden, weight, tokens, chunk, entropy="detached")
    assert not detached.requires_grad
    torch.testing.assert_close(detached, ent.detach(), rtol=1e-12, atol=1e-12)


def test_the_chunked_head_passes_gradcheck():
    hidden, weight, tokens = _head_case(torch.float64, seed=2, rows=2, width=3, vocab=6)

    def both(h, w):
        return ops.head_logprobs(h, w, tokens, 4, entropy="grad")

    assert torch.autograd.gradcheck(both, (hidden, weight))


def test_the_chunked_head_keeps_no_logits_for_the_backward_pass():
    """What the backward pass keeps is the inputs and one number per position: nothing of the
    size of the logits (positions x vocabulary), which the unchunked path keeps twice."""
    hidden, weight, tokens = _head_case(torch.float32, rows=4, width=8, vocab=50)
    positions, vocab = tokens.numel(), weight.shape[0]

    def saved_sizes(fn):
        sizes: list[int] = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sizes

    chunked = saved_sizes(lambda: ops.head_logprobs(hidden, weight, tokens, 5, entropy="grad"))
    whole = saved_sizes(lambda: ops.logprobs_and_entropy(hidden @ weight.t(), tokens))
    assert max(whole) >= positions * vocab  # the premise: the plain path keeps logits
    assert max(chunked) < positions * vocab
    assert max(chunked) == max(hidden.numel(), weight.numel())


def direct_log_sum_sq(logits: torch.Tensor) -> torch.Tensor:
    """log Σ_v softmax(z)_v² straight from the definition."""
    return torch.log((torch.softmax(logits, dim=-1) ** 2).sum(-1))


@pytest.mark.parametrize("chunk", [1, 4, 21, 100])
def test_the_chunked_head_gives_log_sum_sq_probs_without_gradient(chunk):
    """log Σ_v p_v² from each chunk's logits (WPO's weights): the whole logits' value, no
    gradient through it, and the log-probs' and entropy's gradients as without it."""
    hidden, weight, tokens = _head_case(torch.float64, seed=3)
    logp, ent, sq = ops.head_token_outputs(
        hidden, weight, tokens, chunk, entropy="grad", log_sum_sq_probs=True
    )
    assert sq is not None and not sq.requires_grad
    torch.testing.assert_close(sq, direct_log_sum_sq(hidden @ weight.t()), rtol=1e-12, atol=1e-12)
    assert ent is not None
    got = torch.autograd.grad((logp * 0.7).sum() + (ent * 0.3).sum(), [hidden, weight])
    plain_logp, plain_ent = ops.head_logprobs(hidden, weight, tokens, chunk, entropy="grad")
    assert plain_ent is not None
    ref = torch.autograd.grad((plain_logp * 0.7).sum() + (plain_ent * 0.3).sum(), [hidden, weight])
    for mine, theirs in zip(got, ref, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    none = ops.head_token_outputs(hidden, weight, tokens, chunk)[2]
    assert none is None


def test_log_sum_sq_probs_of_whole_logits_in_chunks_of_positions(monkeypatch):
    """ops.token_outputs takes log Σ_v p_v² from its one log-softmax, a few positions at a time
    (ops.SQ_PROBS_AT_ONCE floats): the same numbers whatever the chunk; a token cut from the
    support (logit -inf) adds nothing."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 13, generator=g, dtype=torch.float64) * 3
    logits[0, 1, :4] = -math.inf  # top-k cut these
    tokens = torch.randint(4, 13, (3, 5), generator=g)
    expected = direct_log_sum_sq(logits)
    for at_once in (13, 13 * 4, 13 * 100):  # 1, 4 and every position at a time
        monkeypatch.setattr(ops, "SQ_PROBS_AT_ONCE", at_once)
        logp, ent, sq = ops.token_outputs(logits, tokens, "detached", log_sum_sq_probs=True)
        assert sq is not None and ent is not None
        torch.testing.assert_close(sq, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp, ops.logprobs_from_logits(logits, tokens))
    assert ops.token_outputs(logits, tokens)[1:] == (None, None)


def test_the_chunked_head_with_log_sum_sq_probs_keeps_no_logits():
    hidden, weight, tokens = _head_case(torch.float32, rows=4, width=8, vocab=50)
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ops.head_token_outputs(hidden, weight, tokens, 5, entropy="grad", log_sum_sq_probs=True)
    assert max(sizes) == max(hidden.numel(), weight.numel()) < tokens.numel() * 50
