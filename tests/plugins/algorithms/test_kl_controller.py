"""The adaptive KL controller: direction, time constant, clip, units, metrics and resume."""

from __future__ import annotations

import io
import math
import random

import pytest
import torch
from pydantic import ValidationError

from alignzoo.batch import PolicyOutputs
from alignzoo.plugins.algorithms.ppo import (
    KL_ERROR_CLIP,
    PPO,
    AdaptiveKLController,
    FixedKLController,
    PPOParams,
    measured_kl,
)

from .helpers import make_batch, right_padded_mask


def run_stream(ctl: AdaptiveKLController, stream: list[float]) -> list[float]:
    """The coefficient after each update of ``stream`` (one update per training step)."""
    values = []
    for kl in stream:
        ctl.update(kl)
        values.append(ctl.value)
    return values


# --------------------------------------------------------------------------- the rule


def test_coefficient_rises_above_target_and_falls_below():
    rng = random.Random(0)
    target = 0.1
    ctl = AdaptiveKLController(init_kl_coef=0.05, kl_target=target, horizon_steps=10)
    above = [target * rng.uniform(1.01, 5.0) for _ in range(30)]
    rising = run_stream(ctl, above)
    assert all(b > a for a, b in zip([0.05, *rising], rising, strict=False))
    top = ctl.value
    below = [target * rng.uniform(0.0, 0.99) for _ in range(30)]
    falling = run_stream(ctl, below)
    assert all(b < a for a, b in zip([top, *falling], falling, strict=False))
    before = ctl.value
    ctl.update(target)  # on target: no change
    assert ctl.value == before


@pytest.mark.parametrize("horizon", [1, 5, 10, 37])
@pytest.mark.parametrize("error", [-0.2, -0.13, -0.05, 0.05, 0.1, 0.2])
def test_time_constant_is_horizon_steps(horizon, error):
    """After H steps at a constant error e the coefficient is multiplied by (1 + e/H)^H."""
    target, init = 0.1, 0.3
    ctl = AdaptiveKLController(init_kl_coef=init, kl_target=target, horizon_steps=horizon)
    run_stream(ctl, [target * (1 + error)] * horizon)
    expected = init * (1 + error / horizon) ** horizon
    assert ctl.value == pytest.approx(expected, rel=1e-9, abs=0)
    # ... about exp(e) per H steps (exactly in the limit of large H)
    assert ctl.value / init == pytest.approx(math.exp(error), rel=0.03)


def test_defaults_move_at_most_four_percent_a_step_and_react_within_twenty_steps():
    p = PPOParams(kl_controller="adaptive")
    assert (p.kl_target_unit, p.kl_target, p.kl_horizon_steps) == ("token", 0.1, 5)
    assert p.init_kl_coef == 0.3
    ctl = AdaptiveKLController(p.init_kl_coef, p.kl_target, p.kl_horizon_steps)
    run_stream(ctl, [10 * p.kl_target])  # far above target: the clipped maximum
    assert ctl.value == pytest.approx(p.init_kl_coef * 1.04, rel=1e-12)
    run_stream(ctl, [10 * p.kl_target] * 19)  # 20 steps: 1.04^20 = 2.19
    assert ctl.value == pytest.approx(p.init_kl_coef * 1.04**20, rel=1e-12)
    run_stream(ctl, [0.0] * 20)  # and 0.96^20 = 0.44 down
    assert ctl.value == pytest.approx(p.init_kl_coef * 1.04**20 * 0.96**20, rel=1e-12)


def test_error_is_clipped_at_plus_minus_point_two():
    target = 2.0
    ctl = AdaptiveKLController(1.0, target, 4)
    assert ctl.error(2.4) == pytest.approx(0.2)
    assert ctl.error(2.2) == pytest.approx(0.1)
    assert ctl.error(1e6) == KL_ERROR_CLIP == 0.2
    assert ctl.error(0.0) == -KL_ERROR_CLIP
    assert ctl.error(-5.0) == -KL_ERROR_CLIP  # a negative k1 estimate

    def after(kl: float) -> float:
        c = AdaptiveKLController(1.0, target, 4)
        c.update(kl)
        return c.value

    assert after(1e6) == after(target * 1.2) == pytest.approx(1.05)  # 1 + 0.2 / 4
    assert after(0.0) == after(target * 0.8) == pytest.approx(0.95)
    assert after(-3.0) == after(0.0)


def test_n_steps_counts_steps_not_samples():
    one, two = AdaptiveKLController(1.0, 1.0, 10), AdaptiveKLController(1.0, 1.0, 10)
    one.update(1.1, n_steps=2)
    two.update(1.1)
    assert one.value == pytest.approx(1.02)
    assert two.value == pytest.approx(1.01)


def test_bad_controller_settings_are_refused():
    with pytest.raises(ValueError, match="init_kl_coef"):
        AdaptiveKLController(0.0, 0.1, 10)
    with pytest.raises(ValidationError, match="init_kl_coef"):
        PPO({"kl_controller": "adaptive", "init_kl_coef": 0.0})
    with pytest.raises(ValidationError):
        PPO({"kl_controller": "adaptive", "kl_horizon_steps": 0})
    with pytest.raises(ValidationError):
        PPO({"kl_controller": "adaptive", "kl_target_unit": "nats"})
    with pytest.raises(ValidationError, match="kl_horizon_steps"):
        PPO({"kl_controller": "adaptive", "horizon": 10000})  # the old field, in samples


# --------------------------------------------------------------------------- units


KL = torch.tensor([[1.0, 2.0, 99.0], [3.0, 77.0, 55.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
PER_TOKEN = (1.0 + 2.0 + 3.0) / 3  # padding never counts
PER_SEQUENCE = ((1.0 + 2.0) + 3.0) / 2


def test_measured_kl_per_token_and_per_sequence():
    assert measured_kl(KL, MASK, "token").item() == pytest.approx(PER_TOKEN)
    assert measured_kl(KL, MASK, "sequence").item() == pytest.approx(PER_SEQUENCE)
    with pytest.raises(ValueError, match="unit"):
        measured_kl(KL, MASK, "sample")  # type: ignore[arg-type]


def kl_batch(k1: torch.Tensor = KL, mask: torch.Tensor = MASK):
    """A batch whose k1 KL of the sampled tokens to the reference is ``k1`` (on valid tokens)."""
    old = torch.zeros_like(k1)
    return make_batch(
        mask,
        scores=[1.0] * k1.shape[0],
        values=torch.zeros_like(k1),
        old_logprobs=old,
        ref_logprobs=old - k1,  # k1 = log pi - log pi_ref
    )


def loss_metrics(algo: PPO, batch) -> dict[str, float]:
    outputs = PolicyOutputs(
        logprobs=batch.old_logprobs.clone(),
        values=torch.zeros_like(batch.old_logprobs, requires_grad=True),
    )
    return algo.compute_loss(batch, outputs, batch.loss_context()).metrics


@pytest.mark.parametrize(("unit", "observed"), [("token", PER_TOKEN), ("sequence", PER_SEQUENCE)])
def test_plugin_measures_kl_in_the_targets_unit_and_logs_it(unit, observed):
    target, init, horizon = 2.5, 0.2, 8
    algo = PPO(
        {
            "kl_controller": "adaptive",
            "kl_target": target,
            "kl_target_unit": unit,
            "init_kl_coef": init,
            "kl_horizon_steps": horizon,
            "kl_estimator": "k1",
        }
    )
    batch = algo.compute_advantages(kl_batch())
    metrics = loss_metrics(algo, batch)
    assert metrics["kl/measured"] == pytest.approx(observed)
    assert metrics["kl/target"] == target
    assert metrics["kl/coef"] == init  # the coefficient of this step's reward ...
    error = max(min(observed / target - 1, 0.2), -0.2)
    # ... then one update with the step's KL
    assert algo.kl_ctl.value == pytest.approx(init * (1 + error / horizon), rel=1e-12)
    assert "ppo/kl_coef" not in metrics
    # the next step's reward uses (and logs) the updated coefficient
    updated = algo.kl_ctl.value
    batch = algo.compute_advantages(kl_batch())
    assert loss_metrics(algo, batch)["kl/coef"] == updated
    assert batch.token_rewards[1, 0].item() == pytest.approx(1.0 - updated * 3.0, rel=1e-6)


def test_fixed_controller_logs_its_coefficient_and_no_target():
    algo = PPO({"kl_coef": 0.05, "kl_estimator": "k1"})
    metrics = loss_metrics(algo, algo.compute_advantages(kl_batch()))
    assert metrics["kl/coef"] == 0.05
    assert metrics["kl/measured"] == pytest.approx(PER_TOKEN)
    assert "kl/target" not in metrics
    off = PPO({"kl_in_reward": False})
    assert loss_metrics(off, off.compute_advantages(kl_batch()))["kl/coef"] == 0.0


def test_one_update_per_step_whatever_the_batch_size():
    small, large = (PPO({"kl_controller": "adaptive", "kl_target": 1.0}) for _ in range(2))
    mask = right_padded_mask([2])
    small.compute_advantages(kl_batch(torch.full((1, 2), 3.0), mask))
    large.compute_advantages(kl_batch(torch.full((64, 2), 3.0), mask.repeat(64, 1)))
    assert (
        small.kl_ctl.value
        == large.kl_ctl.value
        == pytest.approx(small.params.init_kl_coef * (1 + 0.2 / small.params.kl_horizon_steps))
    )


# --------------------------------------------------------------------------- resume


def test_state_round_trip_restores_the_coefficient_exactly():
    rng = random.Random(1)
    stream = [rng.uniform(0.0, 0.3) for _ in range(40)]
    ctl = AdaptiveKLController(0.1, 0.1, 10)
    run_stream(ctl, stream[:17])
    buffer = io.BytesIO()
    torch.save(ctl.state_dict(), buffer)  # as the checkpoint writes it (trainer.pt)
    buffer.seek(0)
    resumed = AdaptiveKLController(0.1, 0.1, 10)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.value == ctl.value  # bit for bit
    assert run_stream(resumed, stream[17:]) == run_stream(ctl, stream[17:])

    fixed = FixedKLController(0.0)
    fixed.load_state_dict(FixedKLController(0.07).state_dict())
    assert fixed.value == 0.07


def test_plugin_resume_continues_the_uninterrupted_trajectory():
    params = {"kl_controller": "adaptive", "kl_target": 0.1, "kl_estimator": "k1"}
    torch.manual_seed(0)
    kls = [torch.rand(4, 3) * 0.4 for _ in range(12)]
    mask = right_padded_mask([3, 2, 3, 1])
    full = PPO(params)
    for k1 in kls:
        full.compute_advantages(kl_batch(k1, mask))

    first = PPO(params)
    for k1 in kls[:5]:
        first.compute_advantages(kl_batch(k1, mask))
    resumed = PPO(params)
    resumed.load_state_dict(first.state_dict())
    assert resumed.kl_ctl.value == first.kl_ctl.value != first.params.init_kl_coef
    for k1 in kls[5:]:
        resumed.compute_advantages(kl_batch(k1, mask))
    assert resumed.state_dict() == full.state_dict()
    assert resumed.kl_ctl.value == full.kl_ctl.value
