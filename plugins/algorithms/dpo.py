"""DPO: direct preference optimisation, and the pairwise variants of TRL 1.16's DPOTrainer.

Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
Model". With the implicit reward r(x, y) = β log π(y|x)/π_ref(y|x), the DPO loss (eq. 7) is

    L_DPO = -log σ(β h),    h = [log π(y_w) - log π_ref(y_w)] - [log π(y_l) - log π_ref(y_l)]

where y_w is the chosen and y_l the rejected response, and log π(y) is a *sequence* log-prob
(the sum of the per-token log-probs over real response tokens). Below, ρ_w = log π(y_w)/π_ref(y_w)
and ρ_l = log π(y_l)/π_ref(y_l) are the two log-ratios (h = ρ_w - ρ_l), ε is
``label_smoothing``.

Variants (``loss_type``): every loss of the family is one function below, registered in
:data:`LOSS_TYPES` by :func:`register_loss` with what it reads (``label_smoothing``, a param of
its own, the step's mean chosen length) and whether it sorts over the pairs; its docstring says
where it comes from and the line that computes it carries the paper's equation. Adding a
variant is adding one such function: the params accept its name, and validate what it reads,
from the registry. ``sigmoid`` is DPO (cDPO with ``label_smoothing``); the others are the rest
of TRL 1.16's ``loss_type`` values.

Several losses at once (as TRL's list ``loss_type`` with ``loss_weights``): ``loss_type:
[sigmoid, sft]`` and ``loss_weights: [1.0, 0.5]`` train on Σ_j λ_j L_j; the weights default
to 1, and each term is also reported on its own (``dpo/loss/sigmoid``, ``dpo/loss/sft``).
Unlike TRL, ``sigmoid`` reads ``label_smoothing`` there too (it is cDPO with ε > 0).

``reference_free: true`` drops π_ref (its log-probs are taken as 0), so no reference model is
loaded and the rewards are β log π(y).

TRL 1.16's options that change the objective, under its names and defaults, each with any loss
that can take it (the params refuse the rest, naming the field):

- ``ld_alpha`` (LD-DPO: Liu et al. 2024, "Length Desensitization in Direct Preference
  Optimization"; default None, in [0, 1]): the sequence log-probs of both responses of a pair,
  under the policy and the reference, count the first ℓ_p = min(|y_w|, |y_l|) response tokens
  once and the longer one's tokens past ℓ_p α times (:func:`ld_token_weights`; ℓ_p counts
  response tokens only, not the prompt, as TRL's completion mask). Every loss takes it; ``sft``'s
  NLL still counts every token once, as TRL's.
- ``f_divergence_type`` and ``f_alpha_divergence_coef`` (f-DPO: Wang et al. 2023, "Beyond
  Reverse KL"; defaults ``reverse_kl``, which is DPO, and 0.5): each log-ratio ρ becomes
  ψ(ρ) = f'(e^ρ) (:func:`f_divergence_score`: ``forward_kl``, ``js_divergence``,
  ``alpha_divergence`` with α ≤ 1) in the losses built on the chosen-minus-rejected difference
  (the ``f_divergence`` trait: sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop,
  sft, as TRL); the rewards reported stay β ρ.
- ``use_weighting`` (WPO: Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference
  Optimization"; default False): each pair's loss terms are multiplied by w(y_w) w(y_l), each
  w(y) = exp(mean_t [log p(y_t) - log Σ_v p_v²]) under the current policy, without gradient
  (:func:`wpo_weights`). The engine computes log Σ_v p_v² in the policy's own pass over the
  vocabulary (``AlgorithmRequirements.log_sum_sq_probs``, ``outputs.log_sum_sq_probs``). Not
  with ``aot`` / ``aot_unpaired`` (they sort: a term belongs to no pair); ``sft``'s term is
  weighted pair by pair (TRL 1.16 fails on ``sft`` and ``hinge`` with it:
  tests/parity/test_trl_dpo_options.py). ``dpo/wpo_weight`` reports the mean pair weight.

All three work on offline and online pairs alike (online, the policy's log-probs and
log Σ_v p_v² are those of the distribution the samples were drawn from).

Data layout (how the engine hands pairs to this algorithm):

- ``batch.group_ids [B]``: the two responses of one pair share a group id. Each group holds
  exactly one chosen and one rejected sample; they need not be adjacent or in any order.
- ``batch.labels [B]``: 1.0 for the chosen response, 0.0 for the rejected one.
- ``batch.ref_logprobs [B, R]``: per-token reference log-probs (unless ``reference_free``).
- ``outputs.logprobs [B, R]``: per-token policy log-probs, with gradient.
- ``batch.response_mask [B, R]``: 1.0 on real response tokens; sequence log-probs sum over it.
- ``batch.weights [B]`` (optional): per-sample weights; a pair is weighted by the mean of its
  two samples' weights, and the loss is the mean over the optimizer step's pairs of
  weight × pair loss (``context.groups``: each group is one pair). The losses that sort over
  the pairs (``aot`` and ``aot_unpaired``) do not take them (see :func:`aot`).

The pairing helpers are public, in :mod:`alignzoo.preference`; the engine's preference data
modes (:mod:`alignzoo.engine.modes.preference`) build the pairs, offline or online.

``compute_advantages`` returns the batch unchanged (DPO needs no advantages), except with a loss
that reads the step's mean chosen length (``sft``), for which it adds
``batch.columns["dpo/chosen_length"]``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, model_validator
from pydantic_core import core_schema

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
    from pydantic.json_schema import GetJsonSchemaHandler, JsonSchemaValue

    from alignzoo import ops
    from alignzoo.batch import PolicyOutputs, RolloutBatch
else:
    torch = lazy_import("torch")
    ops = lazy_import("alignzoo.ops")

CHOSEN_LENGTH = "dpo/chosen_length"
"""``batch.columns`` key: the step batch's mean chosen length, for ``sft``."""


# --------------------------------------------------------------------------- the registry


@dataclass
class Pairs:
    """N preference pairs as a loss of :data:`LOSS_TYPES` reads them: the sequence log-probs
    ``[N]`` of the chosen y_w and the rejected y_l under the policy and the reference (zeros
    without one; LD-DPO's weighted sums under ``ld_alpha``), their log-ratios ρ_w, ρ_l, their
    scores ψ(ρ_w), ψ(ρ_l) (ψ = the f-divergence's f', :func:`f_divergence_score`; ψ(ρ) = ρ
    for the reverse KL, DPO's) and margin h = ψ(ρ_w) - ψ(ρ_l), and the response lengths."""

    chosen_logps: torch.Tensor  # log π(y_w)
    rejected_logps: torch.Tensor  # log π(y_l)
    ref_chosen_logps: torch.Tensor  # log π_ref(y_w)
    ref_rejected_logps: torch.Tensor  # log π_ref(y_l)
    chosen_lengths: torch.Tensor  # |y_w|
    rejected_lengths: torch.Tensor  # |y_l|
    mean_chosen_length: torch.Tensor | None = None  # L̄_w of the step, if a loss reads it
    chosen_nll_logps: torch.Tensor | None = None  # log π(y_w) over every token at weight 1
    score: Callable[[torch.Tensor], torch.Tensor] | None = None  # ψ; None: the identity
    chosen_ratio: torch.Tensor = field(init=False)  # ρ_w
    rejected_ratio: torch.Tensor = field(init=False)  # ρ_l
    chosen_score: torch.Tensor = field(init=False)  # ψ(ρ_w)
    rejected_score: torch.Tensor = field(init=False)  # ψ(ρ_l)
    margin: torch.Tensor = field(init=False)  # h = ψ(ρ_w) - ψ(ρ_l)

    def __post_init__(self) -> None:
        self.chosen_ratio = self.chosen_logps - self.ref_chosen_logps  # ρ_w = log π(y_w)/π_ref(y_w)
        self.rejected_ratio = self.rejected_logps - self.ref_rejected_logps  # ρ_l
        score = self.score or (lambda ratio: ratio)
        self.chosen_score, self.rejected_score = (
            score(self.chosen_ratio),
            score(self.rejected_ratio),
        )
        self.margin = self.chosen_score - self.rejected_score  # h, the (log-ratio) margin
        if self.chosen_nll_logps is None:
            self.chosen_nll_logps = self.chosen_logps

    def rewards(self, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The implicit rewards r(x, y) = β log π(y|x)/π_ref(y|x) of the chosen and the rejected
        ``[N]`` (detached)."""
        return beta * self.chosen_ratio.detach(), beta * self.rejected_ratio.detach()


LossFunction = Callable[[Pairs, "DPOParams"], "torch.Tensor"]
"""A DPO-family loss: the per-pair losses ``[N]`` of the pairs under the params."""


@dataclass(frozen=True)
class LossType:
    """One loss of the DPO family, as :data:`LOSS_TYPES` holds it."""

    loss: LossFunction
    smoothed: bool = False
    """It reads ``label_smoothing`` ε (which is refused when no chosen loss reads it)."""
    sorts: bool = False
    """It sorts over the pairs of a micro-batch: it takes no per-pair weights and is not
    micro-batch invariant."""
    chosen_length: bool = False
    """It reads :attr:`Pairs.mean_chosen_length` (``compute_advantages`` puts it in the batch)."""
    params: tuple[str, ...] = ()
    """The params only this loss reads: setting one without the loss is refused."""
    f_divergence: bool = False
    """It reads the pairs' scores only through h = ψ(ρ_w) - ψ(ρ_l) (``sft`` reads none), so it
    takes any ``f_divergence_type``: f-DPO's reparameterisation leaves a β log Z(x) that
    cancels in that difference only. The other losses take the reverse KL only (as in TRL)."""
    check: Callable[[DPOParams], None] | None = None
    """Refuses (ValueError) params the loss cannot use."""


LOSS_TYPES: dict[str, LossType] = {}
"""Every DPO ``loss_type`` by name, in the order they are registered."""


def register_loss(name: str, **traits: Any) -> Callable[[LossFunction], LossFunction]:
    """Register the decorated function as DPO ``loss_type`` ``name``, with the
    :class:`LossType` traits given; a name registered twice is an error."""

    def register(loss: LossFunction) -> LossFunction:
        if name in LOSS_TYPES:
            raise ValueError(f"DPO loss_type {name!r} is registered twice")
        LOSS_TYPES[name] = LossType(loss, **traits)
        return loss

    return register


class _RegisteredLossType:
    """A ``loss_type`` name: one of :data:`LOSS_TYPES` when validated, and their list (as it
    is when the schema is written) in the JSON Schema."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.validate, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {**handler(schema), "enum": list(LOSS_TYPES)}

    @staticmethod
    def validate(name: str) -> str:
        if name not in LOSS_TYPES:
            raise ValueError(
                f"unknown DPO loss_type {name!r}; expected one of {', '.join(LOSS_TYPES)}"
            )
        return name


LossTypeName = Annotated[str, _RegisteredLossType()]

FDivergence = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
"""The f-divergences of ``f_divergence_type`` (TRL 1.16's names)."""


class DPOParams(BaseModel):
    """Parameters of DPO and its variants."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(
        0.1, gt=0.0, description="β: strength of the KL regularisation to the reference (τ in IPO)"
    )
    loss_type: LossTypeName | list[LossTypeName] = Field(
        "sigmoid",
        description=(
            "the loss, a name in LOSS_TYPES: sigmoid is DPO (cDPO with label_smoothing), the "
            "others are the variants of TRL's DPOTrainer, each with its paper in "
            "alignzoo.plugins.algorithms.dpo; a list combines several (see loss_weights)"
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
            "ε: assumed fraction of flipped labels, for the losses that read it (cDPO for "
            "sigmoid, rDPO for robust, the smoothed target of exo_pair and aot, ...)"
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
    ld_alpha: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description=(
            "α of LD-DPO (Liu 2024): each response's tokens past the shorter response of its "
            "pair count α times in its sequence log-prob, under the policy and the reference "
            "(1 is DPO, 0 drops them); None: every token counts once"
        ),
    )
    f_divergence_type: FDivergence = Field(
        "reverse_kl",
        description=(
            "the f-divergence to the reference of f-DPO (Wang 2023): reverse_kl is DPO's; "
            "forward_kl, js_divergence and alpha_divergence replace each log-ratio ρ by f'(e^ρ) "
            "in the losses built on the chosen-minus-rejected difference"
        ),
    )
    f_alpha_divergence_coef: float = Field(
        0.5,
        le=1.0,
        allow_inf_nan=False,
        description=(
            "α of f_divergence_type alpha_divergence, f'(u) = (u^(α-1) - 1)/(α-1): 0 is the "
            "forward KL, 1 the reverse KL (the paper's α is 1 minus this one); at most 1 (above "
            "it f'(0) is finite, and f-DPO's closed form needs f'(u) -> -inf as u -> 0)"
        ),
    )
    use_weighting: bool = Field(
        False,
        description=(
            "WPO (Zhou 2024): weight each pair's loss by its chosen and rejected responses' "
            "per-token probabilities under the policy, exp(mean_t [log p(y_t) - log Σ_v p_v²]), "
            "without gradient"
        ),
    )

    @property
    def loss_types(self) -> list[str]:
        """``loss_type`` as a list (one entry for a single loss)."""
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    @property
    def weights_of_losses(self) -> list[float]:
        """λ_j of each entry of :attr:`loss_types`."""
        return self.loss_weights or [1.0] * len(self.loss_types)

    @property
    def loss_entries(self) -> list[LossType]:
        """The :class:`LossType` of each entry of :attr:`loss_types`."""
        return [LOSS_TYPES[name] for name in self.loss_types]

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
        if self.label_smoothing > 0 and not any(entry.smoothed for entry in self.loss_entries):
            readers = [name for name, entry in LOSS_TYPES.items() if entry.smoothed]
            raise ValueError(
                f"label_smoothing applies to loss_type {', '.join(readers)}, not "
                f"{self.loss_type!r}; set label_smoothing: 0"
            )
        own_params = {param for entry in LOSS_TYPES.values() for param in entry.params}
        for param in sorted(own_params & self.model_fields_set):
            if not any(param in entry.params for entry in self.loss_entries):
                readers = [name for name, entry in LOSS_TYPES.items() if param in entry.params]
                raise ValueError(
                    f"{param} applies to loss_type {', '.join(readers)} only, not "
                    f"{self.loss_type!r}; remove it"
                )
        for entry in self.loss_entries:
            if entry.check is not None:
                entry.check(self)
        if self.f_divergence_type != "reverse_kl":
            others = [name for name in types if not LOSS_TYPES[name].f_divergence]
            if others:
                takers = [name for name, entry in LOSS_TYPES.items() if entry.f_divergence]
                raise ValueError(
                    f"f_divergence_type {self.f_divergence_type!r} applies to loss_type "
                    f"{', '.join(takers)} only, not {', '.join(others)} (f-DPO's log Z(x) term "
                    "cancels only in the chosen-minus-rejected difference); use "
                    "f_divergence_type: reverse_kl with it"
                )
        if (
            "f_alpha_divergence_coef" in self.model_fields_set
            and self.f_divergence_type != "alpha_divergence"
        ):
            raise ValueError(
                "f_alpha_divergence_coef applies to f_divergence_type alpha_divergence only, not "
                f"{self.f_divergence_type!r}; remove it"
            )
        sorting = [name for name in types if LOSS_TYPES[name].sorts]
        if self.use_weighting and sorting:
            raise ValueError(
                f"use_weighting (WPO's per-pair weights) cannot weight loss_type "
                f"{', '.join(sorting)}: it sorts over the pairs, so a loss term belongs to no one "
                "pair; set use_weighting: false"
            )
        return self


# --------------------------------------------------------------------------- the options


def f_divergence_score(ratio: torch.Tensor, params: DPOParams) -> torch.Tensor:
    """ψ(ρ) = f'(u) at u = π(y)/π_ref(y) = e^ρ: the score f-DPO (Wang et al. 2023, "Beyond
    Reverse KL: Generalizing Direct Preference Optimization with Diverse Divergence
    Constraints") puts in place of the log-ratio ρ, the loss being
    -log σ(β ψ(ρ_w) - β ψ(ρ_l)) for ``sigmoid``. f' is taken up to an additive constant, which
    cancels in h (as TRL 1.16's, e.g. 1 - 1/u for the forward KL where the paper's table has
    -1/u). Where e^((α-1)ρ) would overflow it is capped at e^80 (e^11 in fp16) and passes no
    gradient there: TRL caps the alpha divergence so; its forward KL is not capped and
    overflows in fp32 below ρ ≈ -88.7, where alignzoo's stays finite."""
    kind = params.f_divergence_type
    if kind == "reverse_kl":
        return ratio  # f(u) = u log u: f'(u) = log u (+ 1)
    if kind == "js_divergence":
        return math.log(2.0) + logsig(ratio)  # f'(u) = log(2u / (1 + u)) = log 2 + log σ(ρ)
    alpha = 0.0 if kind == "forward_kl" else params.f_alpha_divergence_coef
    if abs(alpha - 1.0) < 1e-6:  # the limit α -> 1 of (u^(α-1) - 1)/(α-1) is log u
        return ratio
    cap = 11.0 if ratio.dtype == torch.float16 else 80.0
    t = ((alpha - 1.0) * ratio).clamp(max=cap)  # (α-1) ρ = log u^(α-1)
    # α-divergence: f'(u) = (u^(α-1) - 1)/(α-1) (the paper's (1 - u^(-α'))/α', α' = 1 - α);
    # α = 0 is the forward KL f(u) = -log u: f'(u) = 1 - 1/u (+ a constant)
    return torch.expm1(t) / (alpha - 1.0)


def ld_token_weights(
    mask: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, alpha: float
) -> torch.Tensor:
    """LD-DPO's per-token weights ``[B, R]`` (Liu et al. 2024, "Length Desensitization in
    Direct Preference Optimization"): 1 on the first ℓ_p real tokens of each
    response, ℓ_p = min(|y_w|, |y_l|) the public length of its pair, and α on the tokens past
    it (the longer response's verbose tail); 0 on padding. A row's real tokens are counted in
    order (``response_mask`` > 0), as TRL counts its completion mask."""
    real = mask > 0
    position = real.to(mask.dtype).cumsum(dim=-1)  # 1, 2, ... on the real tokens
    lengths = real.to(mask.dtype).sum(dim=-1)
    public = torch.minimum(lengths[chosen], lengths[rejected])  # ℓ_p of each pair
    public_of_row = torch.zeros_like(lengths)
    public_of_row[chosen], public_of_row[rejected] = public, public
    # log π̂(y) = Σ_{t ≤ ℓ_p} log π(y_t) + α Σ_{t > ℓ_p} log π(y_t)
    weights = torch.where(position <= public_of_row[:, None], 1.0, alpha).to(mask.dtype)
    return torch.where(real, weights, torch.zeros_like(weights))


def wpo_weights(
    logprobs: torch.Tensor, log_sum_sq_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """WPO's weight of each response ``[B]`` (Zhou et al. 2024, "WPO: Enhancing RLHF with
    Weighted Preference Optimization", with its aligned probabilities), without gradient:
    the geometric mean over its tokens of p(y_t) / Σ_v p_v², the probability of the token
    relative to the policy's expected one at that position; a pair is weighted by the product
    of its two responses' weights."""
    with torch.no_grad():
        aligned = logprobs.detach() - log_sum_sq_probs.detach()  # log p(y_t) - log Σ_v p_v²
        lengths = (mask > 0).to(aligned.dtype).sum(dim=-1).clamp(min=1.0)
        # w(x, y) = exp((1/|y|) Σ_t [log p(y_t) - log Σ_v p_v²])
        return torch.exp(ops.masked_sum(aligned, mask, dim=-1) / lengths)


# --------------------------------------------------------------------------- the losses


def logsig(z: torch.Tensor) -> torch.Tensor:
    """log σ(z), computed stably."""
    return torch.nn.functional.logsigmoid(z)


def smoothed(z: torch.Tensor, eps: float) -> torch.Tensor:
    """The cDPO loss of a logit z: -(1-ε) log σ(z) - ε log σ(-z) (-log σ(z) at ε = 0)."""
    return -(1.0 - eps) * logsig(z) - eps * logsig(-z)


@register_loss("sigmoid", smoothed=True, f_divergence=True)
def sigmoid(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """DPO (Rafailov 2023, eq. 7); with ``label_smoothing`` ε, conservative DPO (cDPO, Mitchell
    2023, "A note on DPO with noisy preferences"), the expected loss when a fraction ε of the
    labels is flipped."""
    # -log σ(βh); cDPO: -(1-ε) log σ(βh) - ε log σ(-βh)
    return smoothed(params.beta * pairs.margin, params.label_smoothing)


@register_loss("ipo", f_divergence=True)
def ipo(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """IPO: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", the empirical loss with β playing the role of the paper's τ. As in the paper,
    h is built from sequence (summed) log-probs, not length-normalised ones. It is minimised at
    margin h = 1/(2β)."""
    return (pairs.margin - 1.0 / (2.0 * params.beta)) ** 2  # (h - 1/(2τ))²


@register_loss("hinge", f_divergence=True)
def hinge(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """The SLiC calibration loss (Zhao et al. 2023, "SLiC-HF") on the reference-adjusted
    margin."""
    return torch.relu(1.0 - params.beta * pairs.margin)  # max(0, 1 - βh)


@register_loss("robust", smoothed=True, f_divergence=True)
def robust(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """rDPO: Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with Noisy
    Feedback", the unbiased loss under a known flip rate ε = ``label_smoothing``."""
    beta, eps, h = params.beta, params.label_smoothing, pairs.margin
    # [(1-ε) ℓ(h) + ε log σ(-βh)] / (1-2ε), ℓ(h) = -log σ(βh)
    return (-(1.0 - eps) * logsig(beta * h) + eps * logsig(-beta * h)) / (1.0 - 2.0 * eps)


def _exo_needs_label_smoothing(params: DPOParams) -> None:
    if params.label_smoothing == 0:
        raise ValueError(
            "loss_type 'exo_pair' needs label_smoothing > 0 (EXO's ε: its loss has log ε); "
            "the EXO paper uses 1e-3"
        )


@register_loss("exo_pair", smoothed=True, f_divergence=True, check=_exo_needs_label_smoothing)
def exo_pair(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """EXO: Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment"
    (eq. 16, K = 2): KL(q ‖ p_ε) between q = (σ(βh), σ(-βh)) over {y_w, y_l} and the smoothed
    label p_ε = (1-ε, ε). Needs ε > 0 (the paper uses 1e-3)."""
    z, eps = params.beta * pairs.margin, params.label_smoothing
    # KL(q ‖ p_ε) = Σ q log(q / p), q = (σ(βh), σ(-βh)), p_ε = (1-ε, ε)
    return torch.sigmoid(z) * (logsig(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
        logsig(-z) - math.log(eps)
    )


@register_loss("nca_pair")
def nca_pair(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """NCA: Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit
    Rewards"."""
    beta, chosen, rejected = params.beta, pairs.chosen_ratio, pairs.rejected_ratio
    # -log σ(βρ_w) - ½ log σ(-βρ_w) - ½ log σ(-βρ_l)
    return -logsig(beta * chosen) - 0.5 * logsig(-beta * chosen) - 0.5 * logsig(-beta * rejected)


@register_loss("bco_pair")
def bco_pair(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """BCO: Jung et al. 2024, "Binary Classifier Optimization for Large Language Model
    Alignment", on pairs. As in TRL 1.16's DPOTrainer there is no reward shift δ (the paper's
    running mean of the rewards), so it keeps no state."""
    # -log σ(βρ_w) - log σ(-βρ_l)  (reward shift δ = 0)
    return -logsig(params.beta * pairs.chosen_ratio) - logsig(-params.beta * pairs.rejected_ratio)


@register_loss("sppo_hard")
def sppo_hard(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """SPPO: Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment"
    (eq. 4.7 with the hard win probabilities P = 1 and 0, η = 1/β)."""
    beta = params.beta
    # (ρ_w - η/2)² + (ρ_l + η/2)²
    return (pairs.chosen_ratio - 0.5 / beta) ** 2 + (pairs.rejected_ratio + 0.5 / beta) ** 2


@register_loss("aot", smoothed=True, sorts=True)
def aot(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """AOT: Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal
    Transport", paired: the cDPO loss on sorted quantities, the k-th smallest policy margin
    log π(y_w) - log π(y_l) against the k-th smallest reference margin.

    The sort couples the pairs of one ``compute_loss`` call (a micro-batch, as TRL's per-device
    batch), so AOT is not micro-batch invariant, and it takes no ``batch.weights`` (after the
    sort a loss term belongs to no one pair; TRL refuses its WPO weighting for it too).
    """
    u = torch.sort(pairs.chosen_logps - pairs.rejected_logps).values  # u_(k)
    v = torch.sort(pairs.ref_chosen_logps - pairs.ref_rejected_logps).values  # v_(k)
    return smoothed(params.beta * (u - v), params.label_smoothing)  # cDPO of β(u_(k) - v_(k))


@register_loss("aot_unpaired", smoothed=True, sorts=True)
def aot_unpaired(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """AOT (Melnyk 2024), unpaired: the cDPO loss of the k-th smallest ρ_w against the k-th
    smallest ρ_l (sorting as :func:`aot`)."""
    chosen = torch.sort(pairs.chosen_ratio).values  # ρ_w,(k)
    rejected = torch.sort(pairs.rejected_ratio).values  # ρ_l,(k)
    return smoothed(params.beta * (chosen - rejected), params.label_smoothing)


@register_loss("apo_zero")
def apo_zero(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """APO-zero: D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive
    Revisions" (eq. 7): raise the chosen, lower the rejected."""
    beta = params.beta
    # 1 - σ(βρ_w) + σ(βρ_l)
    return (
        1.0 - torch.sigmoid(beta * pairs.chosen_ratio) + torch.sigmoid(beta * pairs.rejected_ratio)
    )


@register_loss("apo_down")
def apo_down(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """APO-down: D'Oosterlinck et al. 2024 (eq. 8): lower the chosen, the rejected more."""
    beta = params.beta
    # σ(βρ_w) + 1 - σ(β(ρ_w - ρ_l))
    return torch.sigmoid(beta * pairs.chosen_ratio) + 1.0 - torch.sigmoid(beta * pairs.margin)


@register_loss("discopop", params=("discopop_tau",), f_divergence=True)
def discopop(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """DiscoPOP (LRML): Lu et al. 2024, "Discovering Preference Optimization Algorithms with
    and for Large Language Models" (eq. 5), with z = βh, ω = σ(z/τ) and τ = ``discopop_tau``.

    Not monotone: at h = 0 its slope is (1 - log 2)/(4τ) - 3/4 > 0 for τ < 0.102 (TRL's default
    0.05), so the first step from an on-policy start lowers the margin.
    """
    z, tau = params.beta * pairs.margin, params.discopop_tau
    omega = torch.sigmoid(z / tau)
    # (1 - ω)(-log σ(z)) + ω e^{-z}; ω e^{-z} is computed as exp(log σ(z/τ) - z), which cannot
    # overflow to 0 · inf
    return (1.0 - omega) * -logsig(z) + torch.exp(logsig(z / tau) - z)


@register_loss("sft", chosen_length=True, f_divergence=True)
def sft(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """The negative log-likelihood of the chosen responses, a token mean over every chosen
    token of the step (TRL's "sft" term): each pair contributes -log π(y_w) / L̄_w, with L̄_w
    the mean chosen length of the step batch over every rank, so the micro-batching changes
    nothing (with several minibatches per batch it is the whole batch's mean, the same for
    each of them). It does not use the reference, and every token counts once (``ld_alpha``
    weights none of them here, as in TRL)."""
    if pairs.mean_chosen_length is None:
        raise UserError("DPO loss_type 'sft' needs the step's mean chosen length")
    assert pairs.chosen_nll_logps is not None  # set by Pairs
    # -Σ_k log π(y_w,k) / Σ_k |y_w,k| = mean_k [-log π(y_w,k) / L̄_w]
    return -pairs.chosen_nll_logps / pairs.mean_chosen_length


@register_loss("sigmoid_norm", f_divergence=True)
def sigmoid_norm(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """DPO on length-normalised log-ratios (scores ψ(ρ) under an f-divergence)."""
    # -log σ(β (ρ_w/|y_w| - ρ_l/|y_l|))
    per_token_margin = pairs.chosen_score / pairs.chosen_lengths.clamp(
        min=1.0
    ) - pairs.rejected_score / (pairs.rejected_lengths.clamp(min=1.0))
    return -logsig(params.beta * per_token_margin)


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
    def _sorting(self) -> list[str]:
        """The chosen loss types that sort over the micro-batch (aot, aot_unpaired)."""
        return [name for name in self.params.loss_types if LOSS_TYPES[name].sorts]

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        return AlgorithmRequirements(
            reference=not self.params.reference_free,
            data="preference",
            entropy=False,
            weights=not self._sorting,
            log_sum_sq_probs=self.params.use_weighting,
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """Unchanged, except with a loss that reads it (``sft``): the step batch's mean chosen
        length L̄_w (over every data-parallel rank) in ``batch.columns["dpo/chosen_length"]``,
        carried by every sample."""
        if not any(entry.chosen_length for entry in self.params.loss_entries):
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
        labels = require_labels(batch, "DPO")
        chosen, rejected = pair_indices(batch.group_ids, labels)
        mask = batch.response_mask
        logps = nll_logps = sequence_logps(outputs.logprobs, mask)
        token_weights = None  # LD-DPO's: 1 up to the pair's public length, α past it
        if p.ld_alpha is not None:
            token_weights = ld_token_weights(mask, chosen, rejected, p.ld_alpha)
            logps = sequence_logps(outputs.logprobs * token_weights, mask)
        if p.reference_free:
            ref_logps = torch.zeros_like(logps)
        elif batch.ref_logprobs is None:
            raise UserError(
                "DPO needs batch.ref_logprobs (a reference model); "
                "set reference_free: true to train without one"
            )
        else:
            ref = (
                batch.ref_logprobs if token_weights is None else batch.ref_logprobs * token_weights
            )
            ref_logps = sequence_logps(ref, mask).detach()
        lengths = mask.sum(-1)
        mean_chosen_length = None
        if any(entry.chosen_length for entry in p.loss_entries):
            if CHOSEN_LENGTH not in batch.columns:
                raise UserError(
                    f"DPO loss_type {p.loss_type!r}: batch.columns['dpo/chosen_length'] is "
                    "missing; compute_advantages sets it"
                )
            mean_chosen_length = batch.columns[CHOSEN_LENGTH][chosen].to(logps.dtype)
        score = None  # ψ = f' of f-DPO's divergence; DPO's (the reverse KL) is the identity
        if p.f_divergence_type != "reverse_kl":
            score = functools.partial(f_divergence_score, params=p)
        wpo = self._wpo_weights(outputs, mask, chosen, rejected)
        per_type: dict[str, torch.Tensor] = {}
        for name in p.loss_types:  # each loss reads pairs of its own: its own autograd graph
            pairs = Pairs(
                logps[chosen],
                logps[rejected],
                ref_logps[chosen],
                ref_logps[rejected],
                lengths[chosen],
                lengths[rejected],
                mean_chosen_length,
                chosen_nll_logps=nll_logps[chosen],
                score=score,
            )
            per_type[name] = LOSS_TYPES[name].loss(pairs, p)
            if wpo is not None:  # WPO: w(y_w) w(y_l) ℓ, each term as TRL weights it
                per_type[name] = wpo * per_type[name]
        # Σ_j λ_j L_j: each L_j is a mean over the pairs, so the pair losses combine pair-wise
        losses = torch.zeros_like(pairs.chosen_logps)
        for name, loss_weight in zip(p.loss_types, p.weights_of_losses, strict=True):
            losses = losses + loss_weight * per_type[name]
        weights = self._pair_weights(batch, chosen, rejected, context)
        loss = mean_over_pairs(losses, weights, context)  # E over the step's pairs
        chosen_rewards, rejected_rewards = pairs.rewards(p.beta)  # β ρ_w, β ρ_l
        metrics = preference_metrics(
            "dpo",
            mean_over_pairs(losses.detach(), weights, None),
            chosen_rewards,
            rejected_rewards,
            pairs.chosen_logps,
            pairs.rejected_logps,
        )
        if len(per_type) > 1:  # each term of the combination, e.g. dpo/loss/sft
            for name, term in per_type.items():
                metrics[f"dpo/loss/{name}"] = float(mean_over_pairs(term.detach(), weights, None))
        if wpo is not None:
            metrics["dpo/wpo_weight"] = float(wpo.mean())
        return LossOutput(loss=loss, metrics=metrics)

    def _wpo_weights(
        self,
        outputs: PolicyOutputs,
        mask: torch.Tensor,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
    ) -> torch.Tensor | None:
        """WPO's weight of each pair ``[N]``, w(y_w) w(y_l) (:func:`wpo_weights`), without
        gradient; None unless ``use_weighting``."""
        if not self.params.use_weighting:
            return None
        if outputs.log_sum_sq_probs is None:
            raise UserError(
                "DPO use_weighting needs outputs.log_sum_sq_probs (log Σ_v p_v² per response "
                "token), which the engine computes when AlgorithmRequirements.log_sum_sq_probs"
                " is set; DPO sets it with use_weighting"
            )
        per_response = wpo_weights(outputs.logprobs, outputs.log_sum_sq_probs, mask)
        return per_response[chosen] * per_response[rejected]

    def _pair_weights(
        self,
        batch: RolloutBatch,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        context: LossContext,
    ) -> torch.Tensor | None:
        """The pairs' weights; none for the losses that sort (aot, aot_unpaired), which say once
        that they ignore ``batch.weights`` and sort each micro-batch on its own."""
        sorting = self._sorting
        if not sorting:
            return pair_weights(batch.weights, chosen, rejected)
        names = " / ".join(sorting)
        if batch.weights is not None and not self._warned_weights:
            self._warned_weights = True
            warnings.warn(
                f"DPO loss_type {names} ignores batch.weights: after the sort a loss term "
                "belongs to no one pair (AlgorithmRequirements.weights is False)",
                stacklevel=2,
            )
        if context.micro_batches > 1 and not self._warned_micro_batches:
            self._warned_micro_batches = True
            warnings.warn(
                f"DPO loss_type {names} sorts the pairs of each of the step's "
                f"{context.micro_batches} micro-batches on its own (as TRL sorts each device "
                "batch); set training.micro_batch_size to the step's size to sort them all",
                stacklevel=2,
            )
        return None
