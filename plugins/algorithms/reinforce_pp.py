"""REINFORCE++ (Hu et al. 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

No critic and no groups: every token is penalised by its KL to the reference, the score is added
on the last token, and the (discounted) return-to-go is the advantage, normalised over the whole
batch:

    r_t   = 1[t = T] * score - beta * KL_t                          (token-level KL penalty)
    G_t   = sum_{s >= t} gamma^(s - t) r_s                          (return-to-go)
    A_t   = (G_t - mean_batch(G)) / std_batch(G)                    (global batch normalisation)

The loss is PPO's clipped surrogate on these advantages.
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


class ReinforcePlusPlusParams(AggregationParams):
    """Parameters of REINFORCE++; defaults follow Hu et al. 2025."""

    model_config = ConfigDict(extra="forbid")

    kl_coef: float = Field(
        0.01, ge=0.0, description="beta of the per-token KL penalty in the reward; 0: no reference"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="per-token KL estimator")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of the return-to-go")
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="clip range of the ratio")
    loss_aggregation: LossAggregation = Field(
        "token-mean", description="how per-token losses are reduced (see ops.aggregate_loss)"
    )


# --------------------------------------------------------------------------- pure functions


def reinforce_pp_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    kl_coef: float,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rewards, returns and batch-normalised advantages, each ``[B, R]``, zero on padding."""
    rewards = ops.token_level_rewards(scores, mask, kl, kl_coef)  # 1[t = T] * score - beta KL_t
    _, returns = ops.gae(
        rewards, torch.zeros_like(rewards), mask, gamma, 1.0
    )  # G_t  (return-to-go)
    advantages = ops.masked_whiten(returns, mask)  # A = (G - mean) / std over the batch
    return rewards, returns, advantages


# --------------------------------------------------------------------------- plugin


class ReinforcePlusPlus(Algorithm):
    """REINFORCE++ (Hu et al. 2025): token-level KL in the reward, batch-normalised returns, no critic."""

    Params = ReinforcePlusPlusParams
    params: ReinforcePlusPlusParams
    watched_metrics = ("actor/clipfrac",)

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        kl = self.params.kl_coef > 0  # the KL penalty in the reward reads old_logprobs
        return AlgorithmRequirements(
            reference=kl,
            critic=False,
            old_logprobs_in_advantages=kl,
            rollout_correction=True,
            weights=True,
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        if batch.scores is None:
            raise UserError(
                "reinforce_pp: batch.scores is missing; the labeler must score every sample"
            )
        mask = batch.response_mask
        kl = None
        if self.params.kl_coef > 0:
            if batch.ref_logprobs is None or batch.old_logprobs is None:
                raise UserError(
                    "reinforce_pp: kl_coef > 0 needs batch.old_logprobs and batch.ref_logprobs"
                )
            kl = ops.masked_kl_penalty(
                batch.old_logprobs, batch.ref_logprobs, mask, self.params.kl_estimator
            )
        rewards, returns, advantages = reinforce_pp_advantages(
            batch.scores, mask, kl, self.params.kl_coef, self.params.gamma
        )
        batch.token_rewards, batch.returns, batch.advantages = rewards, returns, advantages
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        if batch.advantages is None or batch.old_logprobs is None:
            raise UserError(
                "reinforce_pp: compute_loss needs batch.advantages and batch.old_logprobs"
            )
        params = self.params
        loss, metrics = ops.clipped_policy_loss(
            outputs.logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.response_mask,
            params.clip_eps,
            params.clip_eps,
            params.loss_aggregation,
            params.norm_constant,
            batch.weights,
            context,
            token_weights=batch.rollout_is_weights,  # TIS, when training.rollout_correction is on
        )  # -min(r A, clip(r, 1 - eps, 1 + eps) A), aggregated over the optimizer step
        if batch.ref_logprobs is not None:  # the estimator of the reward's KL penalty, now
            kl = ops.masked_kl_penalty(
                outputs.logprobs.detach(),
                batch.ref_logprobs,
                batch.response_mask,
                params.kl_estimator,
            )
            metrics["reinforce_pp/kl_penalty"] = ops.masked_mean(kl, batch.response_mask)
        return LossOutput(loss, {name: float(value) for name, value in metrics.items()})
