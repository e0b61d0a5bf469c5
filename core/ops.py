"""Shared tensor operations for losses: masked reductions, loss aggregation, KL estimators.

Every algorithm aggregates its per-token loss through :func:`aggregate_loss`, so that a loss
aggregation mode means the same thing in PPO, GRPO, RLOO and the rest.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from alignzoo import distributed
from alignzoo.types import LossAggregation, LossContext

KLEstimator = Literal["k1", "k2", "k3"]


def upcast(values: torch.Tensor) -> torch.Tensor:
    """``values`` in at least float32: bf16/fp16 and integer or bool tensors become float32,
    float32 and float64 keep their precision (the loss math runs in float64 when given it)."""
    return values if values.dtype in (torch.float32, torch.float64) else values.float()


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


def global_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`masked_mean` over the unmasked entries of every data-parallel rank."""
    if not distributed.active():
        return masked_mean(values, mask)
    local = torch.stack([masked_sum(values.detach(), mask), mask.to(values.dtype).sum()])
    total = distributed.all_sum(local)
    return total[0] / total[1].clamp(min=1.0)


def global_mean(values: torch.Tensor) -> torch.Tensor:
    """The mean of every element of ``values`` over all data-parallel ranks (a batch
    statistic: no gradient flows through it under several processes)."""
    if not distributed.active():
        return values.mean()
    return global_masked_mean(values, torch.ones_like(values))


def global_std(values: torch.Tensor) -> torch.Tensor:
    """The (Bessel-corrected) standard deviation of every element of ``values`` over all
    data-parallel ranks; 0 for a single element."""
    if not distributed.active():
        return values.std() if values.numel() > 1 else values.new_zeros(())
    return torch.sqrt(_global_mean_var(values, torch.ones_like(values))[1])


def _global_mean_var(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and Bessel-corrected variance over the unmasked entries of every rank (detached)."""
    values = values.detach()
    local = torch.stack([masked_sum(values, mask), mask.to(values.dtype).sum()])
    total, count = distributed.all_sum(local)
    mean = total / count.clamp(min=1.0)
    squares = distributed.all_sum(masked_sum((values - mean) ** 2, mask))
    return mean, squares / (count - 1).clamp(min=1.0)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / std over unmasked entries (of every data-parallel rank: the statistics of
    the global batch); masked entries are set to 0."""
    if distributed.active():
        return _global_whiten(values, mask, shift_mean, eps)
    mean = masked_mean(values, mask)
    std = torch.sqrt(masked_var(values, mask) + eps)
    whitened = (values - mean) / std if shift_mean else values / std
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def _global_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool, eps: float
) -> torch.Tensor:
    """:func:`masked_whiten` with the mean and (Bessel-corrected) variance of all ranks."""
    mean, var = _global_mean_var(values, mask)
    std = torch.sqrt(var + eps)
    whitened = (values.detach() - mean) / std if shift_mean else values.detach() / std
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation = "token-mean",
    norm_constant: float | None = None,
    context: LossContext | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, R]`` to a scalar.

    - ``token-mean``: sum over every unmasked token divided by the token count (DAPO).
    - ``seq-mean-token-mean``: mean over tokens of each sequence, then over sequences (GRPO paper).
    - ``seq-mean-token-sum``: sum over tokens of each sequence, then mean over sequences.
    - ``seq-mean-token-sum-norm``: sum over tokens divided by a constant (``norm_constant``,
      default R, the padded length), then mean over sequences (Dr. GRPO, Liu et al. 2025).

    With ``context`` (what ``compute_loss`` receives) the counts are those of the whole
    optimizer step, so the result is this micro-batch's share of the step's loss and the shares
    of all micro-batches add up to the loss of the whole step, whatever the micro-batching.
    Without it the counts are this batch's own (the batch is the whole step).
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if context is None:
            return masked_mean(loss_mat, mask)
        return masked_sum(loss_mat, mask) / max(context.tokens, 1.0)
    sequences = float(context.sequences) if context is not None else float(loss_mat.shape[0])
    sequences = max(sequences, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
        return per_seq.sum() / sequences
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).sum() / sequences
    if mode == "seq-mean-token-sum-norm":
        constant = float(norm_constant if norm_constant is not None else loss_mat.shape[-1])
        return (masked_sum(loss_mat, mask, dim=-1) / constant).sum() / sequences
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def mean_over_samples(per_sample: torch.Tensor, context: LossContext | None = None) -> torch.Tensor:
    """A per-sample loss ``[B]`` averaged over the optimizer step's samples (see
    :func:`aggregate_loss`): ``sum / context.sequences``, or the plain mean without a context."""
    count = context.sequences if context is not None else per_sample.shape[0]
    return per_sample.sum() / max(1, count)


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


def masked_kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = "k3",
) -> torch.Tensor:
    """:func:`kl_penalty` per response token ``[B, R]``, exactly 0 on padding.

    Padding is replaced before the estimator runs, so whatever it holds (even -inf) yields
    neither a NaN nor a gradient.
    """
    mask_b = mask.bool()
    return kl_penalty(
        torch.where(mask_b, logprobs, 0.0), torch.where(mask_b, ref_logprobs, 0.0), estimator
    )


def sampling_rows(temperature: float, top_k: int, top_p: float, rows: int) -> torch.Tensor:
    """:attr:`RolloutBatch.sampling <alignzoo.batch.RolloutBatch>` of ``rows`` samples drawn
    with one setting: ``[rows, 3]`` of (temperature, top_k, top_p)."""
    return torch.tensor([[float(temperature), float(top_k), float(top_p)]]).repeat(rows, 1)


def tempers(sampling: torch.Tensor | None) -> bool:
    """Whether some row was sampled at a temperature other than 1 (and above 0)."""
    if sampling is None or sampling.numel() == 0:
        return False
    temperature = sampling[:, 0]
    return bool(((temperature > 0) & (temperature != 1)).any())


def truncates(sampling: torch.Tensor | None) -> bool:
    """Whether some row was sampled (temperature above 0) with a top-k or top-p that cuts."""
    if sampling is None or sampling.numel() == 0:
        return False
    temperature, top_k, top_p = sampling.unbind(-1)
    return bool(((temperature > 0) & ((top_k > 0) | (top_p < 1))).any())


def warps(sampling: torch.Tensor | None, truncate: bool = True) -> bool:
    """Whether :func:`warp_logits` changes anything for these rows."""
    return tempers(sampling) or (truncate and truncates(sampling))


def warp_logits(
    logits: torch.Tensor, sampling: torch.Tensor | None, truncate: bool = True
) -> torch.Tensor:
    """The logits ``[B, R, V]`` of the distribution each row was sampled from, per row's
    ``sampling`` (temperature, top_k, top_p) ``[B, 3]``: a log-softmax of the result gives the
    sampled tokens' log-probs under that distribution.

    In the order the samplers apply them (transformers' warpers, vLLM):

        z' = z / T                                          (temperature T > 0)
        z'_v = -inf  where z'_v < the k-th largest of z'    (top_k k > 0; ties kept)
        z'_v = -inf  outside the nucleus: the fewest largest tokens whose probability under
                     softmax(z') sums to at least p, the most probable always kept (top_p < 1)

    so log softmax(z') renormalises over the tokens kept. ``truncate=False`` applies the
    temperature only (the reference's distribution: KL between the tempered policies). A row
    with temperature 0 (greedy) or 1, top_k 0 and top_p 1 is left as it is, and the logits
    are returned unchanged (the same tensor) when no row warps.
    """
    if not warps(sampling, truncate):
        return logits
    assert sampling is not None
    sampling = sampling.to(device=logits.device, dtype=torch.float32)
    temperature, top_k, top_p = sampling.unbind(-1)
    sampled = temperature > 0  # greedy rows keep the raw logits
    scale = torch.where(sampled, temperature, torch.ones_like(temperature))
    out = upcast(logits) / scale.view(-1, *([1] * (logits.dim() - 1)))
    if not truncate:
        return out
    vocab = out.shape[-1]
    shape = (-1, *([1] * (logits.dim() - 1)))
    k = torch.where(sampled & (top_k > 0), top_k.long().clamp(max=vocab), vocab).view(shape)
    p = torch.where(sampled & (top_p < 1), top_p, torch.ones_like(top_p)).view(shape)
    with torch.no_grad():  # which tokens are cut (the kept ones keep their gradients)
        ordered, order = out.sort(dim=-1, descending=True)
        drop = torch.zeros_like(out, dtype=torch.bool)
        if bool((k < vocab).any()):
            kth = ordered.gather(-1, (k - 1).expand(*out.shape[:-1], 1))
            drop |= out < kth
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        if bool((p < 1).any()):
            # Probability of everything more probable than each token: a token is kept while
            # that mass is still short of p (so the most probable one always is).
            probs = ordered.softmax(dim=-1)
            outside = (probs.cumsum(dim=-1) - probs >= p) & (p < 1)
            drop |= torch.zeros_like(drop).scatter_(-1, order, outside)
    return out.masked_fill(drop, float("-inf"))


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[tokens]: ``[B, R, V]`` and ``[B, R]`` -> ``[B, R]`` (computed in fp32)."""
    return token_outputs(logits, tokens)[0]


def logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` from one log-softmax;
    ``entropy_grad=False`` computes the entropy without gradients (for metrics only)."""
    chosen, entropy, _ = token_outputs(logits, tokens, "grad" if entropy_grad else "detached")
    assert entropy is not None
    return chosen, entropy


EntropyMode = Literal["none", "grad", "detached"]
"""Whether a pass returns the entropy: not at all, with gradients, or without (for metrics)."""

SQ_PROBS_AT_ONCE = 1 << 22
"""The most floats :func:`log_sum_sq` adds to the log-probs it reads (one chunk of
positions at a time): 16 MB in fp32, where a second tensor of the logits' size would be GBs."""


def log_sum_sq(logp: torch.Tensor) -> torch.Tensor:
    """``log Σ_v p_v²`` per position of log-probs ``[..., V]`` -> ``[...]``, without gradients
    (WPO's weights, :mod:`alignzoo.plugins.algorithms.dpo`), computed a chunk of positions at a
    time so that no second tensor of ``logp``'s size exists. A token outside the support
    (log-prob ``-inf``) adds nothing."""
    flat = logp.detach().reshape(-1, logp.shape[-1])
    out = flat.new_empty(flat.shape[0])
    rows = max(1, SQ_PROBS_AT_ONCE // max(1, flat.shape[1]))
    with torch.no_grad():
        for start in range(0, flat.shape[0], rows):
            out[start : start + rows] = torch.logsumexp(2.0 * flat[start : start + rows], dim=-1)
    return out.view(logp.shape[:-1])


def token_outputs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    entropy: EntropyMode = "none",
    log_sum_sq_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """From one log-softmax of ``logits [..., V]`` (in at least fp32): the log-probs of
    ``tokens [...]`` (:func:`logprobs_from_logits`), their entropy when asked (with or without
    gradients, :func:`logprobs_and_entropy`'s) and, with ``log_sum_sq_probs``, ``log Σ_v p_v²``
    without gradients (:func:`log_sum_sq`); None for what is not asked."""
    logp = torch.log_softmax(upcast(logits), dim=-1)
    chosen = torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy == "grad":
        ent = _entropy_of_logp(logp)
    elif entropy == "detached":
        with torch.no_grad():
            ent = _entropy_of_logp(logp.detach())
    return chosen, ent, log_sum_sq(logp) if log_sum_sq_probs else None


class _HeadLogprobs(torch.autograd.Function):
    """Log-probs (and entropy, and log Σ_v p_v²) of ``tokens`` under ``softmax(hidden W^T)``,
    ``rows`` rows at a time, never holding the ``[N, V]`` logits of all rows at once; see
    :func:`head_token_outputs`.

    Forward, per chunk of rows (z = the chunk's logits):

        z = h W^T                       log Z = logsumexp(z)
        log p(y) = z_y - log Z          H = log Z - sum_v p_v z_v
        log sum_v p_v^2 = logsumexp(2z) - 2 log Z       (no gradient)

    Saved for the backward pass: h, W, the tokens, log Z (and H): no ``[N, V]`` tensor. The
    backward pass recomputes each chunk's z (one more head matmul) and applies

        d log p(y) / dz = onehot(y) - p          dH / dz = -p (log p + H)
        dL/dh = (dL/dz) W                        dL/dW = sum_chunks (dL/dz)^T h
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        tokens: torch.Tensor,
        rows: int,
        with_entropy: bool,
        with_sq_probs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        count = hidden.shape[0]
        chosen = hidden.new_empty(count)
        log_z = hidden.new_empty(count)
        entropy = hidden.new_empty(count) if with_entropy else None
        sq_probs = hidden.new_empty(count) if with_sq_probs else None
        for start in range(0, count, rows):
            end = min(count, start + rows)
            logits = hidden[start:end] @ weight.t()
            log_z[start:end] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, tokens[start:end, None]).squeeze(1)
            chosen[start:end] = picked - log_z[start:end]
            if entropy is not None:
                mean_logit = (torch.softmax(logits, dim=-1) * logits).sum(-1)
                entropy[start:end] = log_z[start:end] - mean_logit
            if sq_probs is not None:  # log sum_v p_v^2 = logsumexp(2z) - 2 log Z
                sq_probs[start:end] = torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * log_z[start:end]
        ctx.rows = rows
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, tokens, log_z, entropy)
        if sq_probs is not None:
            ctx.mark_non_differentiable(sq_probs)
        return chosen, entropy, sq_probs

    @staticmethod
    def backward(
        ctx: Any,
        grad_chosen: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        _grad_sq_probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, tokens, log_z, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.rows):
            end = min(hidden.shape[0], start + ctx.rows)
            h = hidden[start:end]
            logp = h @ weight.t() - log_z[start:end, None]
            p = logp.exp()
            grad_logits = torch.zeros_like(p)
            if grad_chosen is not None:
                g = grad_chosen[start:end, None]
                grad_logits -= p * g
                grad_logits.scatter_add_(1, tokens[start:end, None], g)
            if grad_entropy is not None and entropy is not None:
                g = grad_entropy[start:end, None]
                grad_logits -= p * (logp + entropy[start:end, None]) * g
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h)
        return grad_hidden, grad_weight, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    rows: int,
    entropy: EntropyMode = "none",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[...]`` of ``tokens [...]`` under the LM head ``softmax(hidden W^T)``
    (``hidden [..., H]``, ``weight [V, H]``, fp32), and their entropy when asked (with or
    without gradients): the numbers of :func:`logprobs_and_entropy` over
    ``hidden @ weight.T``, computed ``rows`` positions at a time so that no more than
    ``rows x V`` logits exist at once, in the forward pass or the backward pass (which
    recomputes a chunk's logits instead of keeping them)."""
    chosen, ent, _ = head_token_outputs(hidden, weight, tokens, rows, entropy)
    return chosen, ent


def head_token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    rows: int,
    entropy: EntropyMode = "none",
    log_sum_sq_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`head_logprobs`'s log-probs and entropy and, with ``log_sum_sq_probs``,
    ``log Σ_v p_v²`` per position without gradients, from the same chunks of logits (the
    numbers of :func:`token_outputs` over ``hidden @ weight.T``)."""
    shape = tokens.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    chosen, ent, sq = _HeadLogprobs.apply(
        flat_hidden, weight, tokens.reshape(-1), max(1, rows), entropy != "none", log_sum_sq_probs
    )
    if ent is not None:
        ent = (ent.detach() if entropy == "detached" else ent).view(shape)
    return chosen.view(shape), ent, None if sq is None else sq.view(shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits): ``[B, R, V]`` -> ``[B, R]`` (fp32).

    Tokens with probability 0 (logit -inf: a masked vocabulary entry) contribute 0 (as
    ``0 log 0 = 0``), and so does their gradient, instead of ``0 * -inf = NaN``.
    """
    return _entropy_of_logp(torch.log_softmax(upcast(logits), dim=-1))


def _entropy_of_logp(logp: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` over the last dim of log-probs, with ``0 log 0 = 0``."""
    finite_logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * finite_logp).sum(-1)


# --------------------------------------------------------------------------- policy-gradient ops


def weight_samples(loss_mat: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Multiply a per-token loss ``[B, R]`` by per-sample weights ``[B]`` (no-op when None)."""
    if weights is None:
        return loss_mat
    return loss_mat * weights.to(loss_mat.dtype).unsqueeze(-1)


def weight_tokens(loss_mat: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token loss ``[B, R]`` times per-token weights ``[B, R]`` (unchanged when None)."""
    if weights is None:
        return loss_mat
    return loss_mat * weights.to(device=loss_mat.device, dtype=loss_mat.dtype)


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    level: Literal["token", "sequence"] = "token",
    mode: Literal["truncate", "mask"] = "truncate",
) -> torch.Tensor:
    """Importance weights ``[B, R]`` from the policy that sampled to the trainer's ``pi_old``.

    The samples' behaviour policy ``pi_rollout`` differs from ``pi_old``: a rollout engine
    samples with its own kernels (vLLM), or, asynchronously, with weights some steps older
    (``training.async``, where ``pi_old`` is the proximal policy of decoupled PPO; Hilton et
    al. 2022, AReaL). With ``r_t = pi_old(y_t) / pi_rollout(y_t)``::

        truncate (TIS; Yao et al. 2025):  token: w_t = min(r_t, C)
                                          sequence: w = min(prod_t r_t, C) on every token
        mask (masked IS):                 token: w_t = r_t if r_t <= C else 0
                                          sequence: w = prod_t r_t if it is <= C else 0

    Detached (no gradient), zero on padding. ``cap`` is C.
    """
    mask_b = mask.bool()
    log_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, mask, level)
    limit = math.log(cap)
    weights = torch.exp(log_ratio.clamp(max=limit))  # min(ratio, C), no overflow
    if mode == "mask":
        weights = torch.where(log_ratio > limit, 0.0, weights)
    return torch.where(mask_b, weights, 0.0).detach()


def rollout_log_ratio(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """``log pi_old - log pi_rollout`` per token ``[B, R]`` (zero on padding); with ``level``
    sequence, each row's sum on every one of its positions."""
    mask_b = mask.bool()
    log_ratio = torch.where(mask_b, upcast(old_logprobs) - upcast(rollout_logprobs), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(mask_b)
    return log_ratio.detach()


def last_token_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score ``[B]`` on its last unmasked token: ``[B, R]``, zero elsewhere.

    A row with no unmasked token gets no reward.
    """
    mask_b = mask.bool()
    counts = mask_b.long().cumsum(-1)
    is_last = mask_b & (counts == counts[..., -1:])
    return torch.where(is_last, upcast(scores).unsqueeze(-1), 0.0)


def token_level_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    dense: torch.Tensor | None = None,
    dense_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards ``[B, R]``: each score on its last token, minus ``kl_coef * KL_t`` on
    each, plus ``dense_coef`` times the dense (per-step) rewards ``[B, R]`` where given.

    r_t = 1[t = T] * score - beta * KL_t + c * d_t   (Ziegler et al. 2019; Ouyang et al. 2022,
    eq. 2; d_t a process reward on the last token of each step, as PRIME adds it, Cui et al. 2025)

    Without ``dense`` (or with ``dense_coef`` 0) the result is exactly the sequence-level one.
    """
    rewards = last_token_scores(scores, mask)
    if kl is not None and kl_coef != 0.0:
        rewards = rewards - kl_coef * torch.where(mask.bool(), upcast(kl), 0.0)
    if dense is not None and dense_coef != 0.0:
        rewards = rewards + dense_coef * torch.where(mask.bool(), upcast(dense), 0.0)
    return rewards


def group_mean_std(
    values: torch.Tensor, group_ids: torch.Tensor, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, standard deviation and size of each sample's group, gathered back per sample ``[B]``.

    Groups are given by ids (any order, any sizes; samples need not be contiguous). The standard
    deviation of a group of one is 0.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    values = upcast(values)
    count = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    count.index_add_(0, inverse, torch.ones_like(values))
    total = torch.zeros_like(count).index_add_(0, inverse, values)
    mean = (total / count)[inverse]
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, (values - mean).square())
    denom = (count - 1.0).clamp(min=1.0) if unbiased else count
    std = torch.sqrt(sq_dev / denom)[inverse]
    return mean, std, count[inverse]


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens.

    Runs the recursion over the unmasked tokens of each row as if they were contiguous (masked
    positions are skipped, and the value after the last token is 0)::

        delta_t = r_t + gamma * V_{t+1} - V_t                 (TD residual, GAE sec. 3)
        A_t     = delta_t + gamma * lam * A_{t+1}             (GAE(gamma, lambda), sec. 3)
        returns = A_t + V_t

    Returns ``(advantages, returns)``, both ``[B, R]`` and zero on padding. With ``values = 0``
    and ``lam = 1`` the advantages are the discounted returns.
    """
    mask_b = mask.bool()
    rewards = torch.where(mask_b, upcast(token_rewards), 0.0)
    values = torch.where(mask_b, upcast(values), 0.0)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[-1])):
        valid = mask_b[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid, advantage, 0.0)
        next_advantage = torch.where(valid, advantage, next_advantage)
        next_value = torch.where(valid, values[:, t], next_value)
    returns = torch.where(mask_b, advantages + values, 0.0)
    return advantages, returns


def token_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log r_t = log pi(y_t) - log pi_old(y_t) per token ``[B, R]``: the log of the importance
    ratio of the policy to the sampling policy, 0 on padding whatever the padding holds."""
    mask_b = mask.bool()
    return torch.where(mask_b, logprobs, 0.0) - torch.where(mask_b, old_logprobs, 0.0)


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss (to minimise) and where the clip binds: the one
    clipped surrogate of PPO, GRPO, RLOO and REINFORCE++.

    With ratio r = exp(log_ratio) (``log_ratio`` clamped to [-20, 20] so it stays finite)::

        L = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)     (PPO, Schulman 2017, eq. 7)

    and, with ``dual_clip = c > 1``, for A < 0 the loss is also capped at ``-c * A``
    (dual-clip PPO, Ye et al. 2020). With ``delta``, the unclipped term's ratio is capped at
    delta, ``-min(min(r, delta) A, clip(r, 1 - clip_low, 1 + clip_high) A)`` (two-sided
    clipping, INTELLECT-2; TRL's ``delta``): for A < 0 the same bound as a dual clip at
    ``c = delta`` once ``delta >= 1 + clip_high``. Returns ``(loss [B, R], clipped_low,
    clipped_high)``; the boolean masks mark tokens whose gradient the clip removes:
    ``r < 1 - clip_low`` with A < 0 and ``r > 1 + clip_high`` with A > 0 (the dual clip and
    delta count as clipped_high).
    """
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    capped = ratio if delta is None else ratio.clamp(max=delta)  # min(r, delta)  (INTELLECT-2)
    unclipped = -advantages * capped
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0)
    clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)
    if delta is not None:  # the capped term's gradient is gone where it is the larger one
        over = (ratio > delta) & (loss == unclipped)  # min(r, delta) A is the term taken
        clipped_high = clipped_high | (over & (advantages != 0))
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        clipped_high = clipped_high | dual
    return loss, clipped_low, clipped_high


def clip_fractions(
    clipped_low: torch.Tensor, clipped_high: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Fractions of response tokens where the lower, the upper or either clip bound binds."""
    low = masked_mean(clipped_low.float(), mask)
    high = masked_mean(clipped_high.float(), mask)
    return {"actor/clipfrac_low": low, "actor/clipfrac_high": high, "actor/clipfrac": low + high}


def approx_kl(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """k3 estimate of KL(pi_old || pi) over the sampled tokens: how far the update has moved."""
    kl = masked_kl_penalty(upcast(old_logprobs), upcast(logprobs.detach()), mask, "k3")
    return masked_mean(kl, mask)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    *,
    dual_clip: float | None = None,
    delta: float | None = None,
    policy_mask: torch.Tensor | None = None,
    aggregation: LossAggregation = "token-mean",
    norm_constant: float | None = None,
    weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's policy loss on given advantages, aggregated: the policy term of PPO, RLOO and
    REINFORCE++ (GRPO aggregates its KL term with the per-token surrogate, so it calls
    :func:`clipped_surrogate` itself).

    Per token :func:`clipped_surrogate` of :func:`token_log_ratio` (``dual_clip`` and
    ``delta`` as there), padding ignored whatever it holds, times ``policy_mask`` (``[B, R]``,
    the tokens TRL's options keep: :func:`alignzoo.algorithms.policy_term.policy_mask`; the
    normalisers still count every token), per-token ``token_weights`` (the rollout correction,
    :func:`rollout_is_weights`) and per-sample ``weights`` applied, then
    :func:`aggregate_loss` (over the optimizer step's counts when ``context`` is given).
    Returns the loss and detached metric tensors (this micro-batch's own mean pg loss, clip
    fractions, approximate KL to the sampling policy).
    """
    log_ratio = token_log_ratio(logprobs, old_logprobs, mask)
    pg_mat, clipped_low, clipped_high = clipped_surrogate(
        log_ratio, torch.where(mask.bool(), advantages, 0.0), clip_low, clip_high, dual_clip, delta
    )
    if policy_mask is not None:
        pg_mat = pg_mat * policy_mask
    weighted = weight_samples(weight_tokens(pg_mat, token_weights), weights)
    loss = aggregate_loss(weighted, mask, aggregation, norm_constant, context)
    local = aggregate_loss(weighted.detach(), mask, aggregation, norm_constant)
    metrics = {"actor/pg_loss": local, **clip_fractions(clipped_low, clipped_high, mask)}
    metrics["actor/approx_kl"] = approx_kl(logprobs, old_logprobs, mask)
    return loss, metrics
