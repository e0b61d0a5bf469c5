"""Loss-and-gradient parity of alignzoo's GRPO surrogates with TRL 1.16's other ``loss_type``s.

test_trl_parity.py covers TRL's ``grpo``, ``bnpo``, ``dr_grpo`` and ``dapo`` (the clip surrogate
with alignzoo's aggregations); this module covers the remaining four, which alignzoo selects with
``GRPOParams.surrogate``: ``cispo``, ``sapo``, ``luspo`` and ``vespo``. Same method: a real
GRPOTrainer (built once per module by the fixtures imported from test_trl_parity), its
``_compute_loss`` called on hand-built rollouts with the policy's per-token log-probs given, and
alignzoo's loss and gradient w.r.t. those log-probs compared in float64.

alignzoo GRPOParams ↔ TRL GRPOConfig (GRPOTrainer attributes), besides test_trl_parity's map:
  surrogate ↔ loss_type;
  cispo_ratio_max ↔ epsilon_high (trainer.epsilon_high: the cap of CISPO's IS weight);
  sapo_temperature_pos / sapo_temperature_neg ↔ sapo_temperature_pos / sapo_temperature_neg;
  vespo_k_pos / vespo_lambda_pos / vespo_k_neg / vespo_lambda_neg ↔ the same names;
  loss_aggregation ↔ the aggregation each loss_type fixes: token-mean for "cispo" and "vespo"
    (DAPO's num_items_in_batch normaliser), seq-mean-token-mean (the default) for "sapo" and
    "luspo" (whose length weight |y_i| makes it TRL's per-sequence token sum);
  importance_ratio ↔ importance_sampling_level ("sequence" required by luspo, "token" by vespo).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from alignzoo.batch import PolicyOutputs
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.types import LossContext
from tests.parity import test_trl_parity as parity
from tests.parity.test_trl_parity import (
    GRPOTrainer,
    Rollouts,
    alignzoo_loss,
    assert_parity,
    make_rollouts,
    run_alignzoo,
    set_attributes,
    set_grpo,
    trl_grpo_loss,
)

# test_trl_parity's module-scoped fixtures (a real GRPOTrainer and what builds it), for these tests
tokenizer, trl_args, grpo_trainer = parity.tokenizer, parity.trl_args, parity.grpo_trainer

AGGREGATION = {
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "luspo": "seq-mean-token-mean",
    "vespo": "token-mean",
}
"""The alignzoo loss_aggregation that reproduces each TRL loss_type's normalisation."""

SAPO_DEFAULT = {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}
VESPO_DEFAULT = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}  # fmt: skip
VESPO_OTHER = {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 0.5, "vespo_lambda_neg": 4.0}  # fmt: skip


def configure(
    monkeypatch: pytest.MonkeyPatch,
    trainer: GRPOTrainer,
    loss_type: str,
    level: str,
    beta: float,
    extra: dict[str, float],
    accumulation: int = 1,
) -> GRPO:
    """Set TRL's trainer to ``loss_type`` with ``extra`` (alignzoo param names), and return
    alignzoo's GRPO configured the same way."""
    eps_low, eps_high = 0.2, 0.28  # the clip range of luspo (unused by the others)
    if loss_type == "cispo":
        eps_high = extra["cispo_ratio_max"]  # TRL's epsilon_high is CISPO's cap
    set_grpo(
        monkeypatch,
        trainer,
        loss_type=loss_type,
        level=level,
        beta=beta,
        eps_low=eps_low,
        eps_high=eps_high,
        max_completion_length=8,
        accumulation=accumulation,
    )
    trl_fields = {k: v for k, v in extra.items() if k.startswith(("sapo_", "vespo_"))}
    set_attributes(monkeypatch, trainer.args, **trl_fields)
    params: dict[str, Any] = {
        "surrogate": loss_type,
        "beta": beta,
        "importance_ratio": level,
        "loss_aggregation": AGGREGATION[loss_type],
        **extra,
    }
    if loss_type == "luspo":
        params.update(clip_eps_low=eps_low, clip_eps_high=eps_high)
    return GRPO(params)


def trl_side(
    trainer: GRPOTrainer, monkeypatch: pytest.MonkeyPatch, r: Rollouts, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's loss on all of ``r`` (one optimizer step) and its gradient w.r.t. the log-probs."""
    leaf = r.logps.clone().requires_grad_(True)
    rows = torch.arange(len(r.lengths))
    loss = trl_grpo_loss(trainer, monkeypatch, leaf, r.trl_inputs(rows, beta, float(r.mask.sum())))
    loss.backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad


def log_ratios(r: Rollouts, level: str) -> torch.Tensor:
    """log(pi / pi_old) on the response tokens ``[B, R]``, per token or GSPO's per sequence."""
    mask = r.mask.bool()
    log_ratio = torch.where(mask, r.logps - r.old_logps, 0.0)
    if level == "sequence":
        log_ratio = (log_ratio.sum(-1) / r.mask.sum(-1)).unsqueeze(1).expand_as(log_ratio)
    return log_ratio


SIZES = [(0, 6, 5), (1, 8, 7)]


@pytest.mark.parametrize(("seed", "size", "width"), SIZES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("ratio_max", [1.3, 5.0])
def test_cispo_matches_trl(
    grpo_trainer: GRPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    ratio_max: float,
    level: str,
    beta: float,
    seed: int,
    size: int,
    width: int,
) -> None:
    r = make_rollouts(seed, size, width)
    capped = (log_ratios(r, level).exp() > ratio_max) & r.mask.bool()
    assert capped.any() == (ratio_max < 1.5)  # the cap binds at 1.3, never at ScaleRL's 5
    algorithm = configure(
        monkeypatch, grpo_trainer, "cispo", level, beta, {"cispo_ratio_max": ratio_max}
    )
    trl = trl_side(grpo_trainer, monkeypatch, r, beta)
    batch, outputs = r.alignzoo_batch(reference=beta > 0)
    assert_parity(run_alignzoo(algorithm, batch, outputs, advantages=False), trl)


@pytest.mark.parametrize(("seed", "size", "width"), SIZES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    "temperatures",
    [SAPO_DEFAULT, {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 3.0}],
    ids=["paper", "wide"],
)
def test_sapo_matches_trl(
    grpo_trainer: GRPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    temperatures: dict[str, float],
    level: str,
    beta: float,
    seed: int,
    size: int,
    width: int,
) -> None:
    r = make_rollouts(seed, size, width)
    algorithm = configure(monkeypatch, grpo_trainer, "sapo", level, beta, temperatures)
    trl = trl_side(grpo_trainer, monkeypatch, r, beta)
    batch, outputs = r.alignzoo_batch(reference=beta > 0)
    assert_parity(run_alignzoo(algorithm, batch, outputs, advantages=False), trl)


@pytest.mark.parametrize(("seed", "size", "width"), SIZES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_luspo_matches_trl(
    grpo_trainer: GRPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    beta: float,
    seed: int,
    size: int,
    width: int,
) -> None:
    r = make_rollouts(seed, size, width)
    ratio, adv = log_ratios(r, "sequence").exp(), r.advantages.unsqueeze(1)
    mask = r.mask.bool()
    assert (mask & (ratio > 1.28) & (adv > 0)).any() and (mask & (ratio < 0.8) & (adv < 0)).any()
    algorithm = configure(monkeypatch, grpo_trainer, "luspo", "sequence", beta, {})
    trl = trl_side(grpo_trainer, monkeypatch, r, beta)
    batch, outputs = r.alignzoo_batch(reference=beta > 0)
    assert_parity(run_alignzoo(algorithm, batch, outputs, advantages=False), trl)


@pytest.mark.parametrize(("seed", "size", "width"), SIZES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("vespo", [VESPO_DEFAULT, VESPO_OTHER], ids=["trl-default", "other"])
def test_vespo_matches_trl(
    grpo_trainer: GRPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    vespo: dict[str, float],
    beta: float,
    seed: int,
    size: int,
    width: int,
) -> None:
    r = make_rollouts(seed, size, width)
    algorithm = configure(monkeypatch, grpo_trainer, "vespo", "token", beta, vespo)
    grpo_trainer._metrics["train"].clear()
    trl = trl_side(grpo_trainer, monkeypatch, r, beta)
    batch, outputs = r.alignzoo_batch(reference=beta > 0)
    assert_parity(run_alignzoo(algorithm, batch, outputs, advantages=False), trl)
    # the mean Gamma weight over sequences is TRL's vespo/phi_seq_mean
    pm_batch, pm_outputs = r.alignzoo_batch(reference=beta > 0)
    metrics = algorithm.compute_loss(pm_batch, pm_outputs, pm_batch.loss_context()).metrics
    [trl_phi] = grpo_trainer._metrics["train"]["vespo/phi_seq_mean"]
    assert metrics["grpo/vespo_phi"] == pytest.approx(trl_phi, rel=1e-9)
    assert trl_phi != pytest.approx(1.0, abs=1e-3)  # phi(1) = 1: the rollouts are off-policy


# One optimizer step in two micro-batches of 4 sequences: alignzoo normalises each share by the
# step's LossContext; TRL divides "sapo" and "luspo" by current_gradient_accumulation_steps = 2
# (equal to alignzoo's step-wide sequence count since the halves hold equally many sequences)
# and "cispo" and "vespo" by num_items_in_batch, the step's tokens.
@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_surrogates_micro_batches_match_trl(
    grpo_trainer: GRPOTrainer, monkeypatch: pytest.MonkeyPatch, loss_type: str
) -> None:
    r = make_rollouts(seed=5, size=8, width=6)
    halves = [torch.arange(0, 4), torch.arange(4, 8)]
    beta = 0.04
    level = "sequence" if loss_type == "luspo" else "token"
    extra = {"cispo": {"cispo_ratio_max": 1.3}, "sapo": SAPO_DEFAULT, "vespo": VESPO_DEFAULT}
    algorithm = configure(
        monkeypatch, grpo_trainer, loss_type, level, beta, extra.get(loss_type, {}), accumulation=2
    )
    leaf = r.logps.clone().requires_grad_(True)
    step_tokens = float(r.mask.sum())
    trl_loss = sum(
        trl_grpo_loss(grpo_trainer, monkeypatch, leaf[rows], r.trl_inputs(rows, beta, step_tokens))
        for rows in halves
    )
    assert isinstance(trl_loss, torch.Tensor)
    trl_loss.backward()

    batch, outputs = r.alignzoo_batch(reference=True)
    step = batch.loss_context(micro_batches=2)

    def share(rows: torch.Tensor, context: LossContext) -> torch.Tensor:
        micro = PolicyOutputs(logprobs=outputs.logprobs[rows])
        return alignzoo_loss(algorithm, batch.select(rows), micro, context, advantages=False)

    az_loss = sum(share(rows, step) for rows in halves)
    assert isinstance(az_loss, torch.Tensor)
    az_loss.backward()
    assert outputs.logprobs.grad is not None and leaf.grad is not None
    assert_parity((az_loss.detach(), outputs.logprobs.grad), (trl_loss.detach(), leaf.grad))


def test_every_trl_grpo_loss_type_is_tested_here_or_in_the_parity_suite() -> None:
    """Every loss type TRL 1.16's GRPOTrainer._compute_loss branches on has a parity test:
    the four aggregations in test_trl_parity, the surrogates here."""
    import inspect
    import re

    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._compute_loss)
    named = set(re.findall(r'loss_type == "(\w+)"', source))
    for group in re.findall(r"loss_type in \[([^\]]+)\]", source):
        named |= set(re.findall(r'"(\w+)"', group))
    assert named == {"grpo", "bnpo", "dr_grpo", "dapo", *AGGREGATION}, named
