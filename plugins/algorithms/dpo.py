"""DPO: direct preference optimisation, and the pairwise variants of TRL 1.16's DPOTrainer.

Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
Model". With the implicit reward r(x, y) = β log π(y|x)/π_ref(y|x), the DPO loss (eq. 7) is

    L_DPO = -log σ(β h),    h = [log π(y_w) - log π_ref(y_w)] - [log π(y_l) - log π_ref(y_l)]

where y_w is the chosen and y_l the rejected response, and log π(y) is a *sequence* log-prob
(the sum of the per-token log-probs over real response tokens). Below, ρ_w = log π(y_w)/π_ref(y_w)
and ρ_l = log π(y_l)/π_ref(y_l) are the two log-ratios (h = ρ_w - ρ_l), ε is
``label_smoothing``. Variants (``loss_type``):

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
- ``exo_pair``: EXO, Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model
  Alignment" (eq. 16, K = 2): KL(q ‖ p_ε) between q = (σ(βh), σ(-βh)) over {y_w, y_l} and the
  smoothed label p_ε = (1-ε, ε). Needs ε > 0 (the paper uses 1e-3).
- ``nca_pair``: NCA, Chen et al. 2024, "Noise Contrastive Alignment of Language Models with
  Explicit Rewards": -log σ(βρ_w) - ½ log σ(-βρ_w) - ½ log σ(-βρ_l).
- ``bco_pair``: BCO, Jung et al. 2024, "Binary Classifier Optimization for Large Language Model
  Alignment", on pairs: -log σ(βρ_w) - log σ(-βρ_l). As in TRL 1.16's DPOTrainer there is no
  reward shift δ (the paper's running mean of the rewards), so it keeps no state.
- ``sppo_hard``: SPPO, Wu et al. 2024, "Self-Play Preference Optimization for Language Model
  Alignment" (eq. 4.7 with the hard win probabilities P = 1 and 0, η = 1/β):
  (ρ_w - 1/(2β))² + (ρ_l + 1/(2β))².
- ``aot`` / ``aot_unpaired``: AOT, Melnyk et al. 2024, "Distributional Preference Alignment of
  LLMs via Optimal Transport": the cDPO loss on sorted quantities, k-th smallest against k-th
  smallest: ``aot`` pairs the sorted policy margins log π(y_w) - log π(y_l) with the sorted
  reference margins, ``aot_unpaired`` the sorted ρ_w with the sorted ρ_l. The sort couples
  the pairs of one ``compute_loss`` call (a micro-batch, as TRL's per-device batch), so these
  two are not micro-batch invariant, and they do not take ``batch.weights`` (after the sort a
  loss term belongs to no one pair; TRL refuses its WPO weighting for them too).
- ``apo_zero`` / ``apo_down``: APO, D'Oosterlinck et al. 2024, "Anchored Preference
  Optimization and Contrastive Revisions" (eqs. 7 and 8): ``apo_zero`` 1 - σ(βρ_w) + σ(βρ_l)
  (raise the chosen, lower the rejected); ``apo_down`` σ(βρ_w) + 1 - σ(βh) (lower the chosen,
  the rejected more).
- ``discopop``: DiscoPOP (LRML), Lu et al. 2024, "Discovering Preference Optimization
  Algorithms with and for Large Language Models" (eq. 5): with z = βh and ω = σ(z/τ),
  (1 - ω)(-log σ(z)) + ω e^{-z}, τ = ``discopop_tau``. Not monotone: at h = 0 its slope is
  (1 - log 2)/(4τ) - 3/4 > 0 for τ < 0.102 (TRL's default 0.05), so the first step from an
  on-policy start lowers the margin.
- ``sft``: the negative log-likelihood of the chosen responses, a token mean over every chosen
  token of the step (TRL's "sft" term); each pair contributes -log π(y_w) / L̄_w, with L̄_w the
  mean chosen length of the step batch over every rank (``compute_advantages`` puts it in
  ``batch.columns["dpo/chosen_length"]``, so the micro-batching changes nothing; with several
  minibatches per batch it is the whole batch's mean, the same for each of them). It does not
  use the reference.
- ``sigmoid_norm``: DPO on length-normalised log-ratios: -log σ(β (ρ_w/|y_w| - ρ_l/|y_l|)).

Several losses at once (as TRL's list ``loss_type`` with ``loss_weights``): ``loss_type:
[sigmoid, sft]`` and ``loss_weights: [1.0, 0.5]`` train on Σ_j λ_j L_j; the weights default
to 1, and each term is also reported on its own (``dpo/loss/sigmoid``, ``dpo/loss/sft``).
Unlike TRL, ``sigmoid`` reads ``label_smoothing`` there too (it is cDPO with ε > 0).

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
  weight × pair loss (``context.groups``: each group is one pair). ``aot`` and
  ``aot_unpaired`` do not take them (see above).

The pairing helpers are public, in :mod:`alignzoo.preference`; the engine's preference data
modes (:mod:`alignzoo.engine.modes.preference`) build the pairs, offline or online.

``compute_advantages`` returns the batch unchanged (DPO needs no advantages), except with
``sft``, for which it adds ``batch.columns["dpo/chosen_length"]``.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Literal, get_args

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

DPOLossType = Literal[
    "sigmoid",
    "ipo",
    "hinge",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]
LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")
"""The loss types that read ``label_smoothing``."""
SORTED = ("aot", "aot_unpaired")
"""The loss types that sort over the micro-batch (no per-pair weights, no micro-batch invariance)."""
CHOSEN_LENGTH = "dpo/chosen_length"
"""``batch.columns`` key: the step batch's mean chosen length, for ``sft``."""


class DPOParams(BaseModel):
    """Parameters of DPO and its variants."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(
        0.1, gt=0.0, description="β: strength of the KL regularisation to the reference (τ in IPO)"
    )
    loss_type: DPOLossType | list[DPOLossType] = Field(
        "sigmoid",
        description=(
            "sigmoid (DPO / cDPO), ipo (Azar 2023), hinge (SLiC), robust (rDPO), exo_pair "
            "(EXO), nca_pair (NCA), bco_pair (BCO), sppo_hard (SPPO), aot / aot_unpaired (AOT), "
            "apo_zero / apo_down (APO), discopop (DiscoPOP), sft (NLL of the chosen), "
            "sigmoid_norm (length-normalised DPO); a list combines several (see loss_weights)"
        ),
    )
    loss_weights: list[float] | None = Field(
        None,
        description="λ_j: one weight per loss_type entry, the loss being Σ_j λ_j L_j (default 1 each)",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description=(
            "ε: assumed fraction of flipped labels (cDPO for sigmoid, rDPO for robust, the "
            "smoothed target of exo_pair, aot and aot_unpaired)"
        ),
    )
    discopop_tau: float = Field(
        0.05,
        gt=0.0,
        description="τ: temperature of DiscoPOP's logistic / exponential mix (loss_type discopop)",
    )
    reference_free: bool = Field(
        False, description="drop the reference policy: rewards are β log π(y) (no ref model)"
    )

    @property
    def loss_types(self) -> list[DPOLossType]:
        """``loss_type`` as a list (one entry for a single loss)."""
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    @property
    def weights_of_losses(self) -> list[float]:
        """λ_j of each entry of :attr:`loss_types`."""
        return self.loss_weights or [1.0] * len(self.loss_types)

    @model_validator(mode="after")
    def _losses_and_their_params_agree(self) -> DPOParams:
        types = self.loss_types
        if not types:
            raise ValueError("loss_type is an empty list; name at least one loss type")
        if len(set(types)) != len(types):
            raise ValueError(
                f"loss_type {types} names a loss twice; list each once and scale it with "
                "loss_weights"
            )
        if self.loss_weights is not None:
            if len(self.loss_weights) != len(types):
                raise ValueError(
                    f"loss_weights has {len(self.loss_weights)} entries for {len(types)} loss "
                    f"type(s) {types}; give one weight per loss_type entry"
                )
            if not all(math.isfinite(w) for w in self.loss_weights):
                raise ValueError(f"loss_weights must be finite numbers, not {self.loss_weights}")
        if self.label_smoothing > 0 and not set(types) & set(SMOOTHED):
            raise ValueError(
                f"label_smoothing applies to loss_type 'sigmoid' (cDPO), 'robust' (rDPO), "
                f"'exo_pair', 'aot' and 'aot_unpaired', not {self.loss_type!r}; "
                "set label_smoothing: 0"
            )
        if "exo_pair" in types and self.label_smoothing == 0:
            raise ValueError(
                "loss_type 'exo_pair' needs label_smoothing > 0 (EXO's ε: its loss has log ε); "
                "the EXO paper uses 1e-3"
            )
        if "discopop_tau" in self.model_fields_set and "discopop" not in types:
            raise ValueError(
                f"discopop_tau applies to loss_type 'discopop' only, not {self.loss_type!r}; "
                "remove it"
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
    *,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    mean_chosen_length: torch.Tensor | float | None = None,
    discopop_tau: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses ``[N]`` and the implicit rewards of chosen and rejected ``[N]``.

    All inputs are sequence log-probs ``[N]``; for reference-free DPO pass zeros as reference.
    ``sigmoid_norm`` needs the response lengths ``chosen_lengths`` / ``rejected_lengths``
    ``[N]``; ``sft`` the mean chosen length L̄_w of the optimizer step (its pair losses
    -log π(y_w)/L̄_w average to the token mean over the step's chosen tokens). ``aot`` and
    ``aot_unpaired`` sort over the N pairs: their i-th loss is the i-th quantile's.
    """
    chosen_ratio = chosen_logps - ref_chosen_logps  # ρ_w = log π(y_w)/π_ref(y_w)
    rejected_ratio = rejected_logps - ref_rejected_logps  # ρ_l = log π(y_l)/π_ref(y_l)
    margin = chosen_ratio - rejected_ratio  # h, the log-ratio margin
    eps = label_smoothing
    logsig = torch.nn.functional.logsigmoid

    def smoothed(z: torch.Tensor) -> torch.Tensor:  # cDPO: -(1-ε) log σ(z) - ε log σ(-z)
        return -(1.0 - eps) * logsig(z) - eps * logsig(-z)

    if loss_type == "sigmoid":
        # DPO eq. 7: -log σ(βh); cDPO (Mitchell 2023): -(1-ε) log σ(βh) - ε log σ(-βh)
        losses = smoothed(beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2  # IPO (Azar 2023): (h - 1/(2τ))²
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * margin)  # SLiC (Zhao 2023): max(0, 1 - βh)
    elif loss_type == "robust":
        # rDPO (Chowdhury 2024): [(1-ε) ℓ(h) + ε log σ(-βh)] / (1-2ε), ℓ(h) = -log σ(βh)
        losses = (-(1.0 - eps) * logsig(beta * margin) + eps * logsig(-beta * margin)) / (
            1.0 - 2.0 * eps
        )
    elif loss_type == "exo_pair":
        # EXO (Ji 2024) eq. 16, K = 2: KL(q ‖ p_ε) = Σ q log(q / p), q = (σ(βh), σ(-βh)),
        # p_ε = (1-ε, ε)
        z = beta * margin
        losses = torch.sigmoid(z) * (logsig(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
            logsig(-z) - math.log(eps)
        )
    elif loss_type == "nca_pair":
        # NCA (Chen 2024): -log σ(βρ_w) - ½ log σ(-βρ_w) - ½ log σ(-βρ_l)
        losses = (
            -logsig(beta * chosen_ratio)
            - 0.5 * logsig(-beta * chosen_ratio)
            - 0.5 * logsig(-beta * rejected_ratio)
        )
    elif loss_type == "bco_pair":
        # BCO (Jung 2024) on pairs, reward shift δ = 0: -log σ(βρ_w) - log σ(-βρ_l)
        losses = -logsig(beta * chosen_ratio) - logsig(-beta * rejected_ratio)
    elif loss_type == "sppo_hard":
        # SPPO (Wu 2024) eq. 4.7, P = 1 / 0, η = 1/β: (ρ_w - η/2)² + (ρ_l + η/2)²
        losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    elif loss_type == "aot":
        # AOT (Melnyk 2024), paired: cDPO loss of β(u_(k) - v_(k)), u = log π(y_w) - log π(y_l)
        # and v the reference's, each sorted over the pairs
        u = torch.sort(chosen_logps - rejected_logps).values
        v = torch.sort(ref_chosen_logps - ref_rejected_logps).values
        losses = smoothed(beta * (u - v))
    elif loss_type == "aot_unpaired":
        # AOT (Melnyk 2024), unpaired: cDPO loss of β(ρ_w,(k) - ρ_l,(k)), each sorted over pairs
        losses = smoothed(
            beta * (torch.sort(chosen_ratio).values - torch.sort(rejected_ratio).values)
        )
    elif loss_type == "apo_zero":
        # APO-zero (D'Oosterlinck 2024) eq. 7: 1 - σ(βρ_w) + σ(βρ_l)
        losses = 1.0 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    elif loss_type == "apo_down":
        # APO-down (D'Oosterlinck 2024) eq. 8: σ(βρ_w) + 1 - σ(β(ρ_w - ρ_l))
        losses = torch.sigmoid(beta * chosen_ratio) + 1.0 - torch.sigmoid(beta * margin)
    elif loss_type == "discopop":
        # DiscoPOP / LRML (Lu 2024) eq. 5: (1 - ω)(-log σ(z)) + ω e^{-z}, ω = σ(z/τ), z = βh;
        # ω e^{-z} is computed as exp(log σ(z/τ) - z), which cannot overflow to 0 · inf
        z = beta * margin
        omega = torch.sigmoid(z / discopop_tau)
        losses = (1.0 - omega) * -logsig(z) + torch.exp(logsig(z / discopop_tau) - z)
    elif loss_type == "sft":
        if mean_chosen_length is None:
            raise UserError("DPO loss_type 'sft' needs the step's mean chosen length")
        # NLL of the chosen: -Σ_k log π(y_w,k) / Σ_k |y_w,k| = mean_k [-log π(y_w,k) / L̄_w]
        losses = -chosen_logps / mean_chosen_length
    elif loss_type == "sigmoid_norm":
        if chosen_lengths is None or rejected_lengths is None:
            raise UserError("DPO loss_type 'sigmoid_norm' needs the response lengths")
        # DPO on per-token log-ratios: -log σ(β (ρ_w/|y_w| - ρ_l/|y_l|))
        per_token_margin = chosen_ratio / chosen_lengths.clamp(min=1.0) - rejected_ratio / (
            rejected_lengths.clamp(min=1.0)
        )
        losses = -logsig(beta * per_token_margin)
    else:
        raise UserError(
            f"unknown DPO loss_type {loss_type!r}; expected one of {', '.join(LOSS_TYPES)}"
        )
    chosen_rewards = beta * chosen_ratio.detach()  # r(x, y_w) = β log π/π_ref
    rejected_rewards = beta * rejected_ratio.detach()  # r(x, y_l)
    return losses, chosen_rewards, rejected_rewards


# --------------------------------------------------------------------------- plugin


class DPO(Algorithm):
    """Direct preference optimisation (Rafailov 2023) and the pairwise variants of TRL 1.16."""

    Params = DPOParams
    params: DPOParams
    watched_metrics = ("dpo/rewards/accuracy", "dpo/rewards/margin")

    def __init__(self, params: DPOParams | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        self._warned_weights = False
        self._warned_micro_batches = False

    @property
    def _sorts(self) -> bool:
        """Whether a loss term sorts over the micro-batch (aot, aot_unpaired)."""
        return bool(set(self.params.loss_types) & set(SORTED))

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        return AlgorithmRequirements(
            reference=not self.params.reference_free,
            data="preference",
            entropy=False,
            weights=not self._sorts,
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """Unchanged, except with ``sft``: the step batch's mean chosen length L̄_w (over every
        data-parallel rank) in ``batch.columns["dpo/chosen_length"]``, carried by every sample."""
        if "sft" not in self.params.loss_types:
            return batch
        chosen = (require_labels(batch, "DPO") == 1.0).to(batch.response_mask.dtype)
        lengths = batch.response_mask.sum(-1)
        mean_length = ops.global_masked_mean(lengths, chosen).clamp(min=1.0)  # L̄_w
        batch.columns[CHOSEN_LENGTH] = mean_length.expand(batch.size).clone()
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        p = self.params
        types = p.loss_types
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
        lengths = batch.response_mask.sum(-1)
        mean_chosen_length = None
        if "sft" in types:
            if CHOSEN_LENGTH not in batch.columns:
                raise UserError(
                    "DPO loss_type 'sft': batch.columns['dpo/chosen_length'] is missing; "
                    "compute_advantages sets it"
                )
            mean_chosen_length = batch.columns[CHOSEN_LENGTH][chosen].to(logps.dtype)
        per_type: dict[str, torch.Tensor] = {}
        for loss_type in types:
            per_type[loss_type], chosen_rewards, rejected_rewards = dpo_loss(
                logps[chosen],
                logps[rejected],
                ref_logps[chosen],
                ref_logps[rejected],
                beta=p.beta,
                loss_type=loss_type,
                label_smoothing=p.label_smoothing,
                chosen_lengths=lengths[chosen],
                rejected_lengths=lengths[rejected],
                mean_chosen_length=mean_chosen_length,
                discopop_tau=p.discopop_tau,
            )
        # Σ_j λ_j L_j: each L_j is a mean over the pairs, so the pair losses combine pair-wise
        losses = torch.zeros_like(logps[chosen])
        for loss_type, loss_weight in zip(types, p.weights_of_losses, strict=True):
            losses = losses + loss_weight * per_type[loss_type]
        weights = self._pair_weights(batch, chosen, rejected, context)
        loss = mean_over_pairs(losses, weights, context)  # E over the step's pairs
        metrics = preference_metrics(
            "dpo",
            mean_over_pairs(losses.detach(), weights, None),
            chosen_rewards,
            rejected_rewards,
            logps[chosen],
            logps[rejected],
        )
        if len(types) > 1:  # each term of the combination, e.g. dpo/loss/sft
            for loss_type, term in per_type.items():
                metrics[f"dpo/loss/{loss_type}"] = float(
                    mean_over_pairs(term.detach(), weights, None)
                )
        return LossOutput(loss=loss, metrics=metrics)

    def _pair_weights(
        self,
        batch: RolloutBatch,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        context: LossContext,
    ) -> torch.Tensor | None:
        """The pairs' weights; none for the sorting losses (aot, aot_unpaired), which say once
        that they ignore ``batch.weights`` and sort each micro-batch on its own."""
        if not self._sorts:
            return pair_weights(batch.weights, chosen, rejected)
        if batch.weights is not None and not self._warned_weights:
            self._warned_weights = True
            warnings.warn(
                "DPO loss_type aot / aot_unpaired ignores batch.weights: after AOT's sort a loss "
                "term belongs to no one pair (AlgorithmRequirements.weights is False)",
                stacklevel=2,
            )
        if context.micro_batches > 1 and not self._warned_micro_batches:
            self._warned_micro_batches = True
            warnings.warn(
                f"DPO loss_type aot / aot_unpaired sorts the pairs of each of the step's "
                f"{context.micro_batches} micro-batches on its own (as TRL sorts each device "
                "batch); set training.micro_batch_size to the step's size to sort them all",
                stacklevel=2,
            )
        return None
