"""SimPO: length-normalised reward, target margin, no reference; golden values and optimisation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import ValidationError

from alignzoo.errors import UserError
from alignzoo.plugins.algorithms.dpo import pair_indices
from alignzoo.plugins.algorithms.simpo import SimPO
from alignzoo.registry import build_plugin_manager
from alignzoo.testing import make_batch

from .pref_helpers import default_problem, neg_log_sigmoid, run_loss, sigmoid, train

token_logp = st.floats(-20.0, 0.0, allow_nan=False)


def constant_pair(a: float, n: int, b: float, m: int, width: int = 6):
    """One pair: chosen = n tokens of log-prob a, rejected = m tokens of log-prob b (padded)."""
    pad = -11.0
    rows = [
        [a if t < n else pad for t in range(width)],
        [b if t < m else pad for t in range(width)],
    ]
    mask = [[float(t < n) for t in range(width)], [float(t < m) for t in range(width)]]
    return make_batch(rows, mask=mask, labels=[1.0, 0.0], group_ids=[4, 4], dtype=torch.float64)


@given(
    a=token_logp,
    b=token_logp,
    n=st.integers(1, 6),
    m=st.integers(1, 6),
    k=st.integers(1, 6),
    beta=st.floats(0.5, 5.0),
    ratio=st.floats(0.0, 1.5),
)
def test_loss_depends_on_average_not_length(a, b, n, m, k, beta, ratio):
    algorithm = SimPO({"beta": beta, "gamma_beta_ratio": ratio})
    short = run_loss(algorithm, *constant_pair(a, n, b, m)).loss.item()
    other = run_loss(algorithm, *constant_pair(a, k, b, 7 - k, width=7)).loss.item()
    expected = neg_log_sigmoid(beta * (a - b) - ratio * beta)  # -log σ(β(ā - b̄) - γ)
    assert short == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert other == pytest.approx(short, rel=1e-9, abs=1e-12)


@given(a=token_logp, beta=st.floats(0.5, 5.0), ratio=st.floats(0.0, 1.5))
def test_equal_rewards_cost_the_target_margin(a, beta, ratio):
    loss = run_loss(SimPO({"beta": beta, "gamma_beta_ratio": ratio}), *constant_pair(a, 2, a, 5))
    assert loss.loss.item() == pytest.approx(math.log1p(math.exp(ratio * beta)), rel=1e-9)


@given(a1=token_logp, a2=token_logp, b=token_logp)
def test_loss_decreases_as_chosen_average_rises(a1, a2, b):
    assume(a2 - a1 > 1e-3)
    low = run_loss(SimPO(), *constant_pair(a1, 3, b, 2)).loss.item()
    high = run_loss(SimPO(), *constant_pair(a2, 3, b, 2)).loss.item()
    assert high < low


def golden_batch():
    """Two shuffled pairs with padding (pad values -9.0 must be ignored).

    Group 1: chosen [-1.0, -2.0, -3.0] (mean -2.0), rejected [-1.0] (mean -1.0).
    Group 0: chosen [-0.5, -1.5] (mean -1.0), rejected [-4.0, -2.0, -3.0] (mean -3.0).
    """
    p = -9.0
    logprobs = [[-4.0, -2.0, -3.0], [-1.0, -2.0, -3.0], [-1.0, p, p], [-0.5, -1.5, p]]
    mask = [[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    return make_batch(
        logprobs,
        mask=mask,
        labels=[0.0, 1.0, 0.0, 1.0],
        group_ids=[0, 1, 1, 0],
        ref_logprobs=[[-100.0] * 3] * 4,  # SimPO ignores a reference even when one is given
        dtype=torch.float64,
    )


def test_golden_simpo():
    batch, outputs = golden_batch()
    result = run_loss(SimPO(), batch, outputs)  # β = 2.0, γ/β = 0.5 so γ = 1.0
    z_group1 = 2.0 * -2.0 - 2.0 * -1.0 - 1.0  # = -3.0
    z_group0 = 2.0 * -1.0 - 2.0 * -3.0 - 1.0  # = 3.0
    expected = (neg_log_sigmoid(z_group1) + neg_log_sigmoid(z_group0)) / 2
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)
    m = result.metrics
    assert m["simpo/loss"] == pytest.approx(expected, abs=1e-6)
    assert m["simpo/rewards/chosen"] == pytest.approx((2.0 * -1.0 + 2.0 * -2.0) / 2, abs=1e-6)
    assert m["simpo/rewards/rejected"] == pytest.approx((2.0 * -3.0 + 2.0 * -1.0) / 2, abs=1e-6)
    assert m["simpo/rewards/margin"] == pytest.approx((4.0 + -2.0) / 2, abs=1e-6)
    assert m["simpo/rewards/accuracy"] == pytest.approx(0.5)
    assert m["simpo/logps/chosen"] == pytest.approx((-1.0 + -2.0) / 2, abs=1e-6)


def test_golden_gradient_is_length_normalised():
    batch, outputs = golden_batch()
    run_loss(SimPO({"beta": 2.5, "gamma_beta_ratio": 0.4}), batch, outputs).loss.backward()
    z_group0 = 2.5 * -1.0 - 2.5 * -3.0 - 1.0  # γ = 0.4 * 2.5 = 1.0; z = 4.0
    # d/dz of -log σ(z) is -σ(-z); each chosen token of group 0 (2 tokens) moves z by β/2;
    # the loss is a mean over 2 pairs.
    expected = -sigmoid(-z_group0) * 2.5 / 2 / 2
    grad = outputs.logprobs.grad
    assert grad[3, 0].item() == pytest.approx(expected, abs=1e-9)
    assert grad[3, 1].item() == pytest.approx(expected, abs=1e-9)
    assert grad[3, 2].item() == 0.0  # padding
    assert grad[0].tolist() == pytest.approx([-expected * 2 / 3] * 3, abs=1e-9)  # 3 rejected tokens


def test_golden_weights():
    batch, outputs = golden_batch()
    batch.weights = torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    result = run_loss(SimPO(), batch, outputs)
    expected = (1.0 * neg_log_sigmoid(-3.0) + 1.0 * neg_log_sigmoid(3.0)) / 2  # both pairs w = 1
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)


def test_requirements_and_params():
    req = build_plugin_manager([SimPO()]).hook.algorithm_requirements()
    assert req.reference is False
    assert req.data == "preference"
    assert SimPO().params.beta == 2.0
    assert SimPO().params.gamma_beta_ratio == 0.5
    with pytest.raises(ValidationError):
        SimPO({"gamma": 1.0})
    with pytest.raises(ValidationError):
        SimPO({"beta": -1.0})


def test_missing_labels_is_a_clear_error():
    batch, outputs = make_batch([[-1.0], [-2.0]], group_ids=[0, 0])
    with pytest.raises(UserError, match=r"SimPO needs batch\.labels"):
        run_loss(SimPO(), batch, outputs)


def test_training_raises_chosen_over_rejected_and_lowers_the_loss():
    problem = default_problem()
    losses, initial, final = train(SimPO(), problem)
    chosen, rejected = pair_indices(torch.tensor(problem.group_ids), torch.tensor(problem.labels))
    lengths = problem.mask.sum(-1)
    gap_before = initial[chosen] / lengths[chosen] - initial[rejected] / lengths[rejected]
    gap_after = final[chosen] / lengths[chosen] - final[rejected] / lengths[rejected]
    assert (gap_after > gap_before + 0.5).all(), (gap_before, gap_after)
    assert losses[-1] < losses[0] - 0.1
