"""KTO: monotonicity, the reference point z0, the weight-ratio warning, golden values, optimisation."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import ValidationError

from alignzoo.errors import UserError
from alignzoo.plugins.algorithms.kto import KTO, kto_reference_point
from alignzoo.registry import build_plugin_manager
from alignzoo.testing import make_batch

from .pref_helpers import default_problem, run_loss, sigmoid, train

ratios = st.floats(-30.0, 30.0, allow_nan=False)


def golden_batch(mismatched=(-3.0, -2.0, -4.0, -1.0)):
    """Four samples (two desirable), one padded token (-8.0 / -6.0 on padding).

    Sequence log-ratios r = log π - log π_ref:
      row 0 desirable:   (-1.0 - 0.5) - (-1.0 - 1.0) = 0.5
      row 1 undesirable: (-2.0) - (-1.0)             = -1.0
      row 2 desirable:   (-3.0 - 1.0) - (-2.0 - 1.5) = -0.5
      row 3 undesirable: (-0.5 - 0.5) - (-1.0 - 1.0) = 1.0
    Mismatched log-ratios (default): (-3.0+3.5, -2.0+2.0, -4.0+3.0, -1.0+2.5) = (0.5, 0, -1, 1.5),
    mean 0.25, so z0 = 0.25.
    """
    logprobs = [[-1.0, -0.5], [-2.0, -8.0], [-3.0, -1.0], [-0.5, -0.5]]
    ref = [[-1.0, -1.0], [-1.0, -6.0], [-2.0, -1.5], [-1.0, -1.0]]
    return make_batch(
        logprobs,
        mask=[[1, 1], [1, 0], [1, 1], [1, 1]],
        ref_logprobs=ref,
        labels=[1.0, 0.0, 1.0, 0.0],
        mismatched_logprobs=list(mismatched),
        mismatched_ref_logprobs=[-3.5, -2.0, -3.0, -2.5],
        dtype=torch.float64,
    )


R = [0.5, -1.0, -0.5, 1.0]
DESIRABLE = [True, False, True, False]


def expected_loss(beta: float, z0: float, w_d: float = 1.0, w_u: float = 1.0) -> float:
    per_sample = [
        w_d * (1 - sigmoid(beta * (r - z0))) if good else w_u * (1 - sigmoid(beta * (z0 - r)))
        for r, good in zip(R, DESIRABLE, strict=True)
    ]
    return sum(per_sample) / len(per_sample)


# --------------------------------------------------------------------------- golden values


def test_golden_default_params():
    batch, outputs = golden_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 1·2 / (1·2) = 1 is inside [1, 4/3]: no warning
        result = run_loss(KTO(), batch, outputs)
    assert result.loss.item() == pytest.approx(expected_loss(0.1, 0.25), abs=1e-6)
    m = result.metrics
    assert m["kto/z0"] == pytest.approx(0.25, abs=1e-9)
    assert m["kto/loss"] == pytest.approx(expected_loss(0.1, 0.25), abs=1e-6)
    assert m["kto/rewards/chosen"] == pytest.approx(0.1 * (0.5 + -0.5) / 2, abs=1e-9)
    assert m["kto/rewards/rejected"] == pytest.approx(0.1 * (-1.0 + 1.0) / 2, abs=1e-9)
    assert m["kto/rewards/margin"] == pytest.approx(0.0, abs=1e-9)
    assert m["kto/weight_ratio"] == pytest.approx(1.0)
    assert m["kto/weight_ratio_outside_range"] == 0.0


def test_golden_weights_and_beta():
    batch, outputs = golden_batch()
    params = {"beta": 1.0, "desirable_weight": 2.0, "undesirable_weight": 1.5}
    result = run_loss(KTO(params), batch, outputs)  # ratio 2·2 / (1.5·2) = 4/3: in range
    assert result.loss.item() == pytest.approx(expected_loss(1.0, 0.25, 2.0, 1.5), abs=1e-6)
    assert result.metrics["kto/weight_ratio_outside_range"] == 0.0


def test_golden_z0_is_clamped_at_zero():
    batch, outputs = golden_batch(mismatched=(-4.0, -3.0, -4.0, -3.0))  # mean log-ratio -0.875
    result = run_loss(KTO({"beta": 0.5}), batch, outputs)
    assert result.metrics["kto/z0"] == 0.0
    assert result.loss.item() == pytest.approx(expected_loss(0.5, 0.0), abs=1e-6)


def test_golden_sample_weights():
    batch, outputs = golden_batch()
    batch.weights = torch.tensor([1.0, 2.0, 0.0, 0.5], dtype=torch.float64)
    result = run_loss(KTO({"beta": 1.0}), batch, outputs)
    z0 = 0.25
    expected = (
        1.0 * (1 - sigmoid(0.5 - z0))
        + 2.0 * (1 - sigmoid(z0 - -1.0))
        + 0.0
        + 0.5 * (1 - sigmoid(z0 - 1.0))
    ) / 4
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)


def test_reference_point_function():
    z0 = kto_reference_point(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.5]))
    assert z0.item() == pytest.approx(0.75)
    assert kto_reference_point(torch.tensor([-3.0]), torch.tensor([-1.0])).item() == 0.0


# --------------------------------------------------------------------------- properties


def one_sample_loss(r: float, desirable: bool, z0_shift: float = 0.3) -> float:
    """Loss of a batch where sample 0 has log-ratio r (and a fixed companion sample 1)."""
    batch, outputs = make_batch(
        [[r - 2.0], [-1.0]],
        ref_logprobs=[[-2.0], [-1.5]],
        labels=[1.0 if desirable else 0.0, 0.0 if desirable else 1.0],
        mismatched_logprobs=[-2.0 + z0_shift, -1.0],
        mismatched_ref_logprobs=[-2.0, -1.0 - z0_shift],
        dtype=torch.float64,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_loss(KTO(), batch, outputs).loss.item()


@given(r1=ratios, r2=ratios)
def test_desirable_loss_falls_and_undesirable_loss_rises_with_the_log_ratio(r1, r2):
    assume(r2 - r1 > 1e-3)
    assert one_sample_loss(r2, desirable=True) < one_sample_loss(r1, desirable=True)
    assert one_sample_loss(r2, desirable=False) > one_sample_loss(r1, desirable=False)


@given(
    r=ratios,
    mismatched=st.lists(st.floats(-20.0, 0.0), min_size=2, max_size=2),
    desirable=st.booleans(),
)
def test_z0_receives_no_gradient(r, mismatched, desirable):
    batch, outputs = make_batch(
        [[r - 2.0], [-1.0]],
        ref_logprobs=[[-2.0], [-1.5]],
        labels=[float(desirable), float(not desirable)],
        mismatched_logprobs=mismatched,
        mismatched_ref_logprobs=[-10.0, -10.0],  # mismatched log-ratios mostly > 0: z0 > 0
        dtype=torch.float64,
    )
    leaf = batch.columns["mismatched_logprobs"].requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_loss(KTO(), batch, outputs)
    result.loss.backward()
    grad = leaf.grad
    assert grad is None or bool((grad == 0).all())
    assert outputs.logprobs.grad is not None
    assert result.metrics["kto/z0"] == pytest.approx(max(0.0, sum(mismatched) / 2 + 10.0))


def test_z0_enters_the_loss():
    # sample 0: desirable, r = 0; sample 1: undesirable, r = 0.5; z0 = 2.0 from the mismatched pairs
    loss = one_sample_loss(0.0, desirable=True, z0_shift=2.0)
    expected = ((1 - sigmoid(0.1 * (0.0 - 2.0))) + (1 - sigmoid(0.1 * (2.0 - 0.5)))) / 2
    assert loss == pytest.approx(expected, abs=1e-9)
    assert loss != pytest.approx(one_sample_loss(0.0, desirable=True, z0_shift=0.0), abs=1e-6)


# --------------------------------------------------------------------------- warning and errors


@pytest.mark.parametrize(
    ("labels", "params", "ratio"),
    [
        ([1.0, 1.0, 1.0, 0.0], {}, 3.0),
        ([1.0, 0.0, 0.0, 0.0], {}, 1 / 3),
        ([1.0, 0.0, 1.0, 0.0], {"desirable_weight": 2.0}, 2.0),
    ],
)
def test_weight_ratio_outside_the_recommended_range_warns(labels, params, ratio):
    batch, outputs = golden_batch()
    batch.labels = torch.tensor(labels, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"\[1, 4/3\]"):
        result = run_loss(KTO(params), batch, outputs)
    assert result.metrics["kto/weight_ratio"] == pytest.approx(ratio)
    assert result.metrics["kto/weight_ratio_outside_range"] == 1.0


def test_single_kind_batch_reports_no_ratio_and_finite_metrics():
    batch, outputs = golden_batch()
    batch.labels = torch.ones(4, dtype=torch.float64)
    result = run_loss(KTO(), batch, outputs)
    assert "kto/weight_ratio" not in result.metrics
    assert "kto/rewards/rejected" not in result.metrics
    assert result.metrics["kto/rewards/chosen"] == pytest.approx(0.1 * sum(R) / 4)


def test_missing_inputs_are_clear_errors():
    batch, outputs = golden_batch()
    del batch.columns["mismatched_ref_logprobs"]
    with pytest.raises(UserError, match="mismatched"):
        run_loss(KTO(), batch, outputs)
    batch, outputs = golden_batch()
    batch.labels = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    with pytest.raises(UserError, match="row 2"):
        run_loss(KTO(), batch, outputs)
    batch, outputs = golden_batch()
    batch.ref_logprobs = None
    with pytest.raises(UserError, match="ref_logprobs"):
        run_loss(KTO(), batch, outputs)


def test_requirements_and_params():
    req = build_plugin_manager([KTO()]).hook.algorithm_requirements()
    assert (req.reference, req.data) == (True, "unpaired")
    assert KTO().params.beta == 0.1
    assert (KTO().params.desirable_weight, KTO().params.undesirable_weight) == (1.0, 1.0)
    with pytest.raises(ValidationError):
        KTO({"desirable_weight": 0.0})
    with pytest.raises(ValidationError):
        KTO({"lambda_d": 1.0})


# --------------------------------------------------------------------------- optimisation


def test_training_raises_desirable_and_lowers_undesirable_log_probs():
    problem = default_problem()
    losses, initial, final = train(KTO({"beta": 0.5}), problem, steps=40)
    labels = torch.tensor(problem.labels)
    change = final - initial
    assert (change[labels == 1.0] > 0.5).all(), change
    assert (change[labels == 0.0] < -0.5).all(), change
    assert losses[-1] < losses[0] - 0.05
