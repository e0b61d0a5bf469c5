"""What RLOO and REINFORCE++ share: REINFORCE with a KL-penalised reward and PPO's clip, no critic.

Both score a whole response, penalise the reward by ``beta * KL_t`` of each sampled token to the
reference (RLOO sums it over the response, REINFORCE++ keeps it per token) and train PPO's
clipped surrogate on their advantages, as both papers do (at ratio 1, one update per batch, it
is REINFORCE):

    L = -min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)        (PPO, Schulman 2017, eq. 7)

They differ only in the advantage A_t. :class:`KLPenalisedReinforce` holds the rest (what the
algorithm needs, the reward's KL term, the loss, TRL's options on the policy term from
:mod:`alignzoo.algorithms.policy_term`); each algorithm's module has its params, with its
paper's defaults, and its advantages (``fill_advantages``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

from alignzoo._lazy import lazy_import
from alignzoo.algorithms.policy_term import (
    PolicyTermParams,
    batch_policy_mask,
    mask_truncated,
    truncation_metrics,
)
from alignzoo.errors import UserError
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.types import AlgorithmRequirements, LossAggregation, LossContext, LossOutput

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import PolicyOutputs, RolloutBatch
    from alignzoo.ops import KLEstimator

ops = lazy_import("alignzoo.ops")


class KLPenalisedReinforceParams(Protocol):
    """The params :class:`KLPenalisedReinforce` reads (each algorithm's own model has them)."""

    kl_coef: float
    kl_estimator: KLEstimator
    clip_eps: float
    loss_aggregation: LossAggregation
    norm_constant: float | None


class KLPenalisedReinforce(Algorithm):
    """Base of RLOO and REINFORCE++: a subclass sets ``namespace`` and ``Params`` (with
    :class:`~alignzoo.algorithms.policy_term.PolicyTermParams`) and implements
    :meth:`fill_advantages` (with :meth:`reward_terms`)."""

    namespace: ClassVar[str]
    """The algorithm's name: the prefix of its errors and the namespace of its own metrics."""
    params: KLPenalisedReinforceParams
    watched_metrics = ("actor/clipfrac",)

    def fill_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """Set ``batch.advantages`` (and the rewards and returns the algorithm reports)."""
        raise NotImplementedError

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        batch = self.fill_advantages(batch)
        if getattr(self.params, "mask_truncated_completions", False):
            mask_truncated(batch, self.namespace)  # after the advantages: their rewards count
        return batch

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        kl = self.params.kl_coef > 0  # the KL penalty in the reward reads old_logprobs
        return AlgorithmRequirements(
            reference=kl,
            critic=False,
            old_logprobs_in_advantages=kl,
            rollout_correction=True,
            weights=True,
            # REINFORCE++'s per-token rewards take step rewards (its dense_reward_coef);
            # RLOO's one advantage per sequence has no place for them.
            dense_rewards=getattr(self.params, "dense_reward_coef", 0.0) > 0,
            truncation=getattr(self.params, "mask_truncated_completions", False),
        )

    def reward_terms(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scores ``[B]`` and the KL_t ``[B, R]`` of each sampled token to the reference that
        the reward is penalised by (the ``kl_estimator`` of log pi_old - log pi_ref; None when
        ``kl_coef`` is 0)."""
        name = self.namespace
        if batch.scores is None:
            raise UserError(f"{name}: batch.scores is missing; the labeler must score every sample")
        if self.params.kl_coef <= 0:
            return batch.scores, None
        if batch.ref_logprobs is None or batch.old_logprobs is None:
            raise UserError(f"{name}: kl_coef > 0 needs batch.old_logprobs and batch.ref_logprobs")
        kl = ops.masked_kl_penalty(
            batch.old_logprobs, batch.ref_logprobs, batch.response_mask, self.params.kl_estimator
        )
        return batch.scores, kl

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        if batch.advantages is None or batch.old_logprobs is None:
            raise UserError(
                f"{self.namespace}: compute_loss needs batch.advantages and batch.old_logprobs"
            )
        params = self.params
        loss, metrics, kept = clipped_loss(params, batch, outputs, context, name=self.namespace)
        if batch.ref_logprobs is not None:  # the estimator of the reward's KL penalty, now
            kl = ops.masked_kl_penalty(
                outputs.logprobs.detach(),
                batch.ref_logprobs,
                batch.response_mask,
                params.kl_estimator,
            )
            metrics[f"{self.namespace}/kl_penalty"] = ops.masked_mean(kl, batch.response_mask)
        return LossOutput(
            loss, {name: float(value) for name, value in metrics.items()}, entropy_mask=kept
        )


class ClippedLossParams(Protocol):
    """The params :func:`clipped_loss` reads."""

    clip_eps: float
    loss_aggregation: LossAggregation
    norm_constant: float | None


def clipped_loss(
    params: ClippedLossParams,
    batch: RolloutBatch,
    outputs: PolicyOutputs,
    context: LossContext,
    name: str = "algorithm",
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """PPO's clipped surrogate on ``batch.advantages``, symmetric clip, sample weights and the
    rollout correction applied, aggregated over the optimizer step (RLOO, REINFORCE++, OPD),
    with TRL's options on the policy term when ``params`` has them (``name`` prefixes errors).
    Returns the loss, its metrics and the tokens the entropy quantile kept (None: all; the
    entropy bonus acts on them)."""
    assert batch.advantages is not None and batch.old_logprobs is not None
    keep, entropy_kept, delta, metrics = None, None, None, {}
    if isinstance(params, PolicyTermParams):
        delta = params.delta
        masks = batch_policy_mask(params, batch, outputs, name)
        keep, entropy_kept, metrics = masks.keep, masks.entropy, dict(masks.metrics)
        metrics.update(truncation_metrics(params, batch))
    loss, loss_metrics = ops.clipped_policy_loss(
        outputs.logprobs,
        batch.old_logprobs,
        batch.advantages,
        batch.response_mask,
        params.clip_eps,
        params.clip_eps,
        delta=delta,
        policy_mask=keep,  # the off-policy mask, the entropy quantile (TRL's options)
        aggregation=params.loss_aggregation,
        norm_constant=params.norm_constant,
        weights=batch.weights,
        token_weights=batch.rollout_is_weights,  # TIS, when training.rollout_correction is on
        context=context,
    )  # -min(r A, clip(r, 1 - eps, 1 + eps) A), aggregated over the optimizer step
    return loss, {**loss_metrics, **metrics}, entropy_kept
