"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", section 3.2).

Each prompt is sampled k times; the baseline of a sample is the mean reward of the *other*
samples of its group, so the advantage is unbiased and needs no critic:

    A_i = r_i - 1/(k-1) * sum_{j != i} r_j                    (RLOO estimator, Ahmadian et al. 2024)

The whole response is one action: the sequence reward may carry a KL penalty to the reference,
``r_i = score_i - beta * sum_t KL_t``. Every token of a response gets its sequence's
advantage, and the loss is PPO's clipped surrogate without a critic (at ratio 1, after one
update per batch, it is exactly REINFORCE), as in REINFORCE++: the two differ only in
their advantages and share the rest
(:class:`~alignzoo.algorithms.reinforce.KLPenalisedReinforce`). A sample alone in
its group gets advantage 0.
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


class RLOOParams(AggregationParams, PolicyTermParams):
    """Parameters of RLOO; defaults follow Ahmadian et al. 2024 (TRL's options on the policy term, ``delta``,
    ``top_entropy_quantile``, ``off_policy_mask_threshold`` and ``mask_truncated_completions``,
    from :class:`~alignzoo.algorithms.policy_term.PolicyTermParams`)."""

    model_config = ConfigDict(extra="forbid")

    kl_coef: float = Field(
        0.05, ge=0.0, description="beta of the KL penalty in the sequence reward; 0: no reference"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="per-token KL estimator summed into the sequence penalty"
    )
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="clip range of the ratio")
    loss_aggregation: LossAggregation = Field(
        "seq-mean-token-sum",
        description="how per-token losses are reduced; the paper's sequence-level REINFORCE sums "
        "log-probs over the response",
    )


# --------------------------------------------------------------------------- pure functions


def sequence_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Sequence rewards ``[B]``: r = score - beta * sum_t KL_t  (KL-penalised reward)."""
    rewards = ops.upcast(scores)
    if kl is not None and kl_coef != 0.0:
        rewards = rewards - kl_coef * ops.masked_sum(ops.upcast(kl), mask, dim=-1)
    return rewards


def leave_one_out_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean of the other rewards of i's group ``[B]``; 0 for a group of one."""
    mean, _, count = ops.group_mean_std(rewards, group_ids)
    others = count - 1.0
    baseline = (mean * count - rewards) / others.clamp(min=1.0)  # 1/(k-1) sum_{j!=i} r_j  (RLOO)
    return torch.where(others > 0, rewards - baseline, 0.0)


# --------------------------------------------------------------------------- plugin


class RLOO(KLPenalisedReinforce):
    """RLOO (Ahmadian et al. 2024): REINFORCE with a leave-one-out group baseline, no critic."""

    namespace = "rloo"
    Params = RLOOParams
    params: RLOOParams

    def fill_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        scores, kl = self.reward_terms(batch)
        mask = batch.response_mask
        rewards = sequence_rewards(scores, mask, kl, self.params.kl_coef)  # score - beta sum KL_t
        advantages = leave_one_out_advantages(rewards, batch.group_ids)  # r_i - mean_{j != i} r_j
        batch.token_rewards = ops.last_token_scores(rewards, mask)
        batch.advantages = torch.where(mask.bool(), advantages.unsqueeze(-1), 0.0)
        return batch
