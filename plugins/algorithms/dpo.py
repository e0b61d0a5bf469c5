"""DPO: direct preference optimisation, with its cDPO, IPO, hinge (SLiC) and robust variants.

Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
Model". With the implicit reward r(x, y) = β log π(y|x)/π_ref(y|x), the DPO loss (eq. 7) is

    L_DPO = -log σ(β h),    h = [log π(y_w) - log π_ref(y_w)] - [log π(y_l) - log π_ref(y_l)]

where y_w is the chosen and y_l the rejected response, and log π(y) is a *sequence* log-prob
(the sum of the per-token log-probs over real response tokens). Variants (``loss_type``):

- ``sigmoid`` with ``label_smoothing`` ε: conservative DPO (cDPO, Mitchell 2023, "A note on DPO
  with noisy preferences"): -(1-ε) log σ(βh) - ε log σ(-βh), the expected loss when a fraction ε
  of the labels is flipped.
- ``ipo``: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences", the empirical IPO loss (h - 1/(2β))², with β playing the role of the paper's τ.
  As in the paper, h is built from sequence (summed) log-probs, not length-normalised ones.
  It is minimised at margin h = 1/(2β).
- ``hinge``: the SLiC calibration loss (Zhao et al. 2023, "SLiC-HF") on the reference-adjusted
  margin: max(0, 1 - βh).
- ``robust``: rDPO, Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with
  Noisy Feedback": the unbiased loss under a known flip rate ε = ``label_smoothing``,
  [(1-ε) ℓ(h) - ε ℓ(-h)] / (1 - 2ε) with ℓ(h) = -log σ(βh).

``reference_free: true`` drops π_ref (its log-probs are taken as 0), so no reference model is
loaded and the rewards are β log π(y).

Data layout (how the engine hands pairs to this algorithm):

- ``batch.group_ids [B]``: the two responses of one pair share a group id. Each group holds
  exactly one chosen and one rejected sample; they need not be adjacent or in any order.
- ``batch.labels [B]``: 1.0 for the chosen response, 0.0 for the rejected one.
- ``batch.ref_logprobs [B, R]``: per-token reference log-probs (unless ``reference_free``).
- ``outputs.logprobs [B, R]``: per-token policy log-probs, with gradient.
- ``batch.response_mask [B, R]``: 1.0 on real response tokens; sequence log-probs sum over it.
- ``batch.weights [B]`` (optional): per-sample weights; a pair is weighted by the mean of its
  two samples' weights, and the loss is the mean over the optimizer step's pairs of
  weight × pair loss (``context.groups``: each group is one pair).

The pairing helpers are public, in :mod:`alignzoo.preference`; the engine's preference data
modes (:mod:`alignzoo.engine.modes.preference`) build the pairs, offline or online.

``compute_advantages`` returns the batch unchanged: DPO needs no advantages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.preference import (
    mean_over_pairs,
    pair_indices,
    pair_weights,
    preference_metrics,
    require_labels,
    sequence_logps,
)
from alignzoo.types import AlgorithmRequirements, LossContext, LossOutput

if TYPE_CHECKING:
    import torch

    from alignzoo import ops
    from alignzoo.batch import PolicyOutputs, RolloutBatch
else:
    torch = lazy_import("torch")
    ops = lazy_import("alignzoo.ops")

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]


class DPOParams(BaseModel):
    """Parameters of DPO and its variants."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(
        0.1, gt=0.0, description="β: strength of the KL regularisation to the reference (τ in IPO)"
    )
    loss_type: DPOLossType = Field(
        "sigmoid",
        description="sigmoid (DPO / cDPO), ipo (Azar 2023), hinge (SLiC), robust (rDPO)",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="ε: assumed fraction of flipped labels (cDPO for sigmoid, rDPO for robust)",
    )
    reference_free: bool = Field(
        False, description="drop the reference policy: rewards are β log π(y) (no ref model)"
    )

    @model_validator(mode="after")
    def _smoothing_needs_a_loss_that_uses_it(self) -> DPOParams:
        if self.label_smoothing > 0 and self.loss_type not in ("sigmoid", "robust"):
            raise ValueError(
                f"label_smoothing applies to loss_type 'sigmoid' (cDPO) and 'robust' (rDPO), "
                f"not {self.loss_type!r}; set label_smoothing: 0"
            )
        return self


# --------------------------------------------------------------------------- pure functions


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses ``[N]`` and the implicit rewards of chosen and rejected ``[N]``.

    All inputs are sequence log-probs ``[N]``; for reference-free DPO pass zeros as reference.
    """
    chosen_ratio = chosen_logps - ref_chosen_logps  # log π(y_w)/π_ref(y_w)
    rejected_ratio = rejected_logps - ref_rejected_logps  # log π(y_l)/π_ref(y_l)
    margin = chosen_ratio - rejected_ratio  # h, the log-ratio margin
    eps = label_smoothing
    logsig = torch.nn.functional.logsigmoid
    if loss_type == "sigmoid":
        # DPO eq. 7: -log σ(βh); cDPO (Mitchell 2023): -(1-ε) log σ(βh) - ε log σ(-βh)
        losses = -(1.0 - eps) * logsig(beta * margin) - eps * logsig(-beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2  # IPO (Azar 2023): (h - 1/(2τ))²
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * margin)  # SLiC (Zhao 2023): max(0, 1 - βh)
    elif loss_type == "robust":
        # rDPO (Chowdhury 2024): [(1-ε) ℓ(h) + ε log σ(-βh)] / (1-2ε), ℓ(h) = -log σ(βh)
        losses = (-(1.0 - eps) * logsig(beta * margin) + eps * logsig(-beta * margin)) / (
            1.0 - 2.0 * eps
        )
    else:
        raise UserError(
            f"unknown DPO loss_type {loss_type!r}; expected sigmoid, ipo, hinge, robust"
        )
    chosen_rewards = beta * chosen_ratio.detach()  # r(x, y_w) = β log π/π_ref
    rejected_rewards = beta * rejected_ratio.detach()  # r(x, y_l)
    return losses, chosen_rewards, rejected_rewards


# --------------------------------------------------------------------------- plugin


class DPO(Algorithm):
    """Direct preference optimisation (Rafailov 2023) with cDPO, IPO, hinge and robust variants."""

    Params = DPOParams
    params: DPOParams
    watched_metrics = ("dpo/rewards/accuracy", "dpo/rewards/margin")

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        return AlgorithmRequirements(
            reference=not self.params.reference_free, data="preference", entropy=False, weights=True
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        p = self.params
        labels = require_labels(batch, "DPO")
        chosen, rejected = pair_indices(batch.group_ids, labels)
        logps = sequence_logps(outputs.logprobs, batch.response_mask)
        if p.reference_free:
            ref_logps = torch.zeros_like(logps)
        elif batch.ref_logprobs is None:
            raise UserError(
                "DPO needs batch.ref_logprobs (a reference model); "
                "set reference_free: true to train without one"
            )
        else:
            ref_logps = sequence_logps(batch.ref_logprobs, batch.response_mask).detach()
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            logps[chosen],
            logps[rejected],
            ref_logps[chosen],
            ref_logps[rejected],
            beta=p.beta,
            loss_type=p.loss_type,
            label_smoothing=p.label_smoothing,
        )
        weights = pair_weights(batch.weights, chosen, rejected)
        loss = mean_over_pairs(losses, weights, context)  # E over the step's pairs
        metrics = preference_metrics(
            "dpo",
            mean_over_pairs(losses.detach(), weights, None),
            chosen_rewards,
            rejected_rewards,
            logps[chosen],
            logps[rejected],
        )
        return LossOutput(loss=loss, metrics=metrics)
