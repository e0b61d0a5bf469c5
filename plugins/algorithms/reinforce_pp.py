"""REINFORCE++ (Hu et al. 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

No critic and no groups: every token is penalised by its KL to the reference, the score is added
on the last token, and the (discounted) return-to-go is the advantage, normalised over the whole
batch:

    r_t   = 1[t = T] * score - beta * KL_t + c * d_t                (token-level KL penalty)
    G_t   = sum_{s >= t} gamma^(s - t) r_s                          (return-to-go)
    A_t   = (G_t - mean_batch(G)) / std_batch(G)                    (global batch normalisation)

``d_t`` is the labeler's step score (``Score.steps``, a process reward model's) on the last
token of each step (``batch.dense_rewards``), weighted by ``dense_reward_coef``: the
return-to-go carries it to the step's tokens and those before. Without step scores the
advantages are exactly the sequence-level ones.

The loss is PPO's clipped surrogate on these advantages, as in RLOO: the two differ only in
their advantages and share the rest
(:class:`~alignzoo.algorithms.reinforce.KLPenalisedReinforce`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.algorithms.policy_term import PolicyTermParams
from alignzoo.algorithms.reinforce import KLPenalisedReinforce
from alignzoo.types import AggregationParams, LossAggregation

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import RolloutBatch

torch = lazy_import("torch")
ops = lazy_import("alignzoo.ops")


class ReinforcePlusPlusParams(AggregationParams, PolicyTermParams):
    """Parameters of REINFORCE++; defaults follow Hu et al. 2025 (TRL's options on the policy term, ``delta``,
    ``top_entropy_quantile``, ``off_policy_mask_threshold`` and ``mask_truncated_completions``,
    from :class:`~alignzoo.algorithms.policy_term.PolicyTermParams`)."""

    model_config = ConfigDict(extra="forbid")

    kl_coef: float = Field(
        0.01, ge=0.0, description="beta of the per-token KL penalty in the reward; 0: no reference"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="per-token KL estimator")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of the return-to-go")
    dense_reward_coef: float = Field(
        1.0,
        ge=0.0,
        description="weight of the labeler's step scores (batch.dense_rewards, a process reward "
        "model's) in the per-token reward, each on the last token of its step; 0 ignores them",
    )
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
    dense: torch.Tensor | None = None,
    dense_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rewards, returns and batch-normalised advantages, each ``[B, R]``, zero on padding
    (``dense``: per-token step rewards ``[B, R]``, weighted by ``dense_coef``)."""
    # 1[t = T] * score - beta KL_t + c * d_t
    rewards = ops.token_level_rewards(scores, mask, kl, kl_coef, dense, dense_coef)
    _, returns = ops.gae(
        rewards, torch.zeros_like(rewards), mask, gamma, 1.0
    )  # G_t  (return-to-go)
    advantages = ops.masked_whiten(returns, mask)  # A = (G - mean) / std over the batch
    return rewards, returns, advantages


# --------------------------------------------------------------------------- plugin


class ReinforcePlusPlus(KLPenalisedReinforce):
    """REINFORCE++ (Hu et al. 2025): token-level KL in the reward, batch-normalised returns, no critic."""

    namespace = "reinforce_pp"
    Params = ReinforcePlusPlusParams
    params: ReinforcePlusPlusParams

    def fill_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        scores, kl = self.reward_terms(batch)
        p = self.params
        rewards, returns, advantages = reinforce_pp_advantages(
            scores, batch.response_mask, kl, p.kl_coef, p.gamma, batch.dense_rewards,
            p.dense_reward_coef,
        )  # fmt: skip
        batch.token_rewards, batch.returns, batch.advantages = rewards, returns, advantages
        return batch
