"""DPO and its variants: properties of the loss, golden values, pairing, and an optimisation check."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import ValidationError

from alignzoo.errors import UserError
from alignzoo.plugins.algorithms import dpo
from alignzoo.plugins.algorithms.dpo import DPO, DPOParams, Pairs, pair_indices
from alignzoo.registry import build_plugin_manager
from alignzoo.testing import make_batch

from .pref_helpers import default_problem, neg_log_sigmoid, pair_batch, run_loss, train

LOSS_TYPES = ["sigmoid", "ipo", "hinge", "robust"]
seq_logp = st.floats(-60.0, 0.0, allow_nan=False)
margins = st.floats(-30.0, 30.0, allow_nan=False)
betas = st.floats(0.01, 1.0)


def loss_at(margin: float, beta: float = 0.1, **params) -> float:
    """The plugin's loss on one pair whose log-ratio margin h is ``margin`` (reference at 0)."""
    batch, outputs = pair_batch([margin / 2], [-margin / 2])
    return run_loss(DPO({"beta": beta, **params}), batch, outputs).loss.item()


# --------------------------------------------------------------------------- properties


@given(chosen=seq_logp, ref_chosen=seq_logp, shift=seq_logp)
def test_sigmoid_loss_is_log2_at_zero_margin(chosen, ref_chosen, shift):
    # chosen and rejected move equally away from the reference: h = 0 whatever the values
    rejected, ref_rejected = chosen + shift, ref_chosen + shift
    batch, outputs = pair_batch([chosen], [rejected], [ref_chosen], [ref_rejected])
    result = run_loss(DPO(), batch, outputs)
    assert result.loss.item() == pytest.approx(math.log(2.0), abs=1e-9)
    assert result.metrics["dpo/rewards/margin"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge"])
@given(h1=margins, h2=margins, beta=betas)
def test_loss_decreases_with_the_margin(loss_type, h1, h2, beta):
    assume(h2 - h1 > 1e-3)
    low, high = loss_at(h1, beta, loss_type=loss_type), loss_at(h2, beta, loss_type=loss_type)
    if loss_type == "hinge":  # flat at 0 past the margin 1/β, strictly decreasing before it
        assert high <= low
        if beta * h1 < 1.0:
            assert high < low
    else:
        assert high < low


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@given(chosen=seq_logp, rejected=seq_logp, ref_chosen=seq_logp, ref_rejected=seq_logp)
def test_swapping_chosen_and_rejected_gives_the_loss_at_minus_the_margin(
    loss_type, chosen, rejected, ref_chosen, ref_rejected
):
    algorithm = DPO({"loss_type": loss_type})
    batch, outputs = pair_batch([chosen], [rejected], [ref_chosen], [ref_rejected])
    batch.labels = 1.0 - batch.labels  # the rejected response is now the chosen one
    swapped = run_loss(algorithm, batch, outputs).loss.item()
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    assert swapped == pytest.approx(loss_at(-margin, loss_type=loss_type), rel=1e-9, abs=1e-9)


@given(beta=betas, h=st.floats(-50.0, 50.0))
def test_ipo_is_minimised_at_margin_one_over_two_beta(beta, h):
    best = 1.0 / (2.0 * beta)
    assert loss_at(best, beta, loss_type="ipo") == pytest.approx(0.0, abs=1e-12)
    assume(abs(h - best) > 1e-3)
    assert loss_at(h, beta, loss_type="ipo") > loss_at(best, beta, loss_type="ipo")
    # the gradient points towards the minimum from either side
    batch, outputs = pair_batch([h], [0.0])
    run_loss(DPO({"beta": beta, "loss_type": "ipo"}), batch, outputs).loss.backward()
    d_chosen = float(outputs.logprobs.grad[1, 0])
    assert (d_chosen < 0) == (h < best)


@given(h=margins, beta=betas, eps=st.floats(0.0, 0.49))
def test_label_smoothing_interpolates_between_the_two_directions(h, beta, eps):
    smoothed = loss_at(h, beta, label_smoothing=eps)
    forward, backward = loss_at(h, beta), loss_at(-h, beta)
    assert smoothed == pytest.approx((1 - eps) * forward + eps * backward, rel=1e-9, abs=1e-9)
    # and lies between the two directions
    assert min(forward, backward) - 1e-9 <= smoothed <= max(forward, backward) + 1e-9


@given(h=margins, beta=betas, eps=st.floats(0.0, 0.45))
def test_robust_loss_is_the_debiased_combination(h, beta, eps):
    robust = loss_at(h, beta, loss_type="robust", label_smoothing=eps)
    forward, backward = loss_at(h, beta), loss_at(-h, beta)
    assert robust == pytest.approx(((1 - eps) * forward - eps * backward) / (1 - 2 * eps), rel=1e-7)
    if eps == 0.0:
        assert robust == pytest.approx(forward, rel=1e-12)


def test_gradient_raises_chosen_and_lowers_rejected():
    batch, outputs = pair_batch([-2.0, -1.0], [-1.0, -3.0], [-1.5, -1.0], [-1.0, -1.0])
    run_loss(DPO(), batch, outputs).loss.backward()
    grad = outputs.logprobs.grad[:, 0]
    labels = batch.labels
    assert (grad[labels == 1.0] < 0).all()  # gradient descent raises chosen log-probs
    assert (grad[labels == 0.0] > 0).all()  # and lowers rejected ones
    assert outputs.logprobs.grad is not None


# --------------------------------------------------------------------------- golden values


def golden_batch(dtype=torch.float64):
    """Two pairs with padding, shuffled: rows [B rejected, A chosen, B chosen, A rejected].

    Pair A (group 7): π(chosen) = -0.5 - 1.0 = -1.5, π(rejected) = -2.0 - 0.25 - 1.5 = -3.75,
    π_ref(chosen) = -2.0, π_ref(rejected) = -3.0. Pair B (group 3): π(chosen) = -3.0,
    π(rejected) = -0.5 - 0.5 = -1.0, π_ref(chosen) = -2.0, π_ref(rejected) = -1.0 - 0.5 = -1.5.
    Padding holds -7.0 (policy) and -9.0 (reference), which must be ignored.
    """
    pad, rpad = -7.0, -9.0
    logprobs = [[-0.5, -0.5, pad], [-0.5, -1.0, pad], [-3.0, pad, pad], [-2.0, -0.25, -1.5]]
    ref = [[-1.0, -0.5, rpad], [-1.0, -1.0, rpad], [-2.0, rpad, rpad], [-1.0, -1.0, -1.0]]
    mask = [[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
    return make_batch(
        logprobs,
        mask=mask,
        ref_logprobs=ref,
        labels=[0.0, 1.0, 1.0, 0.0],
        group_ids=[3, 7, 3, 7],
        dtype=dtype,
    )


# log-ratios: A: chosen -1.5 - (-2.0) = 0.5, rejected -3.75 - (-3.0) = -0.75, h_A = 1.25
#             B: chosen -3.0 - (-2.0) = -1.0, rejected -1.0 - (-1.5) = 0.5,   h_B = -1.5
H_A, H_B = 1.25, -1.5


def test_golden_sigmoid():
    batch, outputs = golden_batch()
    result = run_loss(DPO({"beta": 0.1}), batch, outputs)
    expected = (neg_log_sigmoid(0.1 * H_A) + neg_log_sigmoid(0.1 * H_B)) / 2
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)
    m = result.metrics
    assert m["dpo/loss"] == pytest.approx(expected, abs=1e-6)
    assert m["dpo/rewards/chosen"] == pytest.approx(0.1 * (0.5 + -1.0) / 2, abs=1e-6)
    assert m["dpo/rewards/rejected"] == pytest.approx(0.1 * (-0.75 + 0.5) / 2, abs=1e-6)
    assert m["dpo/rewards/margin"] == pytest.approx(0.1 * (H_A + H_B) / 2, abs=1e-6)
    assert m["dpo/rewards/accuracy"] == pytest.approx(0.5)  # A is ranked right, B wrong
    assert m["dpo/logps/chosen"] == pytest.approx((-1.5 + -3.0) / 2, abs=1e-6)
    assert m["dpo/logps/rejected"] == pytest.approx((-3.75 + -1.0) / 2, abs=1e-6)


def test_golden_cdpo():
    batch, outputs = golden_batch()
    result = run_loss(DPO({"beta": 0.5, "label_smoothing": 0.2}), batch, outputs)
    per_pair = [
        0.8 * neg_log_sigmoid(0.5 * h) + 0.2 * neg_log_sigmoid(-0.5 * h) for h in (H_A, H_B)
    ]
    assert result.loss.item() == pytest.approx(sum(per_pair) / 2, abs=1e-6)


def test_golden_ipo():
    batch, outputs = golden_batch()
    result = run_loss(DPO({"beta": 0.25, "loss_type": "ipo"}), batch, outputs)
    # target margin 1/(2β) = 2.0
    expected = ((H_A - 2.0) ** 2 + (H_B - 2.0) ** 2) / 2  # (0.5625 + 12.25) / 2
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)


def test_golden_hinge():
    batch, outputs = golden_batch()
    result = run_loss(DPO({"beta": 0.5, "loss_type": "hinge"}), batch, outputs)
    expected = (max(0.0, 1 - 0.5 * H_A) + max(0.0, 1 - 0.5 * H_B)) / 2  # (0.375 + 1.75) / 2
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)
    result = run_loss(DPO({"beta": 2.0, "loss_type": "hinge"}), batch, outputs)
    assert result.loss.item() == pytest.approx((0.0 + 4.0) / 2, abs=1e-6)  # pair A past the margin


def test_golden_robust():
    batch, outputs = golden_batch()
    result = run_loss(
        DPO({"beta": 0.1, "loss_type": "robust", "label_smoothing": 0.1}), batch, outputs
    )
    per_pair = [
        (0.9 * neg_log_sigmoid(0.1 * h) - 0.1 * neg_log_sigmoid(-0.1 * h)) / (1 - 2 * 0.1)
        for h in (H_A, H_B)
    ]
    assert result.loss.item() == pytest.approx(sum(per_pair) / 2, abs=1e-6)


def test_golden_reference_free():
    batch, outputs = golden_batch()
    batch.ref_logprobs = None  # not needed, and not loaded
    result = run_loss(DPO({"beta": 0.1, "reference_free": True}), batch, outputs)
    h_a, h_b = -1.5 - -3.75, -3.0 - -1.0  # π(chosen) - π(rejected): 2.25, -2.0
    expected = (neg_log_sigmoid(0.1 * h_a) + neg_log_sigmoid(0.1 * h_b)) / 2
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)
    assert result.metrics["dpo/rewards/chosen"] == pytest.approx(0.1 * (-1.5 + -3.0) / 2, abs=1e-6)


def test_golden_weights_average_over_the_pair():
    batch, outputs = golden_batch()
    batch.weights = torch.tensor([1.0, 0.5, 3.0, 1.5], dtype=torch.float64)
    result = run_loss(DPO({"beta": 0.1}), batch, outputs)
    w_a, w_b = (0.5 + 1.5) / 2, (1.0 + 3.0) / 2
    expected = (w_a * neg_log_sigmoid(0.1 * H_A) + w_b * neg_log_sigmoid(0.1 * H_B)) / 2
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)


def test_float32_matches_the_golden_value():
    batch, outputs = golden_batch(dtype=torch.float32)
    result = run_loss(DPO({"beta": 0.1}), batch, outputs)
    assert result.loss.dtype == torch.float32
    expected = (neg_log_sigmoid(0.1 * H_A) + neg_log_sigmoid(0.1 * H_B)) / 2
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)


def test_pure_function_matches_the_plugin():
    pairs = Pairs(
        torch.tensor([-1.5, -3.0]),
        torch.tensor([-3.75, -1.0]),
        torch.tensor([-2.0, -2.0]),
        torch.tensor([-3.0, -1.5]),
        chosen_lengths=torch.ones(2),
        rejected_lengths=torch.ones(2),
    )
    losses = dpo.LOSS_TYPES["sigmoid"].loss(pairs, DPOParams(beta=0.1))
    chosen_r, rejected_r = pairs.rewards(0.1)
    assert losses.tolist() == pytest.approx(
        [neg_log_sigmoid(0.125), neg_log_sigmoid(-0.15)], abs=1e-6
    )
    assert chosen_r.tolist() == pytest.approx([0.05, -0.1], abs=1e-7)
    assert rejected_r.tolist() == pytest.approx([-0.075, 0.05], abs=1e-7)


# --------------------------------------------------------------------------- pairing and errors


def test_pairs_are_matched_by_group_not_position():
    chosen, rejected = pair_indices(
        torch.tensor([5, 2, 2, 5, 9, 9]), torch.tensor([0.0, 1, 0, 1, 0, 1])
    )
    assert chosen.tolist() == [1, 3, 5]  # groups 2, 5, 9 in order
    assert rejected.tolist() == [2, 0, 4]


@pytest.mark.parametrize(
    ("groups", "labels", "message"),
    [
        ([0, 0, 1, 1], [1.0, 1.0, 0.0, 0.0], "group 0"),
        ([0, 0, 0], [1.0, 0.0, 0.0], "2 rejected"),
        ([0, 1], [1.0, 0.0], "group 0"),
        ([0, 0], [1.0, 0.5], "row 1"),
    ],
)
def test_malformed_pairs_are_a_clear_error(groups, labels, message):
    batch, outputs = make_batch(
        [[-1.0]] * len(groups), group_ids=groups, labels=labels, ref_logprobs=[[-1.0]] * len(groups)
    )
    with pytest.raises(UserError, match=message):
        run_loss(DPO(), batch, outputs)


def test_missing_labels_and_reference_are_clear_errors():
    batch, outputs = make_batch([[-1.0], [-2.0]], group_ids=[0, 0], ref_logprobs=[[-1.0], [-1.0]])
    with pytest.raises(UserError, match=r"batch\.labels"):
        run_loss(DPO(), batch, outputs)
    batch, outputs = make_batch([[-1.0], [-2.0]], group_ids=[0, 0], labels=[1.0, 0.0])
    with pytest.raises(UserError, match="reference_free"):
        run_loss(DPO(), batch, outputs)


def test_params_are_validated():
    with pytest.raises(ValidationError, match="label_smoothing"):
        DPO({"loss_type": "ipo", "label_smoothing": 0.1})
    with pytest.raises(ValidationError):
        DPO({"label_smoothing": 0.5})
    with pytest.raises(ValidationError):
        DPO({"beta": 0.0})
    with pytest.raises(ValidationError):
        DPO({"betta": 0.1})
    assert DPO().params.beta == 0.1


def test_requirements_follow_reference_free():
    assert build_plugin_manager([DPO()]).hook.algorithm_requirements().reference is True
    req = build_plugin_manager([DPO({"reference_free": True})]).hook.algorithm_requirements()
    assert req.reference is False
    assert req.data == "preference"


def test_compute_advantages_returns_the_batch_unchanged():
    batch, _ = golden_batch()
    assert build_plugin_manager([DPO()]).hook.compute_advantages(batch=batch) is batch


# --------------------------------------------------------------------------- optimisation


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"label_smoothing": 0.1},
        {"loss_type": "ipo", "beta": 0.5},
        {"loss_type": "hinge", "beta": 0.5},
        {"loss_type": "robust", "label_smoothing": 0.1},
        {"reference_free": True},
    ],
)
def test_training_raises_chosen_over_rejected_and_lowers_the_loss(params):
    problem = default_problem()
    losses, initial, final = train(DPO(params), problem)
    labels = torch.tensor(problem.labels)
    groups = torch.tensor(problem.group_ids)
    chosen, rejected = pair_indices(groups, labels)
    gap_before = initial[chosen] - initial[rejected]
    gap_after = final[chosen] - final[rejected]
    assert (gap_after > gap_before + 0.5).all(), (gap_before, gap_after)
    assert losses[-1] < losses[0] - 0.05
