"""On-policy distillation: the policy samples, a teacher scores every sampled token, and the
policy learns to put its probability where the teacher does (Agarwal et al. 2024, "On-Policy
Distillation of Language Models", the lambda = 1 case of GKD with the reverse KL; as
tinker-cookbook's ``distillation/train_on_policy.py`` and prime-rl's ``algo.type=opd`` train it).

The objective is the reverse KL from the policy to the teacher on the policy's own samples,

    KL(pi || pi_T) = E_{y ~ pi} [ sum_t log pi(y_t | y_<t) - log pi_T(y_t | y_<t) ]

whose policy gradient with each token's own term as its reward (no credit to earlier tokens,
a discount of 0, as the references do) is REINFORCE on the per-token advantage

    A_t = -beta * (log pi_old(y_t | y_<t) - log pi_T(y_t | y_<t))      (reverse KL, per token)

a dense reward: a token the teacher finds likelier than the policy did gains probability, one
it finds less likely loses it. The update is PPO's clipped surrogate on these advantages (at
ratio 1, one update per batch, it is that REINFORCE):

    L = -min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)        (PPO, Schulman 2017, eq. 7)

The labeler's scores are not used: the teacher is the only signal (its rewards are still
logged and evaluated as for every arm, so an A/B against RL compares the same metric).
``model.teacher`` names the teacher; the engine fills ``batch.teacher_logprobs`` with its
log-probs of the sampled tokens at the sampling temperature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.algorithms.reinforce import clipped_loss
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


class OPDParams(AggregationParams):
    """Parameters of on-policy distillation; defaults follow tinker-cookbook's recipe."""

    model_config = ConfigDict(extra="forbid")

    kl_coef: float = Field(
        1.0, gt=0.0, description="beta: the weight of the per-token reverse KL to the teacher"
    )
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="clip range of the ratio")
    loss_aggregation: LossAggregation = Field(
        "token-mean", description="how per-token losses are reduced (a token is a step here)"
    )


# --------------------------------------------------------------------------- pure functions


def reverse_kl_advantages(
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """A_t = -beta * (log pi_old(y_t) - log pi_T(y_t)) on real tokens, 0 on padding ``[B, R]``."""
    reverse_kl = ops.upcast(old_logprobs) - ops.upcast(teacher_logprobs)  # per-token reverse KL
    return torch.where(mask.bool(), -kl_coef * reverse_kl, 0.0)


# --------------------------------------------------------------------------- plugin


class OPD(Algorithm):
    """On-policy distillation: per-token reverse KL to a teacher on the policy's own samples."""

    Params = OPDParams
    params: OPDParams
    watched_metrics = ("actor/clipfrac", "opd/reverse_kl")

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        return AlgorithmRequirements(
            teacher=True,
            old_logprobs_in_advantages=True,  # the advantages read pi_old
            rollout_correction=True,
            weights=True,
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        if batch.teacher_logprobs is None or batch.old_logprobs is None:
            raise UserError(
                "opd: the batch has no teacher log-probs; the arm needs model.teacher "
                "(a checkpoint folder, or the embedded world's teacher)"
            )
        advantages = reverse_kl_advantages(
            batch.old_logprobs, batch.teacher_logprobs, batch.response_mask, self.params.kl_coef
        )
        batch.advantages = advantages
        batch.token_rewards = advantages  # a dense reward: each token's own
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        if batch.advantages is None or batch.old_logprobs is None:
            raise UserError("opd: compute_loss needs batch.advantages and batch.old_logprobs")
        loss, metrics, _ = clipped_loss(self.params, batch, outputs, context, name="opd")
        mask = batch.response_mask
        if batch.teacher_logprobs is not None:  # how far the policy is from the teacher, now
            gap = outputs.logprobs.detach() - batch.teacher_logprobs
            metrics["opd/reverse_kl"] = ops.masked_mean(gap, mask)
            metrics["opd/teacher_logprob"] = ops.masked_mean(batch.teacher_logprobs, mask)
        return LossOutput(loss, {name: float(value) for name, value in metrics.items()})
