"""Loss-and-gradient parity of GRPO's objective options with TRL 1.16's GRPOTrainer, under TRL's
own names: ``delta`` (INTELLECT-2's two-sided clip: the unclipped term's ratio capped at delta)
and ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence mask), each at TRL's
default (None) and at non-default values, on both importance-ratio levels, with the KL term on
and off, with padding. Same harness as test_trl_parity: a real GRPOTrainer's ``_compute_loss``
on hand-built rollouts, alignzoo's loss and gradient compared in float64.

alignzoo GRPOParams ↔ TRL GRPOConfig / GRPOTrainer, besides test_trl_parity's map:
  delta ↔ args.delta (None in both: off);
  off_policy_mask_threshold ↔ trainer.off_policy_mask_threshold, its sampling log-probs ↔
    batch.rollout_logprobs when the backend recorded them, else old_logprobs (TRL's
    sampling_per_token_logps, else old_per_token_logps; here the latter, both sides).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from alignzoo.plugins.algorithms.grpo import GRPO
from tests.parity import test_trl_parity as parity
from tests.parity.test_trl_parity import (
    GRPOTrainer,
    Rollouts,
    assert_parity,
    make_rollouts,
    run_alignzoo,
    set_attributes,
    set_grpo,
    trl_grpo_loss,
)

tokenizer, trl_args, grpo_trainer = parity.tokenizer, parity.trl_args, parity.grpo_trainer


def both_sides(
    monkeypatch: pytest.MonkeyPatch,
    trainer: GRPOTrainer,
    r: Rollouts,
    level: str,
    beta: float,
    options: dict[str, Any],
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    set_grpo(
        monkeypatch,
        trainer,
        loss_type="dapo",
        level=level,
        beta=beta,
        eps_low=0.2,
        eps_high=0.28,
        max_completion_length=8,
    )
    set_attributes(monkeypatch, trainer.args, delta=options.get("delta"))
    set_attributes(
        monkeypatch, trainer, off_policy_mask_threshold=options.get("off_policy_mask_threshold")
    )
    leaf = r.logps.clone().requires_grad_(True)
    rows = torch.arange(len(r.lengths))
    trl_loss = trl_grpo_loss(
        trainer, monkeypatch, leaf, r.trl_inputs(rows, beta, float(r.mask.sum()))
    )
    trl_loss.backward()
    assert leaf.grad is not None
    grpo = GRPO(
        {
            "beta": beta,
            "clip_eps_low": 0.2,
            "clip_eps_high": 0.28,
            "importance_ratio": level,
            "loss_aggregation": "token-mean",
            **options,
        }
    )
    ours = run_alignzoo(grpo, *r.alignzoo_batch(reference=beta > 0), advantages=False)
    return ours, (trl_loss.detach(), leaf.grad)


@pytest.mark.parametrize(("seed", "size", "width"), [(0, 6, 5), (1, 8, 7), (2, 9, 4)])
@pytest.mark.parametrize("delta", [None, 1.3, 1.5])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_delta_matches_trl(grpo_trainer, monkeypatch, delta, level, beta, seed, size, width):
    r = make_rollouts(seed, size, width)
    ours, theirs = both_sides(monkeypatch, grpo_trainer, r, level, beta, {"delta": delta})
    assert_parity(ours, theirs)
    if delta is not None:  # premise: the cap binds somewhere (ratios reach about 1.57)
        ratio = torch.where(r.mask.bool(), (r.logps - r.old_logps).exp(), 0.0)
        assert bool((ratio > delta).any())


@pytest.mark.parametrize(("seed", "size", "width"), [(0, 6, 5), (1, 8, 7), (2, 9, 4)])
@pytest.mark.parametrize("threshold", [None, 0.0, 0.3])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_off_policy_mask_matches_trl(
    grpo_trainer, monkeypatch, threshold, level, beta, seed, size, width
):
    r = make_rollouts(seed, size, width)
    options = {"off_policy_mask_threshold": threshold}
    ours, theirs = both_sides(monkeypatch, grpo_trainer, r, level, beta, options)
    assert_parity(ours, theirs)
    if threshold is not None:  # premise: some negative-advantage sequence is masked, not all
        mask = r.mask
        kl = ((r.old_logps - r.logps) * mask).sum(-1) / mask.sum(-1)
        masked = (r.advantages < 0) & (kl > threshold)
        assert bool(masked.any()) and not bool(masked.all())


def test_the_options_with_both_on_match_trl(grpo_trainer, monkeypatch):
    r = make_rollouts(3, 8, 6)
    options = {"delta": 1.4, "off_policy_mask_threshold": 0.1}
    assert_parity(*both_sides(monkeypatch, grpo_trainer, r, "token", 0.04, options))


@pytest.mark.parametrize(("seed", "size", "width"), [(0, 6, 5), (1, 8, 7)])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_mask_truncated_completions_matches_trl(
    grpo_trainer, monkeypatch, loss_type, beta, seed, size, width
):
    """TRL zeroes a truncated completion's mask when it generates (so its tokens leave
    num_items_in_batch too); alignzoo's GRPO zeroes its response mask in compute_advantages,
    from the engine's record batch.columns['truncated']."""
    from alignzoo.plugins.algorithms.grpo import mask_truncated
    from tests.parity.test_trl_parity import GRPO_AGGREGATION

    r = make_rollouts(seed, size, width)
    cut = (torch.arange(size) % 3 == 1).to(torch.float64)  # every third response was cut
    set_grpo(
        monkeypatch,
        grpo_trainer,
        loss_type=loss_type,
        level="token",
        beta=beta,
        eps_low=0.2,
        eps_high=0.2,
        max_completion_length=width + 3,
    )
    set_attributes(monkeypatch, grpo_trainer.args, delta=None)
    set_attributes(monkeypatch, grpo_trainer, off_policy_mask_threshold=None)
    kept = (r.mask * (1.0 - cut).unsqueeze(1)).int()
    inputs = r.trl_inputs(torch.arange(size), beta, float(kept.sum()))
    inputs["completion_mask"] = kept
    leaf = r.logps.clone().requires_grad_(True)
    trl_loss = trl_grpo_loss(grpo_trainer, monkeypatch, leaf, inputs)
    trl_loss.backward()
    aggregation = GRPO_AGGREGATION[loss_type]
    grpo = GRPO(
        {
            "beta": beta,
            "loss_aggregation": aggregation,
            "norm_constant": width + 3 if aggregation == "seq-mean-token-sum-norm" else None,
            "mask_truncated_completions": True,
        }
    )
    batch, outputs = r.alignzoo_batch(reference=beta > 0)
    batch.columns["truncated"] = cut
    mask_truncated(batch)
    ours = run_alignzoo(grpo, batch, outputs, advantages=False)
    assert_parity(ours, (trl_loss.detach(), leaf.grad))
    assert float(ours[1][cut.bool()].abs().max()) == 0.0  # the cut ones get no gradient
