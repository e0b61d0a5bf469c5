"""EntropyBonus: a modifier whose hook wrapper changes a built-in algorithm's loss."""

from __future__ import annotations

import pytest
import torch

from alignzoo.batch import PolicyOutputs
from alignzoo.errors import UserError
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.plugins.modifiers.entropy_bonus import EntropyBonus
from alignzoo.registry import build_plugin_manager
from tests.plugins.algorithms.helpers import make_batch, right_padded_mask


def grpo_inputs():
    mask = right_padded_mask([3, 1])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]])
    batch = make_batch(mask, scores=[1.0, 0.0], group_ids=[0, 0], old_logprobs=old)
    batch.ref_logprobs = old - 0.1
    logprobs = (old + torch.tensor([[0.1, -0.05, 0.3], [0.2, 9.0, 9.0]])).requires_grad_()
    entropy = torch.tensor([[1.0, 2.0, 3.0], [0.5, 100.0, 100.0]], requires_grad=True)
    return batch, PolicyOutputs(logprobs=logprobs, entropy=entropy)


def test_entropy_bonus_wraps_grpo_loss():
    batch, outputs = grpo_inputs()
    grpo = GRPO()
    grpo.compute_advantages(batch)
    plain = grpo.compute_loss(batch, outputs, batch.loss_context())

    pm = build_plugin_manager([GRPO(), EntropyBonus({"coef": 0.1})])
    wrapped = pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())
    mean_entropy = (1.0 + 2.0 + 3.0 + 0.5) / 4  # masked mean over the 4 response tokens
    assert wrapped.loss.item() == pytest.approx(plain.loss.item() - 0.1 * mean_entropy, abs=1e-6)
    assert wrapped.metrics["entropy_bonus"] == pytest.approx(0.1 * mean_entropy, abs=1e-6)
    assert wrapped.metrics["actor/pg_loss"] == pytest.approx(plain.metrics["actor/pg_loss"])

    wrapped.loss.backward()  # the bonus pushes entropy up on real tokens only
    assert outputs.entropy.grad.flatten().tolist() == pytest.approx(
        [-0.025, -0.025, -0.025, -0.025, 0.0, 0.0], abs=1e-7
    )


def test_entropy_bonus_default_coef_and_missing_entropy():
    assert EntropyBonus().params.coef == 0.01
    batch, outputs = grpo_inputs()
    GRPO().compute_advantages(batch)
    outputs.entropy = None
    pm = build_plugin_manager([GRPO(), EntropyBonus()])
    with pytest.raises(UserError, match="entropy"):
        pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())


def adaptive(**params):
    base = {"coef": 0.1, "use_adaptive_entropy": True, "entropy_target": 1.0}
    return EntropyBonus({**base, **params})


def call(pm, entropy_value: float, micro_batches: int):
    batch, outputs = grpo_inputs()
    GRPO().compute_advantages(batch)
    outputs.entropy = torch.full((2, 3), entropy_value, requires_grad=True)
    context = batch.loss_context(micro_batches=micro_batches)
    return pm.hook.compute_loss(batch=batch, outputs=outputs, context=context)


def test_the_adaptive_coefficient_moves_once_per_optimizer_step_from_its_whole_window():
    """Three micro-batches make one optimizer step: the coefficient moves after the third, from
    the token mean of all three (4 tokens each: entropies 0.2, 0.2 and 2.9, mean 1.1 > 1.0,
    so down), and the bonus applies from the next step only while the last mean was <= 1."""
    modifier = adaptive(entropy_coef_delta=0.03)
    pm = build_plugin_manager([GRPO(), modifier])
    for value in (0.2, 0.2):
        assert call(pm, value, 3).metrics["entropy_bonus/coef"] == 0.0  # no step's H yet
        assert modifier.coef == 0.1  # the window is open: nothing moves
    call(pm, 2.9, 3)
    assert modifier.coef == pytest.approx(0.07) and modifier.last_entropy == pytest.approx(1.1)
    assert call(pm, 0.5, 1).metrics["entropy_bonus/coef"] == 0.0  # 1.1 was above the target
    assert modifier.coef == pytest.approx(0.1) and modifier.last_entropy == pytest.approx(0.5)
    assert call(pm, 0.5, 1).metrics["entropy_bonus/coef"] == pytest.approx(0.1)


def test_the_adaptive_coefficient_stays_within_its_bounds_and_restores_from_a_checkpoint():
    modifier = adaptive(coef=0.1, entropy_coef_delta=0.05, entropy_coef_max=0.12)
    pm = build_plugin_manager([GRPO(), modifier])
    call(pm, 0.1, 1)
    assert modifier.coef == pytest.approx(0.12)  # capped, not 0.15
    restored = adaptive(coef=0.1, entropy_coef_delta=0.05, entropy_coef_max=0.12)
    restored.load_state_dict(modifier.state_dict())
    assert (restored.coef, restored.last_entropy) == (modifier.coef, modifier.last_entropy)
    assert restored.applied_coef() == modifier.applied_coef() == pytest.approx(0.12)
    floor = adaptive(coef=0.1, entropy_coef_delta=0.5, entropy_coef_min=0.02)
    call(build_plugin_manager([GRPO(), floor]), 5.0, 1)
    assert floor.coef == pytest.approx(0.02)


def test_without_the_controller_the_coefficient_never_moves():
    modifier = EntropyBonus({"coef": 0.1})
    pm = build_plugin_manager([GRPO(), modifier])
    result = call(pm, 0.1, 1)
    assert modifier.coef == 0.1 and "entropy_bonus/coef" not in result.metrics


def test_the_bonus_acts_on_the_tokens_the_policy_term_kept():
    """With top_entropy_quantile the bonus is the mean entropy of the kept tokens only."""
    batch, outputs = grpo_inputs()
    grpo = GRPO({"top_entropy_quantile": 0.5})
    grpo.compute_advantages(batch)
    pm = build_plugin_manager([grpo, EntropyBonus({"coef": 0.1})])
    result = pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())
    # real entropies 1, 2, 3, 0.5: the median is 1.5, so 2 and 3 are kept
    assert result.entropy_mask.tolist() == [[False, True, True], [False, False, False]]
    assert result.metrics["entropy_bonus"] == pytest.approx(0.1 * 2.5)


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "must not exceed"),
        ({"use_adaptive_entropy": True, "coef": 2.0}, "within"),
        ({"entropy_coef_delta": -0.1}, "entropy_coef_delta"),
        ({"entropy_target": -1.0}, "entropy_target"),
    ],
)
def test_bad_controller_settings_are_refused_naming_the_field(params, says):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        EntropyBonus.Params(**params)


def test_the_off_policy_mask_leaves_the_bonus_alone():
    """TRL restricts its bonus with the entropy mask only: a threshold (here one that masks no
    sequence, and one that masks some) leaves the bonus and its gradient as without it."""

    def entropy_gradient(params):
        batch, outputs = grpo_inputs()
        grpo = GRPO(params)
        grpo.compute_advantages(batch)
        pm = build_plugin_manager([grpo, EntropyBonus({"coef": 0.1})])
        context = batch.loss_context(micro_batches=2)
        pm.hook.compute_loss(batch=batch, outputs=outputs, context=context).loss.backward()
        return outputs.entropy.grad

    plain = entropy_gradient({})
    for threshold in (1e9, 0.0):
        torch.testing.assert_close(
            entropy_gradient({"off_policy_mask_threshold": threshold}), plain
        )


def test_under_data_parallelism_the_kept_tokens_bonus_is_the_mean_of_the_ranks(monkeypatch):
    """Each rank's loss is scaled by the world size and DDP averages the gradients: the
    per-rank share of a bonus over the kept tokens is divided by the ranks, so the step's bonus
    is the mean of the ranks' means (TRL's), not their sum."""
    from alignzoo import distributed

    def bonus():
        batch, outputs = grpo_inputs()
        grpo = GRPO({"top_entropy_quantile": 0.5})
        grpo.compute_advantages(batch)
        pm = build_plugin_manager([grpo, EntropyBonus({"coef": 0.1})])
        plain = grpo.compute_loss(batch, outputs, batch.loss_context())
        result = pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())
        return float(plain.loss - result.loss)

    one = bonus()
    assert one == pytest.approx(0.1 * 2.5)
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    assert bonus() == pytest.approx(one / 4)


def test_without_the_controller_a_resumed_run_takes_coef_from_its_configuration():
    old = EntropyBonus({"coef": 0.1})
    assert old.state_dict() == {}
    new = EntropyBonus({"coef": 0.3})
    new.load_state_dict(old.state_dict())
    assert new.coef == 0.3 and new.applied_coef() == 0.3
