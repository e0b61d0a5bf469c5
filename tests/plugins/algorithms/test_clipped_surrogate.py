"""PPO, GRPO, RLOO and REINFORCE++ compute their policy term with the one clipped surrogate,
:func:`alignzoo.ops.clipped_surrogate` (its formula: tests/core/test_ops.py), with their own
clip range; RLOO and REINFORCE++ share their loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from alignzoo import ops
from alignzoo.algorithms.reinforce import KLPenalisedReinforce
from alignzoo.plugin import Algorithm
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.plugins.algorithms.ppo import PPO
from alignzoo.plugins.algorithms.reinforce_pp import ReinforcePlusPlus
from alignzoo.plugins.algorithms.rloo import RLOO
from alignzoo.registry import build_plugin_manager
from alignzoo.testing import make_batch

CLIPPED = [
    pytest.param(PPO({"clip_eps": 0.3}), (0.3, 0.3, None), id="ppo"),
    pytest.param(PPO({"clip_eps": 0.1, "dual_clip": 3.0}), (0.1, 0.1, 3.0), id="ppo-dual-clip"),
    pytest.param(
        GRPO({"clip_eps_low": 0.2, "clip_eps_high": 0.28}), (0.2, 0.28, None), id="grpo-dapo"
    ),
    pytest.param(
        GRPO({"importance_ratio": "sequence", "clip_eps_low": 3e-4}),
        (3e-4, 0.2, None),
        id="grpo-gspo",
    ),
    pytest.param(
        GRPO({"surrogate": "luspo", "importance_ratio": "sequence"}),
        (0.2, 0.2, None),
        id="grpo-luspo",
    ),
    pytest.param(GRPO({"delta": 1.4}), (0.2, 0.2, None, 1.4), id="grpo-delta"),
    pytest.param(RLOO({"clip_eps": 0.15}), (0.15, 0.15, None), id="rloo"),
    pytest.param(ReinforcePlusPlus({"clip_eps": 0.25}), (0.25, 0.25, None), id="reinforce_pp"),
]
NOT_CLIPPED = [
    pytest.param(GRPO({"surrogate": name}), id=f"grpo-{name}")
    for name in ("cispo", "sapo", "vespo")
]
"""Surrogates that are not PPO's clip (a capped IS weight, a soft gate, a Gamma weight)."""


def step_loss(algorithm: Algorithm) -> torch.Tensor:
    """compute_advantages then compute_loss of ``algorithm`` on a small off-policy batch."""
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 3, generator=gen, dtype=torch.float64)
    batch, outputs = make_batch(
        logprobs,
        mask=[[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]],
        group_ids=[0, 0, 1, 1],
        old_logprobs=logprobs + 0.3 * torch.randn(4, 3, generator=gen, dtype=torch.float64),
        ref_logprobs=logprobs.detach().clone(),
        values=torch.zeros(4, 3),
        policy_values=torch.zeros(4, 3),
        scores=[1.0, 0.0, 0.0, 1.0],
        dtype=torch.float64,
    )
    pm = build_plugin_manager([algorithm])
    batch = pm.hook.compute_advantages(batch=batch)
    return pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context()).loss


def spy_on_clipped_surrogate(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Route ops.clipped_surrogate through a recorder of its clip arguments."""
    calls: list[tuple[Any, ...]] = []
    original = ops.clipped_surrogate

    def recorded(
        log_ratio: torch.Tensor,
        advantages: torch.Tensor,
        clip_low: float,
        clip_high: float,
        dual_clip: float | None = None,
        delta: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls.append((clip_low, clip_high, dual_clip) if delta is None else (clip_low, clip_high, dual_clip, delta))  # fmt: skip
        return original(log_ratio, advantages, clip_low, clip_high, dual_clip, delta)

    monkeypatch.setattr(ops, "clipped_surrogate", recorded)
    return calls


@pytest.mark.parametrize(("algorithm", "clip"), CLIPPED)
def test_every_clipped_loss_calls_the_one_surrogate(
    algorithm: Algorithm, clip: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    unobserved = step_loss(algorithm)
    calls = spy_on_clipped_surrogate(monkeypatch)
    assert torch.equal(step_loss(algorithm), unobserved)
    assert calls == [clip]  # once per loss, with the algorithm's clip range


@pytest.mark.parametrize("algorithm", NOT_CLIPPED)
def test_the_other_grpo_surrogates_do_not_clip(
    algorithm: Algorithm, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = spy_on_clipped_surrogate(monkeypatch)
    step_loss(algorithm)
    assert calls == []


def test_rloo_and_reinforce_pp_share_their_loss_and_requirements() -> None:
    for algorithm in (RLOO, ReinforcePlusPlus):
        assert issubclass(algorithm, KLPenalisedReinforce)
        assert "compute_loss" not in vars(algorithm)
        assert "algorithm_requirements" not in vars(algorithm)
