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
        monkeypatch,
        trainer,
        off_policy_mask_threshold=options.get("off_policy_mask_threshold"),
        top_entropy_quantile=options.get("top_entropy_quantile", 1.0),
    )
    leaf = r.logps.clone().requires_grad_(True)
    rows = torch.arange(len(r.lengths))
    entropies = entropy_of(r)
    trl_loss = trl_grpo_loss(
        trainer,
        monkeypatch,
        leaf,
        r.trl_inputs(rows, beta, float(r.mask.sum())),
        entropies=entropies,
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
    batch, outputs = r.alignzoo_batch(reference=beta > 0)
    outputs.entropy = entropies
    ours = run_alignzoo(grpo, batch, outputs, advantages=False)
    return ours, (trl_loss.detach(), leaf.grad)


def entropy_of(r: Rollouts) -> torch.Tensor:
    """Per-token entropies ``[B, R]`` for the rollouts: distinct values in (0, 3), seeded by the
    rollouts' shape, with junk on padding (which both sides must ignore). Float32 values (held
    in float64): TRL takes its threshold in float32 and compares it with the float64 entropies,
    so at quantile 0 a float64 maximum can sit below its own rounded threshold."""
    gen = torch.Generator().manual_seed(len(r.lengths) * 1_000 + int(r.logps.shape[1]))
    values = (torch.rand(r.logps.shape, generator=gen) * 3.0).to(r.logps.dtype)
    return torch.where(r.mask.bool(), values, 50.0)


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


@pytest.mark.parametrize(("seed", "size", "width"), [(0, 6, 5), (1, 8, 7), (2, 9, 4)])
@pytest.mark.parametrize("quantile", [1.0, 0.2, 0.5, 0.0])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_top_entropy_quantile_matches_trl(
    grpo_trainer, monkeypatch, quantile, level, beta, seed, size, width
):
    """TRL's get_high_entropy_mask (the threshold: torch.quantile of the response tokens'
    entropies at 1 - rho) against alignzoo's, on entropies with junk on the padding."""
    r = make_rollouts(seed, size, width)
    options = {"top_entropy_quantile": quantile}
    ours, theirs = both_sides(monkeypatch, grpo_trainer, r, level, beta, options)
    assert_parity(ours, theirs)
    tokens = int(r.mask.sum())
    kept = int((ours[1] != 0).sum()) if beta == 0 else None
    if quantile < 1.0 and kept is not None:  # premise: the mask drops tokens, keeps the top
        assert 0 < kept < tokens


def test_the_options_all_on_match_trl(grpo_trainer, monkeypatch):
    r = make_rollouts(3, 8, 6)
    options = {"delta": 1.4, "off_policy_mask_threshold": 0.1, "top_entropy_quantile": 0.4}
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
    from alignzoo.algorithms.policy_term import mask_truncated
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
    mask_truncated(batch, "grpo")
    ours = run_alignzoo(grpo, batch, outputs, advantages=False)
    assert_parity(ours, (trl_loss.detach(), leaf.grad))
    assert float(ours[1][cut.bool()].abs().max()) == 0.0  # the cut ones get no gradient


@pytest.mark.parametrize("quantile", [1.0, 0.5])
@pytest.mark.parametrize(
    "bonus",
    [
        {"coef": 0.05},
        {"coef": 0.05, "use_adaptive_entropy": True, "entropy_target": 1.5},
        {
            "coef": 0.3,
            "use_adaptive_entropy": True,
            "entropy_target": 1.2,
            "entropy_coef_delta": 0.02,
            "entropy_coef_min": 0.25,
            "entropy_coef_max": 0.33,
        },
    ],
)
def test_the_entropy_bonus_and_its_adaptive_coefficient_match_trl(
    grpo_trainer, monkeypatch, bonus, quantile
):
    """GRPO with the entropy_bonus modifier against TRL's entropy_coef / use_adaptive_entropy,
    over six optimizer steps whose entropies cross the target both ways: the loss, its gradient
    w.r.t. the log-probs and the entropies, and the coefficient after every step."""
    from alignzoo.plugins.modifiers.entropy_bonus import EntropyBonus
    from alignzoo.registry import build_plugin_manager

    set_grpo(
        monkeypatch,
        grpo_trainer,
        loss_type="grpo",
        level="token",
        beta=0.0,
        eps_low=0.2,
        eps_high=0.2,
        max_completion_length=8,
    )
    set_attributes(monkeypatch, grpo_trainer.args, delta=None)
    set_attributes(
        monkeypatch,
        grpo_trainer,
        off_policy_mask_threshold=None,
        top_entropy_quantile=quantile,
        entropy_coef=bonus["coef"],
        use_adaptive_entropy=bonus.get("use_adaptive_entropy", False),
        _entropy_bonus_enabled=True,
        _last_world_entropy=float("inf"),
        _entropy_window_stats=None,
    )
    defaults = EntropyBonus.Params()
    set_attributes(
        monkeypatch,
        grpo_trainer.args,
        **{
            name: bonus.get(name, getattr(defaults, name))
            for name in ("entropy_target", "entropy_coef_min", "entropy_coef_max")
        },
        entropy_coef_delta=bonus.get("entropy_coef_delta", defaults.entropy_coef_delta),
    )
    modifier = EntropyBonus(bonus)
    pm = build_plugin_manager([GRPO({"beta": 0.0, "top_entropy_quantile": quantile}), modifier])
    coefs, applied = [], []
    for step, level in enumerate([2.0, 1.0, 1.0, 2.0, 0.5, 1.4]):
        r = make_rollouts(step, 6, 5)
        entropies = entropy_of(r) * (level / 1.5)  # mean entropy about `level`
        entropies = torch.where(r.mask.bool(), entropies, 50.0)
        leaf, e_leaf = r.logps.clone().requires_grad_(True), entropies.clone().requires_grad_(True)
        rows = torch.arange(6)
        inputs = r.trl_inputs(rows, 0.0, float(r.mask.sum()))
        trl_loss = trl_grpo_loss(grpo_trainer, monkeypatch, leaf, inputs, entropies=e_leaf)
        trl_loss.backward()
        batch, outputs = r.alignzoo_batch(reference=False)
        outputs.entropy = entropies.clone().requires_grad_(True)
        result = pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())
        result.loss.backward()
        assert_parity((result.loss.detach(), outputs.logprobs.grad), (trl_loss.detach(), leaf.grad))
        mask = r.mask.bool()
        torch.testing.assert_close(
            torch.where(mask, outputs.entropy.grad, 0.0), torch.where(mask, e_leaf.grad, 0.0)
        )
        coefs.append((modifier.coef, grpo_trainer.entropy_coef))
        applied.append(modifier.applied_coef())
    for ours, theirs in coefs:
        assert ours == pytest.approx(theirs, abs=1e-12)
    if bonus.get("use_adaptive_entropy"):  # premise: the controller moved both ways
        values = [c for c, _ in coefs]
        steps = [b - a for a, b in zip([bonus["coef"], *values], values, strict=False)]
        assert any(d > 0 for d in steps) and any(d < 0 for d in steps), values
        assert 0.0 in applied and any(a > 0 for a in applied), applied
