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
