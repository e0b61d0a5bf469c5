"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", section 4.1).

No critic: each prompt is sampled G times and a sample's advantage is its reward relative to
its group, ``A_i = (r_i - mean(r_group)) / std(r_group)`` (outcome supervision,
section 4.1.2), given to every token of the response. The policy loss is PPO's clipped surrogate
plus a k3 estimate of KL(pi || pi_ref) weighted by beta (the GRPO objective, eq. 3).

Variants, all selected by params:

- ``scale_rewards``: ``"group"`` (the paper), ``"batch"`` (std over the whole batch) or
  ``"none"`` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": no std division).
- ``clip_eps_low`` / ``clip_eps_high``: asymmetric clipping (DAPO "clip-higher", Yu et al. 2025).
- ``importance_ratio``: ``"token"`` (the paper) or ``"sequence"`` (GSPO, Zheng et al. 2025: one
  length-normalised ratio per sequence, ``s_i = exp(mean_t log(pi / pi_old))``).
- ``loss_aggregation``: any mode of :func:`alignzoo.ops.aggregate_loss`; ``norm_constant`` is Dr.
  GRPO's constant for ``seq-mean-token-sum-norm``.
- ``beta = 0``: no KL term, and no reference model is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.types import (
    AggregationParams,
    AlgorithmRequirements,
    LossAggregation,
    LossContext,
    LossOutput,
)

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import PolicyOutputs, RolloutBatch

torch = lazy_import("torch")
ops = lazy_import("alignzoo.ops")

ScaleRewards = Literal["group", "batch", "none"]


class GRPOParams(AggregationParams):
    """Parameters of GRPO; defaults follow Shao et al. 2024."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(
        0.04, ge=0.0, description="KL coefficient (k3 estimator); 0 disables KL and the reference"
    )
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="lower clip range: r >= 1 - eps")
    clip_eps_high: float = Field(
        0.2, gt=0.0, description="upper clip range: r <= 1 + eps (DAPO clip-higher uses 0.28)"
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="divide centred rewards by the group std, the batch std, or not (Dr. GRPO)",
    )
    importance_ratio: Literal["token", "sequence"] = Field(
        "token",
        description="per-token ratio, or GSPO's length-normalised sequence ratio (whose ratios "
        "stay near 1: the GSPO paper clips at 1 - 3e-4 and 1 + 4e-4, not 0.2)",
    )
    loss_aggregation: LossAggregation = Field(
        "seq-mean-token-mean", description="how per-token losses are reduced (see ops)"
    )

    eps: float = Field(1e-6, gt=0.0, description="added to the std before dividing")


# --------------------------------------------------------------------------- pure functions


def group_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    scale: ScaleRewards = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Sequence advantages ``[B]``: reward minus its group's mean, scaled as asked.

    A group whose rewards are all equal gets advantage 0 exactly (not rounding noise divided by
    a tiny std), as does a group of one: it carries no learning signal.
    """
    scores = scores.float()
    mean, group_std, _ = ops.group_mean_std(scores, group_ids)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    empty = scores.new_zeros(int(inverse.max()) + 1 if inverse.numel() else 0)
    group_max = empty.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    group_min = empty.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    flat = (group_max == group_min)[inverse]
    centred = torch.where(flat, 0.0, scores - mean)  # r_i - mean(r)  (outcome supervision)
    if scale == "group":
        # ... / std(r)  (outcome supervision, Shao et al.)
        return torch.where(flat, 0.0, centred / (group_std + eps).clamp(min=1e-12))
    if scale == "batch":
        batch_std = ops.global_std(scores)  # over the whole (global) batch
        return centred / (batch_std + eps).clamp(min=1e-12)
    return centred  # Dr. GRPO: no std normalisation (Liu et al. 2025)


def policy_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """log(pi / pi_old) per token ``[B, R]``; zero on padding (whatever the padding holds).

    At sequence level every token of a sequence carries ``mean_t log(pi / pi_old)``, the log of
    GSPO's importance ratio ``s_i = (pi(y_i|x) / pi_old(y_i|x)) ** (1 / |y_i|)`` (Zheng et al. 2025),
    so its gradient reaches every token of the sequence.
    """
    mask_b = mask.bool()
    token = torch.where(mask_b, logprobs, 0.0) - torch.where(mask_b, old_logprobs, 0.0)
    if level == "token":
        return token
    sequence = ops.masked_mean(token, mask, dim=-1)  # log s_i, the GSPO sequence importance ratio
    return torch.where(mask_b, sequence.unsqueeze(-1).expand_as(token), 0.0)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
    ref_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    context: LossContext | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO objective (Shao et al. 2024, eq. 3), negated: the clipped surrogate plus beta * KL.

    All inputs are ``[B, R]`` (``weights`` ``[B]``); ``is_weights`` are the rollout
    correction's truncated importance weights on the surrogate (not on the KL term). The loss is aggregated over the optimizer
    step's counts in ``context`` (this batch's own without it). Returns the scalar loss and
    detached metric tensors (``grpo/kl_k3`` only when ``ref_logprobs`` is given).
    """
    mask_b = mask.bool()
    advantages = torch.where(mask_b, advantages, 0.0)
    log_ratio = policy_log_ratio(logprobs, old_logprobs, mask, params.importance_ratio)
    pg_mat, clipped_low, clipped_high = ops.clipped_surrogate(
        log_ratio, advantages, params.clip_eps_low, params.clip_eps_high
    )  # -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  (GRPO eq. 3; DAPO clip-higher)
    pg_mat = ops.weight_tokens(pg_mat, is_weights)  # TIS (training.rollout_correction)
    loss_mat = pg_mat
    metrics: dict[str, torch.Tensor] = {}
    if ref_logprobs is not None:
        kl_mat = ops.masked_kl_penalty(logprobs, ref_logprobs, mask, "k3")  # GRPO eq. 4
        metrics["grpo/kl_k3"] = ops.masked_mean(kl_mat.detach(), mask)
        if params.beta > 0:
            loss_mat = loss_mat + params.beta * kl_mat  # ... - beta * D_KL(pi || pi_ref)  (eq. 3)

    def aggregate(mat: torch.Tensor, ctx: LossContext | None) -> torch.Tensor:
        weighted = ops.weight_samples(mat, weights)
        return ops.aggregate_loss(
            weighted, mask, params.loss_aggregation, params.norm_constant, ctx
        )

    loss = aggregate(loss_mat, context)  # this micro-batch's share of the step's loss
    metrics["actor/pg_loss"] = aggregate(pg_mat.detach(), None)  # its own mean
    metrics.update(ops.clip_fractions(clipped_low, clipped_high, mask))
    metrics["actor/approx_kl"] = ops.approx_kl(logprobs, old_logprobs, mask)
    return loss, metrics


# --------------------------------------------------------------------------- plugin


class GRPO(Algorithm):
    """GRPO (Shao et al. 2024): group-relative advantages, clipped surrogate, k3 KL; Dr. GRPO, DAPO and GSPO variants."""

    Params = GRPOParams
    params: GRPOParams
    watched_metrics = ("actor/clipfrac",)

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        return AlgorithmRequirements(
            reference=self.params.beta > 0,
            critic=False,
            data="online",
            rollout_correction=True,
            weights=True,
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        if batch.scores is None:
            raise UserError("grpo: batch.scores is missing; the labeler must score every sample")
        seq_adv = group_advantages(
            batch.scores, batch.group_ids, self.params.scale_rewards, self.params.eps
        )
        mask = batch.response_mask
        batch.advantages = seq_adv.unsqueeze(-1) * mask.to(seq_adv.dtype)
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        if batch.advantages is None or batch.old_logprobs is None:
            raise UserError("grpo: compute_loss needs batch.advantages and batch.old_logprobs")
        if self.params.beta > 0 and batch.ref_logprobs is None:
            raise UserError("grpo: beta > 0 needs batch.ref_logprobs (the reference model)")
        loss, metrics = grpo_loss(
            outputs.logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.response_mask,
            self.params,
            ref_logprobs=batch.ref_logprobs,
            weights=batch.weights,
            context=context,
            is_weights=batch.rollout_is_weights,
        )
        return LossOutput(loss, {k: float(v) for k, v in metrics.items()})
