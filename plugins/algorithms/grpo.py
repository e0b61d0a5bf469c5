"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", section 4.1).

No critic: each prompt is sampled G times and a sample's advantage is its reward relative to
its group, ``A_i = (r_i - mean(r_group)) / std(r_group)`` (outcome supervision,
section 4.1.2), given to every token of the response. The policy loss is PPO's clipped surrogate
plus a k3 estimate of KL(pi || pi_ref) weighted by beta (the GRPO objective, eq. 3).

Variants, all selected by params:

- ``scale_rewards``: ``"group"`` (the paper), ``"batch"`` (std over the whole batch) or
  ``"none"`` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": no std division).
- ``clip_eps_low`` / ``clip_eps_high``: asymmetric clipping (DAPO "clip-higher", Yu et al. 2025).
- ``importance_ratio``: ``"token"`` (the paper) or ``"sequence"`` (GSPO, Zheng et al. 2025: one
  length-normalised ratio per sequence, ``s_i = exp(mean_t log(pi / pi_old))``).
- ``loss_aggregation``: any mode of :func:`alignzoo.ops.aggregate_loss`; ``norm_constant`` is Dr.
  GRPO's constant for ``seq-mean-token-sum-norm``.
- ``beta = 0``: no KL term, and no reference model is loaded.
- TRL's options on the policy term, shared with RLOO, REINFORCE++ and PPO
  (:mod:`alignzoo.algorithms.policy_term`): ``delta`` (two-sided clipping, INTELLECT-2: the
  unclipped term's ratio capped at delta), ``top_entropy_quantile`` (the policy term on the
  highest-entropy tokens only, Beyond the 80/20 Rule), ``off_policy_mask_threshold``
  (DeepSeek-V3.2's off-policy sequence mask, eq. 9) and ``mask_truncated_completions``
  (responses cut by the length budget carry no loss; their rewards stay in their group's
  statistics). The KL term and the normalisers are unchanged by all four.
- ``multi_objective_aggregation`` and ``reward_weights`` (TRL's names and defaults): several
  rewards, from a labeler that reports them apart (``Score.info["rewards"]``: a ``combine``'s
  parts, a verifiers rubric; ``batch.reward_components``; a labeler that reports none is one
  reward, its value). ``"sum_then_normalize"`` (the default) trains on the labeler's score as
  above, or, with ``reward_weights``, on the weighted sum ``sum_k w_k r_k`` of the raw rewards,
  normalised as ``scale_rewards`` says. ``"normalize_then_sum"`` is GDPO (Liu et al. 2026,
  "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
  Optimization", arXiv:2601.05242): each reward is normalised in its group first,
  ``A_k = (r_k - mean_g(r_k)) / (std_g(r_k) + eps)`` (Bessel-corrected std), then
  ``A = sum_k w_k A_k`` is normalised over the whole batch, ``(A - mean(A)) / (std(A) + eps)``
  (``mean(A)`` is 0 by construction: not subtracted, as TRL's subtraction adds only noise);
  ``scale_rewards`` is not read (only its default is accepted: TRL ignores it there).
  ``reward_weights`` (default: all 1) has one weight per reward, in the labeler's order; a step
  whose labeler reports another number fails naming it, and ``alignzoo validate`` refuses it
  when the labeler's rewards are known (a combine's parts). The weights are the one list of
  weights: a ``combine`` read this way keeps its own ``weights`` at 1 (validate refuses others,
  which would weigh only the value, unread here), and ``labeling.normalize`` is refused in
  front of it (it rescales only the value). As in TRL, a reward that does not apply to a sample
  (None) is left out of that reward's statistics and of the sample's sum, and a sample none
  applies to gets advantage 0 and is left out of every statistic. With eps 1e-4 the advantages
  are TRL's to float32 rounding, but a group whose values of a reward are all equal contributes
  exactly 0 (TRL: its rounding noise over eps). Only GRPO reads the rewards apart: RLOO,
  REINFORCE++ and PPO train on the score (a combine's weighted sum). The rewards are read raw,
  so a modifier that rewrites ``batch.scores`` (reward_hacking's penalty) does not reach these
  advantages.
- ``surrogate``: the policy-gradient term of each token. ``"clip"`` (the default) is PPO's
  clipped surrogate above; the others are TRL's ``loss_type`` of the same name:

  - ``"cispo"``: CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585), REINFORCE with a clipped,
    detached importance weight, ``-sg(min(r, eps_max)) A log pi``: no token loses its gradient.
    ``cispo_ratio_max`` is eps_max (ScaleRL, arXiv:2510.13786, uses 5).
  - ``"sapo"``: SAPO (Qwen 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347), a smooth
    gate ``-(4 / tau) sigmoid(tau (r - 1)) A`` instead of the hard clip, whose gradient equals
    the unclipped surrogate's at r = 1 and fades off-policy; ``sapo_temperature_pos`` /
    ``sapo_temperature_neg`` are tau for A > 0 / A <= 0.
  - ``"luspo"``: LUSPO (arXiv:2602.05261, "Length-Unbiased Sequence Policy Optimization"): GSPO's
    clipped sequence surrogate with each sequence's loss (its KL term too, as in TRL) weighted
    by its length ``|y_i|``. Needs ``importance_ratio: sequence`` and the per-sequence mean
    aggregation (the default), so the loss is the mean over sequences of their token sums.
  - ``"vespo"``: VESPO (arXiv:2602.10693, "Variational Sequence-Level Soft Policy
    Optimization"): ``-sg(phi(w)) A log pi`` with the sequence ratio ``w = prod_t pi / pi_old``
    and the Gamma weight ``phi(w) = e^lam w^k e^(-lam w)`` (``phi(1) = 1``), ``vespo_k_*`` /
    ``vespo_lambda_*`` for A >= 0 / A < 0. Needs ``importance_ratio: token`` (w is its own
    sequence ratio). The rollout correction multiplies its loss like every surrogate's (TRL
    folds its token IS ratios into w instead).

  The params of one surrogate are refused with another when set off their defaults. TRL's
  ``loss_type`` also fixes the aggregation: ``sapo`` is ``seq-mean-token-mean`` (the default),
  ``cispo`` and ``vespo`` are ``token-mean`` (DAPO's), which ``loss_aggregation`` selects here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from alignzoo._lazy import lazy_import
from alignzoo.algorithms.policy_term import (
    PolicyTermParams,
    batch_policy_mask,
    mask_truncated,
    truncation_metrics,
)
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

ScaleRewards = Literal["group", "batch", "none"]
MultiObjective = Literal["sum_then_normalize", "normalize_then_sum"]
Surrogate = Literal["clip", "cispo", "sapo", "luspo", "vespo"]

SURROGATE_PARAMS: dict[str, tuple[str, ...]] = {
    "clip": ("clip_eps_low", "clip_eps_high", "delta"),
    "luspo": ("clip_eps_low", "clip_eps_high", "delta"),
    "cispo": ("cispo_ratio_max",),
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}
"""The params each surrogate reads (the others are refused off their defaults)."""


class GRPOParams(AggregationParams, PolicyTermParams):
    """Parameters of GRPO; defaults follow Shao et al. 2024 (TRL's options on the policy term,
    ``delta``, ``top_entropy_quantile``, ``off_policy_mask_threshold`` and
    ``mask_truncated_completions``, from :class:`~alignzoo.algorithms.policy_term.PolicyTermParams`)."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(
        0.04, ge=0.0, description="KL coefficient (k3 estimator); 0 disables KL and the reference"
    )
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="lower clip range: r >= 1 - eps")
    clip_eps_high: float = Field(
        0.2, gt=0.0, description="upper clip range: r <= 1 + eps (DAPO clip-higher uses 0.28)"
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="divide centred rewards by the group std, the batch std, or not (Dr. GRPO); "
        "TRL's true and false are group and none",
    )
    importance_ratio: Literal["token", "sequence"] = Field(
        "token",
        description="per-token ratio, or GSPO's length-normalised sequence ratio (whose ratios "
        "stay near 1: the GSPO paper clips at 1 - 3e-4 and 1 + 4e-4, not 0.2)",
    )
    loss_aggregation: LossAggregation = Field(
        "seq-mean-token-mean", description="how per-token losses are reduced (see ops)"
    )

    eps: float = Field(
        1e-6,
        gt=0.0,
        description="added to the std before dividing (with normalize_then_sum, to each "
        "reward's group std and to the batch std; TRL 1.16 adds 1e-4: set eps: 1e-4 for "
        "its advantages to the last digit; the default is kept so recorded results rerun the same)",
    )

    multi_objective_aggregation: MultiObjective = Field(
        "sum_then_normalize",
        description="how several rewards (a labeler's Score.info['rewards'], e.g. a combine's "
        "parts) make the advantage: sum_then_normalize weighs and sums them (the labeler's "
        "score, or sum_k w_k r_k with reward_weights), then normalises as scale_rewards says; "
        "normalize_then_sum (GDPO) normalises each in its group, sums them weighted and "
        "normalises the sum over the batch (TRL's multi_objective_aggregation)",
    )
    reward_weights: list[float] | None = Field(
        None,
        min_length=1,
        description="one weight per reward the labeler reports (Score.info['rewards'], in its "
        "order; a labeler that reports none is one reward, its value), applied to the raw "
        "rewards (a combine's own weights stay 1). Null: all 1, and with sum_then_normalize "
        "the labeler's score as it is (TRL's reward_weights)",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_booleans(cls, value: object) -> object:
        """TRL's booleans: true is "group", false is "none" (as GRPOConfig maps them)."""
        if value is True:
            return "group"
        if value is False:
            return "none"
        return value

    @model_validator(mode="after")
    def _multi_objective(self) -> GRPOParams:
        if self.reward_weights is not None and not all(map(math.isfinite, self.reward_weights)):
            raise ValueError(f"reward_weights must be finite numbers, not {self.reward_weights}")
        if (
            self.multi_objective_aggregation == "normalize_then_sum"
            and self.scale_rewards != "group"
        ):
            raise ValueError(
                f"scale_rewards {self.scale_rewards!r} is not read by multi_objective_aggregation "
                "'normalize_then_sum' (GDPO divides each reward by its group's std and the "
                "weighted sum by the batch's; TRL ignores scale_rewards there): remove it, or "
                "use sum_then_normalize"
            )
        return self

    @property
    def reads_reward_components(self) -> bool:
        """Whether the advantages weigh the labeler's rewards apart rather than its score."""
        return (
            self.multi_objective_aggregation == "normalize_then_sum"
            or self.reward_weights is not None
        )

    surrogate: Surrogate = Field(
        "clip",
        description="the per-token policy-gradient term: PPO's clipped surrogate (clip), CISPO's "
        "clipped detached IS weight times A log pi (cispo), SAPO's soft sigmoid gate (sapo), "
        "LUSPO's length-weighted GSPO (luspo), VESPO's Gamma-weighted sequence ratio (vespo)",
    )
    cispo_ratio_max: float = Field(
        5.0,
        gt=0.0,
        description="cispo: the IS weight is sg(min(r, cispo_ratio_max)) (ScaleRL's eps_max, "
        "recommended 5; TRL's epsilon_high under loss_type cispo)",
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0.0, description="sapo: gate temperature tau for tokens with A > 0"
    )
    sapo_temperature_neg: float = Field(
        1.05,
        gt=0.0,
        description="sapo: gate temperature tau for tokens with A <= 0 (larger: their "
        "off-policy gradient fades faster; the paper keeps it above sapo_temperature_pos)",
    )
    vespo_k_pos: float = Field(
        2.0,
        ge=0.0,
        description="vespo: power k of phi(w) = e^lam w^k e^(-lam w) for A >= 0 (down-weights "
        "sequences with w < 1)",
    )
    vespo_lambda_pos: float = Field(
        3.0,
        gt=0.0,
        description="vespo: decay lam of phi(w) for A >= 0 (down-weights sequences with w > 1)",
    )
    vespo_k_neg: float = Field(3.0, ge=0.0, description="vespo: power k of phi(w) for A < 0")
    vespo_lambda_neg: float = Field(2.0, gt=0.0, description="vespo: decay lam of phi(w) for A < 0")

    @model_validator(mode="after")
    def _surrogate_combinations(self) -> GRPOParams:
        name = self.surrogate
        if name == "luspo" and self.importance_ratio != "sequence":
            raise ValueError(
                "surrogate 'luspo' is GSPO's sequence surrogate weighted by length: set "
                "importance_ratio: sequence"
            )
        if name == "luspo" and self.loss_aggregation != "seq-mean-token-mean":
            raise ValueError(
                "surrogate 'luspo' weights each sequence's mean token loss by its length |y_i| "
                "(a token sum per sequence): keep loss_aggregation: seq-mean-token-mean, not "
                f"{self.loss_aggregation!r}"
            )
        if name == "vespo" and self.importance_ratio != "token":
            raise ValueError(
                "surrogate 'vespo' computes its own sequence ratio w = prod_t pi / pi_old: keep "
                "importance_ratio: token"
            )
        fields = dict.fromkeys(f for names in SURROGATE_PARAMS.values() for f in names)
        for field in fields:
            if field in SURROGATE_PARAMS[name]:
                continue
            if getattr(self, field) == type(self).model_fields[field].default:
                continue
            readers = [s for s, names in SURROGATE_PARAMS.items() if field in names]
            hint = (
                "; cispo caps its IS weight with cispo_ratio_max (TRL's epsilon_high)"
                if name == "cispo" and field.startswith("clip_eps")
                else ""
            )
            raise ValueError(
                f"{field} is read only by surrogate {' / '.join(readers)}, not by {name!r}: "
                f"remove it, or set surrogate: {readers[0]}{hint}"
            )
        return self


# --------------------------------------------------------------------------- pure functions


def group_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    scale: ScaleRewards = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Sequence advantages ``[B]``: reward minus its group's mean, scaled as asked.

    A group whose rewards are all equal gets advantage 0 exactly (not rounding noise divided by
    a tiny std), as does a group of one: it carries no learning signal.
    """
    scores = ops.upcast(scores)
    mean, group_std, _ = ops.group_mean_std(scores, group_ids)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    empty = scores.new_zeros(int(inverse.max()) + 1 if inverse.numel() else 0)
    group_max = empty.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    group_min = empty.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    flat = (group_max == group_min)[inverse]
    centred = torch.where(flat, 0.0, scores - mean)  # r_i - mean(r)  (outcome supervision)
    if scale == "group":
        # ... / std(r)  (outcome supervision, Shao et al.)
        return torch.where(flat, 0.0, centred / (group_std + eps).clamp(min=1e-12))
    if scale == "batch":
        batch_std = ops.global_std(scores)  # over the whole (global) batch
        return centred / (batch_std + eps).clamp(min=1e-12)
    return centred  # Dr. GRPO: no std normalisation (Liu et al. 2025)


def reward_matrix(batch: RolloutBatch, count: int | None = None) -> torch.Tensor:
    """The rewards ``[B, K]`` a multi-objective advantage weighs: ``batch.reward_components``
    (NaN where one does not apply), or the score as the one reward of a labeler that reports
    none. ``count``: how many weights there are (a step whose labeler reports another number
    of rewards fails, naming ``reward_weights``)."""
    if batch.reward_components is not None:
        rewards, names = batch.reward_components, batch.reward_names
    elif batch.scores is not None:
        rewards, names = batch.scores.unsqueeze(-1), ("its score",)
    else:
        raise UserError("grpo: batch.scores is missing; the labeler must score every sample")
    if count is not None and rewards.shape[-1] != count:
        raise UserError(
            f"grpo: reward_weights has {count} weights, and the labeler reports "
            f"{rewards.shape[-1]} reward(s) ({', '.join(names)}): give one weight per reward, in "
            "that order (a labeler reports several in Score.info['rewards'], as combine does "
            "for its parts; one that reports none is one reward, its value)"
        )
    return ops.upcast(rewards)


def weighted_reward_sum(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_k w_k r_k`` per sample ``[B]`` over the rewards that apply to it (NaN ones are
    left out, as TRL's nansum); NaN for a sample none applies to."""
    total = (rewards * weights.to(rewards)).nansum(dim=-1)  # sum_k w_k r_k
    return torch.where(torch.isnan(rewards).all(dim=-1), torch.nan, total)


def scorable_group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, scale: ScaleRewards, eps: float
) -> torch.Tensor:
    """:func:`group_advantages` over the samples whose score is not NaN, and 0 for the others
    (TRL's unscorable completions: no signal, and left out of every statistic)."""
    ok = ~torch.isnan(scores)
    if bool(ok.all()):
        return group_advantages(scores, group_ids, scale, eps)
    out = torch.zeros_like(scores)
    out[ok] = group_advantages(scores[ok], group_ids[ok], scale, eps)
    return out


def decoupled_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor, eps: float
) -> torch.Tensor:
    """GDPO's sequence advantages ``[B]`` (``normalize_then_sum``) from rewards ``[B, K]``.

    Each reward is normalised in its group over the samples it applies to (as
    :func:`group_advantages`: Bessel-corrected std, 0 for an all-equal group or a group of
    one), the weighted sum taken over those, then divided by its std over the batch (its
    batch mean is 0 by construction). A sample no reward applies to gets 0 and counts in no
    statistic.
    """
    normalised = torch.full_like(rewards, torch.nan)
    for k in range(rewards.shape[-1]):
        ok = ~torch.isnan(rewards[:, k])
        # A_k = (r_k - mean_group(r_k)) / (std_group(r_k) + eps)  (GDPO: per-reward, per group)
        normalised[ok, k] = group_advantages(rewards[ok, k], group_ids[ok], "group", eps)
    total = weighted_reward_sum(normalised, weights)  # A = sum_k w_k A_k
    ok = ~torch.isnan(total)
    kept = total[ok]
    out = torch.zeros_like(total)
    # A_hat = (A - mean_batch(A)) / (std_batch(A) + eps)  (GDPO's batch-wise normalisation).
    # mean_batch(A) is exactly 0 (each A_k sums to 0 over its group), so it is not subtracted:
    # computed, it is rounding noise that would give a sample with A = 0 (an all-equal group)
    # a sign that depends on the order of the batch.
    out[ok] = kept / (ops.global_std(kept) + eps)
    return out


def policy_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """log(pi / pi_old) per token ``[B, R]``; zero on padding (whatever the padding holds).

    At sequence level every token of a sequence carries ``mean_t log(pi / pi_old)``, the log of
    GSPO's importance ratio ``s_i = (pi(y_i|x) / pi_old(y_i|x)) ** (1 / |y_i|)`` (Zheng et al. 2025),
    so its gradient reaches every token of the sequence.
    """
    token = ops.token_log_ratio(logprobs, old_logprobs, mask)  # log r_t = log pi / pi_old
    if level == "token":
        return token
    sequence = ops.masked_mean(token, mask, dim=-1)  # log s_i, the GSPO sequence importance ratio
    return torch.where(mask.bool(), sequence.unsqueeze(-1).expand_as(token), 0.0)


def cispo_surrogate(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ratio_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's per-token loss ``[B, R]`` and where its cap on the IS weight binds.

    The importance weight is clipped and detached, so it scales the REINFORCE gradient of every
    token instead of removing some (MiniMax-M1; only the upper cap, as in ScaleRL and TRL, since
    MiniMax-M1 leaves the lower bound open). The bool mask marks tokens whose weight is capped.
    """
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    weight = ratio.clamp(max=ratio_max).detach()  # sg(r_hat), r_hat = min(r, eps_max)
    logp = torch.where(mask.bool(), logprobs, 0.0)
    loss = -weight * advantages * logp  # J_CISPO = E[sg(r_hat) A log pi(y_t)]  (MiniMax-M1)
    return loss, ratio > ratio_max


def sapo_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO's per-token loss ``[B, R]`` and its gate: the fraction of the unclipped surrogate's
    gradient each token keeps, ``4 sigmoid(x) (1 - sigmoid(x))`` at ``x = tau (r - 1)`` (1 at
    r = 1, fading smoothly off-policy)."""
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    soft = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * soft * advantages  # f(r) = sigmoid(tau (r - 1)) 4 / tau; J = E[f(r) A]
    gate = (4.0 * soft * (1.0 - soft)).detach()  # df/dr: the gradient is gate * r A grad log pi
    return loss, gate


def vespo_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
) -> torch.Tensor:
    """VESPO's Gamma weight ``phi(w)`` of each sequence's ratio ``w = prod_t pi / pi_old``, on
    every token ``[B, R]`` (detached: it only scales the gradient).

    ``log phi(w) = lam + k log w - lam w``: ``phi(1) = 1``, it peaks at ``w = k / lam`` and
    vanishes as ``w -> 0`` (like ``w^k``) and as ``w -> inf`` (like ``e^(-lam w)``), with
    (k, lam) chosen by the advantage's sign. As TRL does, each token's log-ratio is clamped to
    [-20, 20] and log w to [log 1e-8, 20].
    """
    mask_b = mask.bool()
    token = torch.where(mask_b, log_ratio.detach().clamp(-20.0, 20.0), 0.0)
    log_w = token.sum(dim=-1, keepdim=True).clamp(math.log(1e-8), 20.0)  # log w = sum_t log r_t
    nonneg = advantages >= 0
    k = torch.where(nonneg, params.vespo_k_pos, params.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, params.vespo_lambda_pos, params.vespo_lambda_neg).to(log_w.dtype)
    log_phi = lam + k * log_w - lam * log_w.exp()  # phi(w) = e^lam w^k e^(-lam w)  (VESPO)
    phi = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where(mask_b, phi, 0.0)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
    ref_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    context: LossContext | None = None,
    is_weights: torch.Tensor | None = None,
    policy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO objective (Shao et al. 2024, eq. 3), negated: the surrogate plus beta * KL.

    The surrogate is ``params.surrogate`` (PPO's clip by default; see the module docstring).
    All inputs are ``[B, R]`` (``weights`` ``[B]``); ``is_weights`` are the rollout
    correction's truncated importance weights on the surrogate (not on the KL term);
    ``policy_mask`` the 0/1 tokens the surrogate keeps (TRL's ``off_policy_mask_threshold`` and
    ``top_entropy_quantile``, :func:`~alignzoo.algorithms.policy_term.policy_mask`). The loss
    is aggregated over the optimizer step's counts in ``context`` (this batch's own without
    it). Returns the scalar loss and detached metric tensors (``grpo/kl_k3`` only when
    ``ref_logprobs`` is given; the clip fractions for clip, luspo and cispo, whose upper one is
    the fraction of capped IS weights; ``grpo/sapo_gate`` for sapo, the mean fraction of the
    unclipped gradient kept; ``grpo/vespo_phi`` for vespo, the mean Gamma weight of a sequence).
    """
    mask_b = mask.bool()
    advantages = torch.where(mask_b, advantages, 0.0)
    log_ratio = policy_log_ratio(logprobs, old_logprobs, mask, params.importance_ratio)
    metrics: dict[str, torch.Tensor] = {}
    clip_metrics: dict[str, torch.Tensor] = {}
    surrogate = params.surrogate
    if surrogate in ("clip", "luspo"):
        pg_mat, clipped_low, clipped_high = ops.clipped_surrogate(
            log_ratio, advantages, params.clip_eps_low, params.clip_eps_high, delta=params.delta
        )  # -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  (GRPO eq. 3; DAPO clip-higher)
        clip_metrics = ops.clip_fractions(clipped_low, clipped_high, mask)
    elif surrogate == "cispo":
        pg_mat, capped = cispo_surrogate(
            logprobs, log_ratio, advantages, mask, params.cispo_ratio_max
        )
        clip_metrics = ops.clip_fractions(torch.zeros_like(capped), capped, mask)
    elif surrogate == "sapo":
        pg_mat, gate = sapo_surrogate(
            log_ratio, advantages, params.sapo_temperature_pos, params.sapo_temperature_neg
        )
        metrics["grpo/sapo_gate"] = ops.masked_mean(gate, mask)
    else:  # vespo
        phi = vespo_weights(log_ratio, advantages, mask, params)
        logp = torch.where(mask_b, logprobs, 0.0)
        pg_mat = -phi * advantages * logp  # J_VESPO = E[sg(phi(w)) A log pi(y_t)]  (VESPO)
        metrics["grpo/vespo_phi"] = ops.masked_mean(phi, mask, dim=-1).mean()  # per sequence
    if policy_mask is not None:  # TRL's options: the off-policy mask, the entropy quantile
        pg_mat = pg_mat * policy_mask
    pg_mat = ops.weight_tokens(pg_mat, is_weights)  # TIS (training.rollout_correction)
    loss_mat = pg_mat
    if ref_logprobs is not None:
        kl_mat = ops.masked_kl_penalty(logprobs, ref_logprobs, mask, "k3")  # GRPO eq. 4
        metrics["grpo/kl_k3"] = ops.masked_mean(kl_mat.detach(), mask)
        if params.beta > 0:
            loss_mat = loss_mat + params.beta * kl_mat  # ... - beta * D_KL(pi || pi_ref)  (eq. 3)

    sample_weights = weights
    if surrogate == "luspo":  # LUSPO: each sequence's loss times its length |y_i|
        lengths = mask.to(loss_mat.dtype).sum(dim=-1)
        sample_weights = lengths if weights is None else weights.to(lengths.dtype) * lengths

    def aggregate(mat: torch.Tensor, ctx: LossContext | None) -> torch.Tensor:
        weighted = ops.weight_samples(mat, sample_weights)
        return ops.aggregate_loss(
            weighted, mask, params.loss_aggregation, params.norm_constant, ctx
        )

    loss = aggregate(loss_mat, context)  # this micro-batch's share of the step's loss
    metrics["actor/pg_loss"] = aggregate(pg_mat.detach(), None)  # its own mean
    metrics.update(clip_metrics)
    metrics["actor/approx_kl"] = ops.approx_kl(logprobs, old_logprobs, mask)
    return loss, metrics


# --------------------------------------------------------------------------- plugin


class GRPO(Algorithm):
    """GRPO (Shao et al. 2024): group-relative advantages, clipped surrogate, k3 KL; Dr. GRPO, DAPO, GSPO, GDPO, CISPO, SAPO, LUSPO and VESPO variants."""

    Params = GRPOParams
    params: GRPOParams
    watched_metrics = ("actor/clipfrac", "grpo/sapo_gate", "grpo/vespo_phi")

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        return AlgorithmRequirements(
            reference=self.params.beta > 0,
            critic=False,
            data="online",
            rollout_correction=True,
            weights=True,
            truncation=self.params.mask_truncated_completions,
            reward_components=self._reward_count(),
        )

    def _reward_count(self) -> int | None:
        """How many rewards the advantages weigh apart (0: any); None: the score only."""
        if not self.params.reads_reward_components:
            return None
        weights = self.params.reward_weights
        return len(weights) if weights is not None else 0

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        if batch.scores is None:
            raise UserError("grpo: batch.scores is missing; the labeler must score every sample")
        seq_adv = self._sequence_advantages(batch)
        if self.params.mask_truncated_completions:
            mask_truncated(batch, "grpo")  # after the group statistics: their rewards still count
        mask = batch.response_mask
        batch.advantages = seq_adv.unsqueeze(-1) * mask.to(seq_adv.dtype)
        return batch

    def _sequence_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """One advantage per sample ``[B]``: from the labeler's score, or, when the params
        weigh several rewards (``multi_objective_aggregation``, ``reward_weights``), from
        each of them."""
        p = self.params
        assert batch.scores is not None
        if not p.reads_reward_components:
            return group_advantages(batch.scores, batch.group_ids, p.scale_rewards, p.eps)
        count = len(p.reward_weights) if p.reward_weights is not None else None
        rewards = reward_matrix(batch, count)
        weights = torch.tensor(p.reward_weights or [1.0] * rewards.shape[-1])
        if p.multi_objective_aggregation == "normalize_then_sum":
            return decoupled_advantages(rewards, batch.group_ids, weights, p.eps)
        summed = weighted_reward_sum(rewards, weights)  # the score: sum_k w_k r_k
        return scorable_group_advantages(summed, batch.group_ids, p.scale_rewards, p.eps)

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        if batch.advantages is None or batch.old_logprobs is None:
            raise UserError("grpo: compute_loss needs batch.advantages and batch.old_logprobs")
        if self.params.beta > 0 and batch.ref_logprobs is None:
            raise UserError("grpo: beta > 0 needs batch.ref_logprobs (the reference model)")
        masks = batch_policy_mask(self.params, batch, outputs, "grpo")
        loss, metrics = grpo_loss(
            outputs.logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.response_mask,
            self.params,
            ref_logprobs=batch.ref_logprobs,
            weights=batch.weights,
            context=context,
            is_weights=batch.rollout_is_weights,
            policy_mask=masks.keep,
        )
        metrics.update(masks.metrics)
        metrics.update(truncation_metrics(self.params, batch))
        return LossOutput(
            loss, {k: float(v) for k, v in metrics.items()}, entropy_mask=masks.entropy
        )
