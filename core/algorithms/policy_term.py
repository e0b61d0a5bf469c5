"""TRL 1.16's options on the policy-gradient term, shared by GRPO, RLOO, REINFORCE++ and PPO.

Each option changes which tokens (or how much of each) the clipped surrogate trains on, and
leaves the KL term and the loss's normalisers as they are (as TRL's GRPOTrainer applies them).
An algorithm adds :class:`PolicyTermParams` to its params and gets them under TRL's names:

- ``delta``: two-sided clipping (INTELLECT-2): the unclipped term's ratio capped at delta,
  ``-min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)``
  (:func:`alignzoo.ops.clipped_surrogate`).
- ``top_entropy_quantile`` (rho): the policy term on the tokens whose entropy is in the top rho
  quantile only (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
  Effective RL for LLM Reasoning"; :func:`high_entropy_mask`).
- ``off_policy_mask_threshold``: DeepSeek-V3.2's off-policy sequence mask (eq. 9;
  :func:`off_policy_keep`).
- ``mask_truncated_completions``: the responses the length budget cut carry no loss and no
  token of the step's count; their rewards still count where the advantages are computed
  (:func:`mask_truncated`, called by ``compute_advantages`` after its statistics).

:func:`policy_mask` builds the ``[B, R]`` multiplier of the policy term from the first three
(with ``delta`` passed to the surrogate), the entropy quantile's own mask (for the entropy
bonus) and their metrics, one way for every algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import distributed
from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import PolicyOutputs, RolloutBatch

torch = lazy_import("torch")

OFF_POLICY_MASKED = "actor/off_policy_masked"
"""Metric: the share of the micro-batch's sequences whose policy term the off-policy mask drops."""
ENTROPY_KEPT = "actor/entropy_kept"
"""Metric: the share of the micro-batch's response tokens the entropy quantile keeps."""
TRUNCATED_MASKED = "actor/truncated_masked"
"""Metric: the share of the micro-batch's responses masked as cut by the length budget."""


class PolicyTermParams(BaseModel):
    """TRL's options on the policy-gradient term (the defaults change nothing)."""

    model_config = ConfigDict(extra="forbid")

    delta: float | None = Field(
        None,
        gt=1.0,
        description="cap the unclipped term's ratio at delta, -min(min(r, delta) A, clip(r) A) "
        "(two-sided clipping, INTELLECT-2; TRL's delta); the report recommends delta > 1 + "
        "the upper clip range. Null: PPO's one-sided clip",
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="train the policy term on the tokens whose entropy is at or above the "
        "(1 - rho) quantile of the micro-batch's response tokens on every rank (Beyond the "
        "80/20 Rule, which uses 0.2; TRL's top_entropy_quantile, taken as TRL does over each "
        "forward's tokens, so it depends on micro_batch_size). 0 keeps the highest-entropy "
        "token only, 1 every token; the KL term and the normalisers are unchanged",
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        ge=0.0,
        description="mask the policy term of a sequence with negative advantage whose mean "
        "log(pi_sampling / pi) over its tokens exceeds this (DeepSeek-V3.2's off-policy "
        "sequence masking, eq. 9; TRL's off_policy_mask_threshold; pi_sampling: the rollout "
        "backend's log-probs when recorded, else the behaviour policy's; a sequence's "
        "advantage is its tokens' mean). Null: off",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="responses the length budget cut (batch.columns['truncated'], recorded by "
        "the engine for single-turn samples) carry no loss and count no tokens; their rewards "
        "still count in the advantages' statistics (TRL's mask_truncated_completions; the "
        "length_filter modifier's drop_truncated removes them from the batch instead)",
    )


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The tokens ``[B, R]`` bool whose entropy is at or above the ``1 - quantile`` quantile of
    the response tokens' entropies (``mask``), gathered over every data-parallel rank.

    ``quantile = 1`` keeps every response token; ``0`` keeps those at the maximum. The
    threshold is ``torch.quantile``'s linear interpolation, as TRL's ``get_high_entropy_mask``.
    """
    mask_b = mask.bool()
    values = entropy.detach()[mask_b].float()
    if distributed.active():  # the ranks' tokens may differ in number: gather them as objects
        parts = distributed.all_gather_object(values.cpu())
        values = torch.cat(parts).to(entropy.device)
    if values.numel() == 0:
        return torch.zeros_like(mask_b)
    threshold = torch.quantile(values, 1.0 - quantile)  # H >= Q_{1 - rho}(H)  (Beyond 80/20)
    return (entropy.detach().float() >= threshold) & mask_b


def off_policy_keep(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ``[B]`` bool (eq. 9): keep a sequence unless
    its advantage (its tokens' mean) is negative and its mean ``log pi_sampling - log pi`` over
    its tokens (the current policy detached) exceeds ``threshold``."""
    kl = torch.where(mask.bool(), sampling_logprobs - logprobs.detach(), 0.0).nan_to_num(0.0)
    mean_kl = kl.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    advantage = (advantages * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return (advantage >= 0) | (mean_kl <= threshold)  # M_i = 1 unless A_i < 0 and KL_i > delta


@dataclass
class PolicyMasks:
    """What TRL's options keep of the policy term: ``keep``, the ``[B, R]`` 0/1 multiplier of
    the policy term (None: every token); ``entropy``, the tokens the entropy quantile kept
    (``[B, R]`` bool, None when ``top_entropy_quantile`` is 1), which a modifier that acts on
    the policy's tokens (``entropy_bonus``) restricts itself to, as TRL's entropy bonus does;
    and the options' metrics."""

    keep: torch.Tensor | None
    entropy: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


def policy_mask(
    params: PolicyTermParams,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None,
    sampling_logprobs: torch.Tensor,
    name: str,
) -> PolicyMasks:
    """The multiplier of the policy term that ``top_entropy_quantile`` and
    ``off_policy_mask_threshold`` ask for, the entropy quantile's own mask, and their metrics.

    ``sampling_logprobs`` are the log-probs the responses were sampled with (the backend's
    when recorded, else the behaviour policy's); ``name`` prefixes the error when the entropy
    the quantile needs is missing.
    """
    keep: torch.Tensor | None = None
    high: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = {}
    if params.off_policy_mask_threshold is not None:
        sequences = off_policy_keep(
            logprobs, sampling_logprobs, advantages, mask, params.off_policy_mask_threshold
        )
        keep = sequences.unsqueeze(-1).expand_as(mask)  # M_i  (DeepSeek-V3.2, eq. 9)
        metrics[OFF_POLICY_MASKED] = 1.0 - sequences.to(logprobs.dtype).mean()
    if params.top_entropy_quantile < 1.0:
        if entropy is None:
            raise UserError(
                f"{name}: top_entropy_quantile < 1 needs the policy's per-token entropy "
                "(outputs.entropy); keep AlgorithmRequirements(entropy=True)"
            )
        high = high_entropy_mask(entropy, mask, params.top_entropy_quantile)
        metrics[ENTROPY_KEPT] = high.to(logprobs.dtype).sum() / mask.sum().clamp(min=1.0)
        keep = high if keep is None else keep & high
    multiplier = None if keep is None else keep.to(logprobs.dtype)
    return PolicyMasks(multiplier, high, metrics)


def batch_policy_mask(
    params: PolicyTermParams, batch: RolloutBatch, outputs: PolicyOutputs, name: str
) -> PolicyMasks:
    """:func:`policy_mask` of a micro-batch: its advantages, response mask and sampling
    log-probs (the backend's when recorded, else the behaviour policy's), the policy's
    log-probs and entropy in ``outputs``."""
    assert batch.advantages is not None and batch.old_logprobs is not None
    sampling = batch.rollout_logprobs
    return policy_mask(
        params,
        outputs.logprobs,
        batch.advantages,
        batch.response_mask,
        entropy=outputs.entropy,
        sampling_logprobs=sampling if sampling is not None else batch.old_logprobs,
        name=name,
    )


def mask_truncated(batch: RolloutBatch, name: str) -> None:
    """Zero the response mask of the responses the length budget cut (``columns['truncated']``):
    they carry no loss and no tokens of the step's count, as TRL's mask_truncated_completions.
    Called by ``compute_advantages`` after the statistics their rewards count in."""
    cut = batch.columns.get("truncated")
    if cut is None:
        raise UserError(
            f"{name}: mask_truncated_completions needs the engine's record of truncated "
            "responses (batch.columns['truncated'], kept for single-turn sampled batches); an "
            "arm with an environment limits its episodes with episodes.on_failure instead"
        )
    keep = (1.0 - cut.to(batch.response_mask.dtype)).unsqueeze(-1)
    batch.response_mask = batch.response_mask * keep.to(batch.response_mask.device)


def truncation_metrics(params: PolicyTermParams, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The share of the micro-batch's responses masked as truncated (when the option is on)."""
    cut = batch.columns.get("truncated")
    if not params.mask_truncated_completions or cut is None:
        return {}
    return {TRUNCATED_MASKED: cut.float().mean()}
