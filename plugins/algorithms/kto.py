"""KTO: Kahneman-Tversky optimisation from unpaired desirable / undesirable completions.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization". With the
implied reward r(x, y) = log π(y|x)/π_ref(y|x) (sequence log-probs) and the reference point

    z0 = max(0, KL(π(y'|x) || π_ref(y'|x))),

the KTO loss is E[λ_y - v(x, y)] with the value function

    v(x, y) = λ_D σ(β (r(x, y) - z0))   if y is desirable,
              λ_U σ(β (z0 - r(x, y)))   if y is undesirable,

so a desirable sample costs λ_D (1 - σ(β(r - z0))) and an undesirable one λ_U (1 - σ(β(z0 - r))).
As in the paper, z0 is estimated from *mismatched* pairs in the batch (prompt x_i with another
sample's completion y_j): the mean of log π(y_j|x_i) - log π_ref(y_j|x_i), clamped at 0, with no
gradient through it. It is computed once per training step, in ``compute_advantages``, from the
whole step batch and the behaviour snapshot (the policy before the step's update), so it does
not depend on the micro-batching; every sample carries it in ``batch.columns["kto/z0"]``.

The paper recommends weights with λ_D n_D / (λ_U n_U) in [1, 4/3] (n_D, n_U: numbers of
desirable and undesirable examples). The ratio is computed on each micro-batch that holds both
kinds (``kto/weight_ratio``); when it falls outside that range the plugin warns once and sets
``kto/weight_ratio_outside_range`` to 1.0. Micro-batch counts are noisy: read the ratio over a
run, not one step.

Data layout (how the engine hands unpaired feedback to this algorithm):

- ``batch.labels [B]``: 1.0 for a desirable completion, 0.0 for an undesirable one.
- ``batch.ref_logprobs [B, R]``: per-token reference log-probs.
- ``outputs.logprobs [B, R]``: per-token policy log-probs, with gradient.
- ``batch.response_mask [B, R]``: 1.0 on real tokens; sequence log-probs sum over it.
- ``batch.columns["mismatched_logprobs"]`` and ``batch.columns["mismatched_ref_logprobs"]``
  ``[B]``: behaviour-snapshot and reference *sequence* log-probs of prompt i with another
  sample's completion, computed without gradients by the unpaired data mode
  (:mod:`alignzoo.engine.modes.unpaired`).
- ``batch.weights [B]`` (optional): multiplies each sample's loss.
- ``batch.group_ids`` is not used.

The loss is the mean over the optimizer step's samples of weight × per-sample loss.
``compute_advantages`` adds ``batch.columns["kto/z0"]``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.types import AlgorithmRequirements, LossContext, LossOutput

if TYPE_CHECKING:
    import torch

    from alignzoo import ops
    from alignzoo.batch import PolicyOutputs, RolloutBatch
else:
    torch = lazy_import("torch")
    ops = lazy_import("alignzoo.ops")

RECOMMENDED_RATIO = (1.0, 4.0 / 3.0)
"""The paper's recommended range for λ_D n_D / (λ_U n_U)."""

MISMATCHED_LOGPROBS = "mismatched_logprobs"  # batch.columns keys of the unpaired data mode
MISMATCHED_REF_LOGPROBS = "mismatched_ref_logprobs"
Z0 = "kto/z0"


class KTOParams(BaseModel):
    """Parameters of KTO."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(0.1, gt=0.0, description="β: risk aversion / KL regularisation strength")
    desirable_weight: float = Field(1.0, gt=0.0, description="λ_D: weight of desirable samples")
    undesirable_weight: float = Field(1.0, gt=0.0, description="λ_U: weight of undesirable samples")


# --------------------------------------------------------------------------- pure functions


def kto_reference_point(
    mismatched_logps: torch.Tensor, mismatched_ref_logps: torch.Tensor
) -> torch.Tensor:
    """z0 = max(0, mean_i [log π(y_j|x_i) - log π_ref(y_j|x_i)]), detached (a scalar)."""
    # KL(π || π_ref) over the mismatched pairs of the whole (global) batch
    kl = ops.global_mean((mismatched_logps - mismatched_ref_logps).detach())
    return kl.clamp(min=0.0)  # z0 = max(0, KL), no gradient


def kto_loss(
    logratios: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """Per-sample KTO losses ``[B]`` from sequence log-ratios r ``[B]`` and a bool mask ``[B]``."""
    value_desirable = torch.sigmoid(beta * (logratios - z0))  # v(x, y) / λ_D = σ(β(r - z0))
    value_undesirable = torch.sigmoid(beta * (z0 - logratios))  # v(x, y) / λ_U = σ(β(z0 - r))
    desirable_loss = desirable_weight * (1.0 - value_desirable)  # λ_D - v(x, y)
    undesirable_loss = undesirable_weight * (1.0 - value_undesirable)  # λ_U - v(x, y)
    return torch.where(desirable, desirable_loss, undesirable_loss)


def weight_ratio(
    n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float
) -> float | None:
    """λ_D n_D / (λ_U n_U), or None when one of the two kinds is absent."""
    if n_desirable == 0 or n_undesirable == 0:
        return None
    return desirable_weight * n_desirable / (undesirable_weight * n_undesirable)


# --------------------------------------------------------------------------- plugin


class KTO(Algorithm):
    """KTO (Ethayarajh 2024): prospect-theoretic loss on unpaired desirable/undesirable samples."""

    Params = KTOParams
    params: KTOParams
    watched_metrics = ("kto/rewards/margin", "kto/z0")
    requirements = AlgorithmRequirements(
        reference=True, data="unpaired", entropy=False, weights=True
    )

    def __init__(self, params: KTOParams | dict | None = None) -> None:
        super().__init__(params)
        self._warned_ratio = False

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """z0 from the whole step batch, once per step, carried by every sample."""
        columns = batch.columns
        if MISMATCHED_LOGPROBS not in columns or MISMATCHED_REF_LOGPROBS not in columns:
            raise UserError(
                "KTO needs batch.columns['mismatched_logprobs'] and "
                "['mismatched_ref_logprobs'] (sequence log-probs of prompts with other samples' "
                "completions, for z0); the unpaired data mode adds them"
            )
        z0 = kto_reference_point(columns[MISMATCHED_LOGPROBS], columns[MISMATCHED_REF_LOGPROBS])
        columns[Z0] = z0.expand(batch.size).clone()
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        p = self.params
        labels = self._labels(batch)
        if batch.ref_logprobs is None:
            raise UserError("KTO needs batch.ref_logprobs (a reference model); none was given")
        if Z0 not in batch.columns:
            raise UserError("KTO: batch.columns['kto/z0'] is missing; compute_advantages sets it")
        desirable = labels == 1.0
        logps = ops.masked_sum(outputs.logprobs, batch.response_mask, dim=-1)  # log π(y|x)
        ref_logps = ops.masked_sum(batch.ref_logprobs, batch.response_mask, dim=-1).detach()
        logratios = logps - ref_logps  # r(x, y) = log π(y|x)/π_ref(y|x)
        z0 = batch.columns[Z0].to(logratios.dtype)
        losses = kto_loss(
            logratios, desirable, z0, p.beta, p.desirable_weight, p.undesirable_weight
        )
        if batch.weights is not None:
            losses = batch.weights * losses
        loss = ops.mean_over_samples(losses, context)  # E over the optimizer step's samples
        metrics = self._metrics(losses.detach().mean(), logratios, desirable, z0)
        return LossOutput(loss=loss, metrics=metrics)

    def _labels(self, batch: RolloutBatch) -> torch.Tensor:
        if batch.labels is None:
            raise UserError(
                "KTO needs batch.labels (1.0 desirable / 0.0 undesirable per sample); "
                "use unpaired feedback data or run the arm online"
            )
        bad = ((batch.labels != 1.0) & (batch.labels != 0.0)).nonzero().flatten().tolist()
        if bad:
            row = bad[0]
            raise UserError(
                f"batch.labels row {row} is {float(batch.labels[row])!r}; "
                "expected 1.0 (desirable) or 0.0 (undesirable)"
            )
        return batch.labels

    def _metrics(
        self, loss: torch.Tensor, logratios: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor
    ) -> dict[str, float]:
        p = self.params
        rewards = p.beta * logratios.detach()  # β log π/π_ref, as reported by DPO
        n_d = int(desirable.sum())
        n_u = int(desirable.numel()) - n_d
        metrics = {"kto/loss": float(loss), "kto/z0": float(z0[0]) if z0.numel() else 0.0}
        if n_d:
            metrics["kto/rewards/chosen"] = float(rewards[desirable].mean())
        if n_u:
            metrics["kto/rewards/rejected"] = float(rewards[~desirable].mean())
        ratio = weight_ratio(n_d, n_u, p.desirable_weight, p.undesirable_weight)
        if ratio is not None:
            metrics["kto/rewards/margin"] = (
                metrics["kto/rewards/chosen"] - metrics["kto/rewards/rejected"]
            )
            outside = not (RECOMMENDED_RATIO[0] <= ratio <= RECOMMENDED_RATIO[1] + 1e-9)
            metrics["kto/weight_ratio"] = ratio
            metrics["kto/weight_ratio_outside_range"] = float(outside)
            if outside and not self._warned_ratio:
                self._warned_ratio = True
                warnings.warn(
                    f"KTO: desirable_weight·n_desirable / (undesirable_weight·n_undesirable) = "
                    f"{p.desirable_weight}·{n_d} / ({p.undesirable_weight}·{n_u}) = {ratio:.3g}, "
                    "outside the range [1, 4/3] that Ethayarajh et al. 2024 recommend; "
                    "adjust desirable_weight / undesirable_weight to the data's balance",
                    stacklevel=2,
                )
        return metrics
