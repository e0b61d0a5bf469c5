"""Shared tensor operations for losses: masked reductions, loss aggregation, KL estimators.

Every algorithm aggregates its per-token loss through :func:`aggregate_loss`, so that a loss
aggregation mode means the same thing in PPO, GRPO, RLOO and the rest.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
KLEstimator = Literal["k1", "k2", "k3"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1; masked entries contribute exactly 0 (even inf or NaN)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over entries where ``mask`` is 1; 0 where nothing is unmasked."""
    count = mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over unmasked entries (Bessel-corrected when ``unbiased``)."""
    mean = masked_mean(values, mask)
    centered_sq = (values - mean) ** 2
    count = mask.to(values.dtype).sum()
    var = masked_sum(centered_sq, mask) / count.clamp(min=1.0)
    if unbiased:
        var = var * count / (count - 1).clamp(min=1.0)
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / std over unmasked entries; masked entries are set to 0."""
    mean = masked_mean(values, mask)
    std = torch.sqrt(masked_var(values, mask) + eps)
    whitened = (values - mean) / std if shift_mean else values / std
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation = "token-mean",
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, R]`` to a scalar.

    - ``token-mean``: mean over every unmasked token of the batch (DAPO).
    - ``seq-mean-token-mean``: mean over tokens of each sequence, then over sequences (GRPO paper).
    - ``seq-mean-token-sum``: sum over tokens of each sequence, then mean over sequences.
    - ``seq-mean-token-sum-norm``: sum over tokens divided by a constant (``norm_constant``,
      default R, the padded length), then mean over sequences (Dr. GRPO, Liu et al. 2025).
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
        return per_seq.mean()
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).mean()
    if mode == "seq-mean-token-sum-norm":
        constant = float(norm_constant if norm_constant is not None else loss_mat.shape[-1])
        return (masked_sum(loss_mat, mask, dim=-1) / constant).mean()
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL", 2020).

    With log r = log pi_ref(x) - log pi(x):
    - k1 = -log r                      (unbiased, can be negative)
    - k2 = (log r)^2 / 2               (biased, non-negative, low variance)
    - k3 = (r - 1) - log r             (unbiased, non-negative)
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)  # keeps exp finite for far-apart policies
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[tokens]: ``[B, R, V]`` and ``[B, R]`` -> ``[B, R]`` (computed in fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits): ``[B, R, V]`` -> ``[B, R]`` (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
