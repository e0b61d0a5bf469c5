"""GRPO's surrogates besides PPO's clip (``surrogate``: cispo, sapo, luspo, vespo): the contract
suite, refused param combinations, and each surrogate's defining property against its paper's
formula. Parity with TRL's loss types is in tests/parity/test_trl_grpo_loss_types.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from alignzoo.batch import RolloutBatch
from alignzoo.plugin import hookimpl
from alignzoo.plugins.algorithms.grpo import GRPO, GRPOParams
from alignzoo.testing import check_algorithm, make_batch
from alignzoo.types import LossOutput

FAST = settings(max_examples=40, deadline=None)
F64 = torch.float64

VARIANTS = [
    {"surrogate": "cispo", "loss_aggregation": "token-mean"},  # TRL's cispo
    {"surrogate": "cispo", "cispo_ratio_max": 1.5, "importance_ratio": "sequence"},
    {"surrogate": "sapo"},  # TRL's sapo
    {"surrogate": "sapo", "importance_ratio": "sequence", "sapo_temperature_neg": 2.0},
    {"surrogate": "luspo", "importance_ratio": "sequence"},  # TRL's luspo
    {"surrogate": "vespo", "loss_aggregation": "token-mean"},  # TRL's vespo
    {"surrogate": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_neg": 4.0, "beta": 0.0},
]


def variant_id(params: dict[str, Any]) -> str:
    return "-".join(str(v) for v in params.values())


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("params", VARIANTS, ids=variant_id)
def test_each_surrogate_passes_the_contract_suite(params: dict[str, Any]) -> None:
    results = check_algorithm(GRPO(params), max_examples=15)
    failed = [r.detail for r in results if not r.passed]
    assert not failed, "\n".join(failed)
    names = {r.name for r in results}
    assert {"direction", "weights_honoured", "micro_batch_invariance"} <= names


def flipped_loss(params: dict[str, Any]) -> GRPO:
    class FlippedLoss(GRPO):
        @hookimpl
        def compute_loss(self, batch: RolloutBatch, outputs: Any, context: Any) -> LossOutput:
            out = super().compute_loss(batch, outputs, context)
            return LossOutput(-out.loss, out.metrics)

    return FlippedLoss(params)


def flipped_advantages(params: dict[str, Any]) -> GRPO:
    class FlippedAdvantages(GRPO):
        @hookimpl
        def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
            batch = super().compute_advantages(batch)
            assert batch.advantages is not None
            batch.advantages = -batch.advantages
            return batch

    return FlippedAdvantages(params)


@pytest.mark.parametrize("flip", [flipped_loss, flipped_advantages])
@pytest.mark.parametrize("params", VARIANTS[::2], ids=variant_id)
def test_a_flipped_sign_fails_the_direction_check(params: dict[str, Any], flip: Any) -> None:
    [result] = [r for r in check_algorithm(flip(params), max_examples=15, checks=["direction"])
                if r.name == "direction"]  # fmt: skip
    assert not result.passed
    assert result.detail.startswith("direction: a gradient step on the loss ")


@pytest.mark.parametrize("params", VARIANTS, ids=variant_id)
def test_params_survive_a_dump_and_reload(params: dict[str, Any]) -> None:
    dumped = GRPO(params).params.model_dump(mode="json")
    assert GRPO(dumped).params == GRPO(params).params


def test_the_default_is_still_the_clip_surrogate() -> None:
    params = GRPOParams()
    assert params.surrogate == "clip" and params.loss_aggregation == "seq-mean-token-mean"
    assert (params.clip_eps_low, params.clip_eps_high, params.beta) == (0.2, 0.2, 0.04)


# --------------------------------------------------------------------------- refused params


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"surrogate": "luspo"}, "surrogate 'luspo' .* set importance_ratio: sequence"),
        (
            {
                "surrogate": "luspo",
                "importance_ratio": "sequence",
                "loss_aggregation": "token-mean",
            },
            "keep loss_aggregation: seq-mean-token-mean, not 'token-mean'",
        ),
        (
            {"surrogate": "vespo", "importance_ratio": "sequence"},
            "surrogate 'vespo' computes its own sequence ratio .* keep importance_ratio: token",
        ),
        (
            {"surrogate": "cispo", "clip_eps_high": 5.0},
            "clip_eps_high is read only by surrogate clip / luspo, not by 'cispo'.*"
            "cispo_ratio_max \\(TRL's epsilon_high\\)",
        ),
        (
            {"sapo_temperature_neg": 2.0},
            "sapo_temperature_neg is read only by surrogate sapo, not by 'clip'.*surrogate: sapo",
        ),
        ({"surrogate": "sapo", "vespo_k_pos": 1.0}, "vespo_k_pos is read only by surrogate vespo"),
        ({"surrogate": "vespo", "cispo_ratio_max": 2.0}, "cispo_ratio_max is read only by"),
        ({"surrogate": "sapo", "sapo_temperature_pos": 0.0}, "greater than 0"),
        ({"surrogate": "vespo", "vespo_lambda_neg": -1.0}, "greater than 0"),
        ({"surrogate": "cispo", "cispo_ratio_max": 0.0}, "greater than 0"),
        ({"surrogate": "ppo"}, "'clip', 'cispo', 'sapo', 'luspo' or 'vespo'"),
    ],
)
def test_bad_combinations_are_refused_clearly(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GRPO(params)


# --------------------------------------------------------------------------- properties


def loss_and_grad(
    params: dict[str, Any],
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old: float = -1.0,
) -> tuple[LossOutput, torch.Tensor]:
    """GRPO's loss on one optimizer step whose policy is ``old + log_ratio`` (float64); the
    sequence ``advantages`` ``[B]`` go on every response token. Returns it and d loss / d logp."""
    mask = torch.ones_like(log_ratio) if mask is None else mask
    old_logprobs = torch.full_like(log_ratio, old)
    batch, outputs = make_batch(
        old_logprobs + log_ratio,
        mask=mask,
        old_logprobs=old_logprobs,
        advantages=advantages.unsqueeze(1) * mask,
        dtype=F64,
    )
    out = GRPO({"beta": 0.0, **params}).compute_loss(batch, outputs, batch.loss_context())
    out.loss.backward()
    assert outputs.logprobs.grad is not None
    return out, outputs.logprobs.grad


@st.composite
def off_policy(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-ratios ``[B, R]`` in [-2, 2], sequence advantages ``[B]``, right-padded mask)."""
    b, r = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    ratios = draw(st.lists(st.floats(-2.0, 2.0), min_size=b * r, max_size=b * r))
    advantages = draw(st.lists(st.floats(-3.0, 3.0), min_size=b, max_size=b))
    lengths = draw(st.lists(st.integers(1, r), min_size=b, max_size=b))
    mask = (torch.arange(r) < torch.tensor(lengths).unsqueeze(1)).to(F64)
    return torch.tensor(ratios, dtype=F64).reshape(b, r), torch.tensor(advantages, dtype=F64), mask


@FAST
@given(off_policy(), st.floats(0.5, 5.0))
def test_cispo_gradient_is_the_capped_weight_times_the_advantage(case: Any, cap: float) -> None:
    """No gradient flows through CISPO's weight: d loss / d log pi_t = -min(r_t, cap) A / N on
    every token, capped ones included (the clip surrogate would give those none)."""
    log_ratio, adv, mask = case
    params = {"surrogate": "cispo", "cispo_ratio_max": cap, "loss_aggregation": "token-mean"}
    out, grad = loss_and_grad(params, log_ratio, adv, mask)
    weight = log_ratio.exp().clamp(max=cap)
    expected = -weight * adv.unsqueeze(1) * mask / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    capped = ((log_ratio.exp() > cap) & mask.bool()).sum() / mask.sum()
    assert out.metrics["actor/clipfrac"] == pytest.approx(float(capped))
    assert out.metrics["actor/clipfrac_low"] == 0.0


def test_cispo_golden() -> None:
    # r = e^0.5 = 1.65 capped at 1.2 (A = 2), r = e^-0.5 = 0.61 kept (A = -1); log pi = -1 + log r
    log_ratio = torch.tensor([[0.5], [-0.5]], dtype=F64)
    out, grad = loss_and_grad(
        {"surrogate": "cispo", "cispo_ratio_max": 1.2, "loss_aggregation": "token-mean"},
        log_ratio,
        torch.tensor([2.0, -1.0], dtype=F64),
    )
    r2 = math.exp(-0.5)
    assert out.loss.item() == pytest.approx((-1.2 * 2 * -0.5 + r2 * -1.5) / 2)
    assert grad.flatten().tolist() == pytest.approx([-1.2 * 2 / 2, r2 / 2])
    assert out.metrics["actor/clipfrac_high"] == pytest.approx(0.5)


@FAST
@given(off_policy(), st.floats(0.2, 5.0), st.floats(0.2, 5.0))
def test_sapo_gate_scales_the_unclipped_gradient_by_at_most_one(
    case: Any, tau_pos: float, tau_neg: float
) -> None:
    """SAPO's gradient is the unclipped surrogate's times the gate 4 s (1 - s), s = sigmoid(tau
    (r - 1)): smooth, in (0, 1], and 1 exactly at r = 1."""
    log_ratio, adv, mask = case
    temps = {"sapo_temperature_pos": tau_pos, "sapo_temperature_neg": tau_neg}
    out, grad = loss_and_grad({"surrogate": "sapo", **temps}, log_ratio, adv, mask)
    _, unclipped = loss_and_grad(
        {"clip_eps_low": 0.999, "clip_eps_high": 1e9}, log_ratio, adv, mask
    )
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(F64).unsqueeze(1)
    s = torch.sigmoid(tau * (log_ratio.exp() - 1.0))
    gate = 4 * s * (1 - s)
    torch.testing.assert_close(grad, gate * unclipped, rtol=1e-9, atol=1e-12)
    # (plus the smallest normal float64: subnormal gradients carry no relative precision)
    assert (grad.abs() <= unclipped.abs() * (1 + 1e-12) + torch.finfo(torch.float64).tiny).all()
    assert 0.0 < out.metrics["grpo/sapo_gate"] <= 1.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_on_policy_gradient_equals_the_clip_surrogate(level: str) -> None:
    log_ratio = torch.zeros(3, 4, dtype=F64)
    adv = torch.tensor([1.5, -0.5, -1.0], dtype=F64)
    mask = (torch.arange(4) < torch.tensor([[4], [2], [3]])).to(F64)
    params = {"surrogate": "sapo", "importance_ratio": level, "sapo_temperature_neg": 3.0}
    out, sapo = loss_and_grad(params, log_ratio, adv, mask)
    _, clip = loss_and_grad({"importance_ratio": level}, log_ratio, adv, mask)
    torch.testing.assert_close(sapo, clip, rtol=1e-12, atol=1e-15)
    assert out.metrics["grpo/sapo_gate"] == pytest.approx(1.0)


def test_sapo_golden() -> None:
    # r = e^0.4 with A = 1 (tau_pos = 1): loss -4 sigmoid(r - 1)
    r = math.exp(0.4)
    out, grad = loss_and_grad(
        {"surrogate": "sapo"}, torch.tensor([[0.4]], dtype=F64), torch.ones(1, dtype=F64)
    )
    s = 1 / (1 + math.exp(-(r - 1)))
    assert out.loss.item() == pytest.approx(-4 * s)
    assert grad.item() == pytest.approx(-4 * s * (1 - s) * r)


@FAST
@given(off_policy())
def test_luspo_is_gspo_summed_over_each_sequence(case: Any) -> None:
    """LUSPO weights each sequence's GSPO loss by its length: the clip surrogate at sequence
    level aggregated as a per-sequence token sum."""
    log_ratio, adv, mask = case
    clip = {"clip_eps_low": 0.1, "clip_eps_high": 0.15, "importance_ratio": "sequence"}
    luspo, luspo_grad = loss_and_grad({"surrogate": "luspo", **clip}, log_ratio, adv, mask)
    gspo, gspo_grad = loss_and_grad(
        {"loss_aggregation": "seq-mean-token-sum", **clip}, log_ratio, adv, mask
    )
    torch.testing.assert_close(luspo.loss, gspo.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(luspo_grad, gspo_grad, rtol=1e-12, atol=1e-15)
    assert luspo.metrics["actor/clipfrac"] == gspo.metrics["actor/clipfrac"]


def test_luspo_honours_sample_weights_times_length() -> None:
    mask = (torch.arange(3) < torch.tensor([[1], [3]])).to(F64)
    batch, outputs = make_batch(
        torch.full((2, 3), -1.0),
        mask=mask,
        old_logprobs=torch.full((2, 3), -1.0),
        advantages=torch.tensor([[1.0], [2.0]]) * mask,
        weights=torch.tensor([0.5, 2.0]),
        dtype=F64,
    )
    algorithm = GRPO({"beta": 0.0, "surrogate": "luspo", "importance_ratio": "sequence"})
    out = algorithm.compute_loss(batch, outputs, batch.loss_context())
    # on policy each token's loss is -A; |y| = 1 and 3, weights 0.5 and 2
    assert out.loss.item() == pytest.approx((-1.0 * 1 * 0.5 - 2.0 * 3 * 2.0) / 2)


def gamma_weight(w: float, k: float, lam: float) -> float:
    return math.exp(lam) * w**k * math.exp(-lam * w)


@FAST
@given(off_policy())
def test_vespo_gradient_is_the_gamma_weight_of_the_sequence_ratio(case: Any) -> None:
    """d loss / d log pi_t = -phi(w_i) A_i / N with w_i = prod_t r_t (not length-normalised) and
    phi(w) = e^lam w^k e^(-lam w), (k, lam) by the advantage's sign; nothing flows through phi."""
    log_ratio, adv, mask = case
    params = {"surrogate": "vespo", "loss_aggregation": "token-mean"}
    out, grad = loss_and_grad(params, log_ratio, adv, mask)
    phis = []
    for i in range(len(adv)):
        w = math.exp(float((log_ratio[i] * mask[i]).sum()))
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        phis.append(gamma_weight(w, k, lam))
    phi = torch.tensor(phis, dtype=F64).unsqueeze(1)
    expected = -phi * adv.unsqueeze(1) * mask / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    assert out.metrics["grpo/vespo_phi"] == pytest.approx(sum(phis) / len(phis), rel=1e-9)


def test_vespo_weight_is_one_on_policy_and_peaks_at_k_over_lambda() -> None:
    adv = torch.tensor([1.0], dtype=F64)
    on, grad = loss_and_grad({"surrogate": "vespo"}, torch.zeros(1, 2, dtype=F64), adv)
    assert on.metrics["grpo/vespo_phi"] == pytest.approx(1.0)
    assert grad.flatten().tolist() == pytest.approx([-0.5, -0.5])  # REINFORCE: -A / |y|
    # phi(w) = e^3 w^2 e^(-3w) peaks at w = k / lam = 2/3, where it exceeds phi(1) = 1
    peak = math.log(2 / 3) / 2  # two tokens, w = prod r_t
    at_peak, _ = loss_and_grad({"surrogate": "vespo"}, torch.full((1, 2), peak, dtype=F64), adv)
    assert at_peak.metrics["grpo/vespo_phi"] == pytest.approx(gamma_weight(2 / 3, 2.0, 3.0))
    for shift in (-0.05, 0.05):
        near, _ = loss_and_grad(
            {"surrogate": "vespo"}, torch.full((1, 2), peak + shift, dtype=F64), adv
        )
        assert near.metrics["grpo/vespo_phi"] < at_peak.metrics["grpo/vespo_phi"]
