"""SimPO: simple preference optimisation with a length-normalised reward and no reference model.

Meng, Xia and Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward".
The implicit reward is the *average* per-token log-prob of a response, scaled by β,

    r(x, y) = β / |y| · log π(y|x) = β · mean_t log π(y_t | x, y_<t),

and the loss is a Bradley-Terry loss with a target reward margin γ (the SimPO objective):

    L_SimPO = -log σ( β/|y_w| log π(y_w|x) - β/|y_l| log π(y_l|x) - γ ).

The paper tunes β and the ratio γ/β; so does this plugin: ``gamma_beta_ratio`` is γ/β and the
margin is γ = gamma_beta_ratio · β (β = 2.0 and γ/β = 0.5 by default, i.e. γ = 1.0).
No reference model is loaded.

Data layout (as for DPO):

- ``batch.group_ids [B]``: the two responses of one pair share a group id; each group holds
  exactly one chosen and one rejected sample, in any order and position.
- ``batch.labels [B]``: 1.0 for the chosen response, 0.0 for the rejected one.
- ``outputs.logprobs [B, R]``: per-token policy log-probs, with gradient.
- ``batch.response_mask [B, R]``: 1.0 on real tokens; |y| is the number of real tokens.
- ``batch.weights [B]`` (optional): a pair is weighted by the mean of its samples' weights;
  the loss is the mean over the optimizer step's pairs (``context.groups``).

``compute_advantages`` returns the batch unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.preference import (
    mean_over_pairs,
    pair_indices,
    pair_weights,
    preference_metrics,
    require_labels,
)
from alignzoo.types import AlgorithmRequirements, LossContext, LossOutput

if TYPE_CHECKING:
    import torch

    from alignzoo import ops
    from alignzoo.batch import PolicyOutputs, RolloutBatch
else:
    torch = lazy_import("torch")
    ops = lazy_import("alignzoo.ops")


class SimPOParams(BaseModel):
    """Parameters of SimPO."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(2.0, gt=0.0, description="β: scale of the length-normalised reward")
    gamma_beta_ratio: float = Field(
        0.5,
        ge=0.0,
        description="γ/β: the target reward margin γ divided by β (margin γ = ratio · β)",
    )


# --------------------------------------------------------------------------- pure functions


def average_logps(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1/|y| · log π(y|x): the mean per-token log-prob over real tokens, ``[B, R]`` -> ``[B]``."""
    return ops.masked_mean(logprobs, mask, dim=-1)


def simpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    beta: float,
    gamma_beta_ratio: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair SimPO losses ``[N]`` and the rewards of chosen and rejected ``[N]``."""
    chosen_rewards = beta * chosen_avg_logps  # r(x, y_w) = β/|y_w| log π(y_w|x)
    rejected_rewards = beta * rejected_avg_logps  # r(x, y_l) = β/|y_l| log π(y_l|x)
    gamma = gamma_beta_ratio * beta  # target margin γ
    losses = -torch.nn.functional.logsigmoid(chosen_rewards - rejected_rewards - gamma)  # SimPO
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


# --------------------------------------------------------------------------- plugin


class SimPO(Algorithm):
    """SimPO (Meng 2024): length-normalised reward with a target margin, no reference model."""

    Params = SimPOParams
    params: SimPOParams
    watched_metrics = ("simpo/rewards/accuracy", "simpo/rewards/margin")
    requirements = AlgorithmRequirements(
        reference=False, data="preference", entropy=False, weights=True
    )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        p = self.params
        labels = require_labels(batch, "SimPO")
        chosen, rejected = pair_indices(batch.group_ids, labels)
        avg_logps = average_logps(outputs.logprobs, batch.response_mask)
        losses, chosen_rewards, rejected_rewards = simpo_loss(
            avg_logps[chosen], avg_logps[rejected], p.beta, p.gamma_beta_ratio
        )
        weights = pair_weights(batch.weights, chosen, rejected)
        loss = mean_over_pairs(losses, weights, context)  # E over the step's pairs
        metrics = preference_metrics(
            "simpo",
            mean_over_pairs(losses.detach(), weights, None),
            chosen_rewards,
            rejected_rewards,
            avg_logps[chosen],
            avg_logps[rejected],
        )
        return LossOutput(loss=loss, metrics=metrics)
