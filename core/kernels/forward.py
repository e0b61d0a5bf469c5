"""Forward passes of the actor, the reference and the critic over a :class:`RolloutBatch`.

The model sees ``prompt_ids`` (left-padded) followed by ``response_ids`` (right-padded); the
log-prob of response token ``t`` comes from the logits at position ``P + t - 1``, and so does
the critic's value of the state before token ``t``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.kernels.lean import can_run_lean, lean_head, lean_hidden, lean_logits
from alignzoo.kernels.packing import PackedRows, Packing, pack
from alignzoo.kernels.trace import traced_hidden
from alignzoo.ops import (
    EntropyMode,
    head_token_outputs,
    tempers,
    token_outputs,
    truncates,
    warp_logits,
)

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]

# The most logits (floats) the policy's log-prob pass holds at once: beyond it, a Qwen2 / Llama
# head runs in chunks of positions (alignzoo.ops.head_token_outputs). 2^25 floats = 128 MB in
# fp32, where 64 x 512 positions of a 151,936-token vocabulary are 20 GB (and its log-softmax 20 GB
# more, kept for the backward pass).
LOGITS_AT_ONCE = 1 << 25


def no_autocast() -> contextlib.AbstractContextManager[Any]:
    """The autocast factory for fp32 (CPU) runs."""
    return contextlib.nullcontext()


def model_inputs(batch: RolloutBatch, device: torch.device | str) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and position_ids of prompt + response, on ``device``."""
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1).to(device)
    attended = (
        batch.response_attention.long()
        if batch.response_attention is not None
        else (batch.response_mask > 0).long()
    )
    attention = torch.cat([batch.prompt_mask.long(), attended], dim=1)
    attention = attention.to(device)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions}


def _device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


_FORWARD_PARAMETERS: dict[type, frozenset[str]] = {}


def forward_parameters(model: Any) -> frozenset[str]:
    """The keyword names the model's ``forward`` takes (a peft model's: its base model's)."""
    cls = type(_base_model(model))
    if cls not in _FORWARD_PARAMETERS:
        try:
            names = frozenset(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError, AttributeError):
            names = frozenset()
        _FORWARD_PARAMETERS[cls] = names
    return _FORWARD_PARAMETERS[cls]


def takes_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs do)."""
    return "logits_to_keep" in forward_parameters(model)


def _base_model(model: Any) -> Any:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module  # DDP forwards its kwargs to the module it wraps
    get_base = getattr(model, "get_base_model", None)  # a peft model forwards its kwargs
    return get_base() if callable(get_base) else model


def _packed_model_outputs(model: Any, packed: PackedRows, autocast: AutocastFactory) -> Any:
    """The model's output on packed rows: ``(hidden, True)`` from the lean path (what the LM
    head reads, ``[N, L, H]``), ``(logits, False)`` from transformers' forward with a ready
    4-D mask (``[N, L, V]``; a value head's ``[N, L, 1]``)."""
    device = _device_of(model)
    ids, positions = packed.input_ids.to(device), packed.position_ids.to(device)
    if can_run_lean(model):
        with autocast():
            hidden = lean_hidden(
                model, ids, packed.real.to(device), positions, segments=packed.segments.to(device)
            )
        return hidden, True
    mask = _packed_mask(model, packed).to(device)
    with autocast():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits, False


PACKED_ATTENTION = ("sdpa", "eager")
"""The attention implementations that take a ready 4-D mask (a packed batch's); a model on
another one (flash_attention_2 reads a mask as padding) runs its batches padded."""


def _packed_mask(model: Any, packed: PackedRows) -> torch.Tensor:
    """The packed rows' 4-D mask as the model's attention takes it: boolean for sdpa (whatever
    the autocast dtype), additive in the model's dtype for eager (which adds it)."""
    config = getattr(_base_model(model), "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        return packed.see()
    return packed.attention_bias(next(model.parameters()).dtype)


def packed_rows(batch: RolloutBatch, packing: Packing | None, model: Any) -> PackedRows | None:
    """``batch`` packed for ``model`` (:func:`~alignzoo.kernels.packing.pack`), or None: no
    packing asked, a model whose attention takes no ready 4-D mask, or a batch that cannot be."""
    if packing is None:
        return None
    if not can_run_lean(model):
        config = getattr(_base_model(model), "config", None)
        if getattr(config, "_attn_implementation", "eager") not in PACKED_ATTENTION:
            return None
    return pack(batch, packing)


def response_logits(
    model: Any,
    batch: RolloutBatch,
    autocast: AutocastFactory = no_autocast,
    packing: Packing | None = None,
) -> torch.Tensor:
    """The logits that predict each response token ``[B, R, V]`` (positions ``P - 1 .. P + R - 2``).

    Where the model supports it, only the last ``R + 1`` positions go through the LM head, so
    the prompt's logits (a large ``[B, P, V]`` for a real vocabulary) are never computed. A
    Qwen2 or Llama model runs through :func:`alignzoo.kernels.lean.lean_logits` (its own modules,
    the same logits) unless :func:`~alignzoo.kernels.lean.lean_reason` says it cannot.
    With ``packing``, the samples run packed (:mod:`alignzoo.kernels.packing`) and the same
    logits are gathered back into the batch's layout.
    """
    traced = traced_hidden(model, batch)
    if traced is not None:  # the decode loop's activations (alignzoo.kernels.trace)
        return lean_head(model, traced)
    packed = packed_rows(batch, packing, model)
    if packed is not None:
        out, is_hidden = _packed_model_outputs(model, packed, autocast)
        if not is_hidden:
            return packed.gather(out)
        with autocast():
            return lean_head(model, packed.gather(out))
    device = _device_of(model)
    prompt_len = batch.prompt_ids.shape[1]
    resp_len = batch.response_ids.shape[1]
    inputs = model_inputs(batch, device)
    if can_run_lean(model):  # the same logits without transformers' per-call machinery
        with autocast():
            logits = lean_logits(model, **inputs, logits_to_keep=resp_len + 1)
        return logits[:, :resp_len]
    if takes_logits_to_keep(model):
        with autocast():
            logits = model(**inputs, logits_to_keep=resp_len + 1).logits
        return logits[:, :resp_len]
    with autocast():
        logits = model(**inputs).logits
    return logits[:, prompt_len - 1 : prompt_len + resp_len - 1]


class TokenOutputs(NamedTuple):
    """What one policy pass gives per response token ``[B, R]``: the log-probs of
    ``batch.response_ids``, and the entropy and ``log Σ_v p_v²`` of the distribution each token
    was drawn from when asked (None otherwise)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None


def _entropy_mode(entropy: bool, detached_entropy: bool) -> EntropyMode:
    return "grad" if entropy else "detached" if detached_entropy else "none"


def policy_forward(
    model: Any,
    batch: RolloutBatch,
    entropy: bool = False,
    autocast: AutocastFactory = no_autocast,
    detached_entropy: bool = False,
    truncate: bool = True,
    packing: Packing | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``[B, R]`` of ``batch.response_ids`` (and entropy ``[B, R]``) under
    the distribution each sample was drawn from (``batch.sampling``: temperature, then top-k and
    top-p renormalised, :func:`~alignzoo.ops.warp_logits`); dataset rows under the model's own.

    ``truncate=False`` takes the temperature only (the reference's log-probs). A sampled token
    outside the truncated support (a sampler that kept a token this forward pass does not) has
    log-prob ``-inf``: :func:`outside_support` masks it. ``entropy`` returns the entropy of
    that distribution with gradients; ``detached_entropy`` (when ``entropy`` is False) returns
    it without, from the same log-softmax, for metrics only. ``packing`` runs the batch's
    samples packed (:mod:`alignzoo.kernels.packing`): the same numbers without the padding.
    :func:`policy_outputs` gives ``log Σ_v p_v²`` from the same pass besides.
    """
    out = policy_outputs(model, batch, entropy, autocast, detached_entropy, truncate, packing)
    return out.logprobs, out.entropy


def policy_outputs(
    model: Any,
    batch: RolloutBatch,
    entropy: bool = False,
    autocast: AutocastFactory = no_autocast,
    detached_entropy: bool = False,
    truncate: bool = True,
    packing: Packing | None = None,
    log_sum_sq_probs: bool = False,
) -> TokenOutputs:
    """:func:`policy_forward`'s log-probs and entropy and, with ``log_sum_sq_probs``,
    ``log Σ_v p_v²`` per response token without gradients (for WPO's weights:
    ``AlgorithmRequirements.log_sum_sq_probs``), of the same distribution and from the same
    pass over the vocabulary: the whole logits' one log-softmax, or each chunk of the LM
    head's logits (:func:`~alignzoo.ops.head_token_outputs`); on the lean path, transformers'
    forward and packed rows alike."""
    chunked = _chunked_head_outputs(
        model,
        batch,
        autocast,
        _entropy_mode(entropy, detached_entropy),
        truncate,
        packing,
        log_sum_sq_probs,
    )
    if chunked is not None:
        return chunked
    logits = warp_logits(response_logits(model, batch, autocast, packing), batch.sampling, truncate)
    tokens = batch.response_ids.to(logits.device)
    return TokenOutputs(
        *token_outputs(logits, tokens, _entropy_mode(entropy, detached_entropy), log_sum_sq_probs)
    )


def policy_forward_with_logits(
    model: Any,
    batch: RolloutBatch,
    entropy: bool = False,
    autocast: AutocastFactory = no_autocast,
    detached_entropy: bool = False,
    packing: Packing | None = None,
    log_sum_sq_probs: bool = False,
) -> tuple[TokenOutputs, torch.Tensor]:
    """:func:`policy_outputs`' numbers and, from the same pass, the response logits
    ``[B, R, V]`` before any temperature (for a loss over the whole vocabulary, GKD's): the
    logits are held whole, never in chunks of positions."""
    logits = response_logits(model, batch, autocast, packing)
    tokens = batch.response_ids.to(logits.device)
    warped = warp_logits(logits, batch.sampling, True)
    mode = _entropy_mode(entropy, detached_entropy)
    return TokenOutputs(*token_outputs(warped, tokens, mode, log_sum_sq_probs)), logits


def _chunked_head_outputs(
    model: Any,
    batch: RolloutBatch,
    autocast: AutocastFactory,
    entropy: EntropyMode,
    truncate: bool,
    packing: Packing | None = None,
    log_sum_sq_probs: bool = False,
) -> TokenOutputs | None:
    """:func:`policy_outputs`' numbers with the LM head in chunks of positions, for a model
    of the lean path whose response logits would exceed :data:`LOGITS_AT_ONCE` floats and
    whose head is a plain fp32 ``nn.Linear`` outside autocast, sampled without top-k / top-p
    (a temperature divides the hidden states: ``(h / T) W^T = z / T``); None otherwise (the
    caller then computes the logits whole)."""
    head = getattr(_base_model(model), "lm_head", None)
    weight = getattr(head, "weight", None)
    rows, resp_len = batch.response_ids.shape
    if weight is None or rows * resp_len * weight.shape[0] <= LOGITS_AT_ONCE:
        return None  # the common case, decided before the costlier checks
    if (
        (truncate and truncates(batch.sampling))  # the whole logits: top-k / top-p sort them
        or not can_run_lean(model)
        or type(head) is not torch.nn.Linear
        or head.bias is not None
        or head._forward_hooks
        or head._forward_pre_hooks
        or weight.dtype != torch.float32
    ):
        return None
    device = _device_of(model)
    with autocast():
        if torch.is_autocast_enabled(device.type):
            return None
        traced = traced_hidden(model, batch)
        packed = None if traced is not None else packed_rows(batch, packing, model)
        if traced is not None:
            hidden = traced
        elif packed is not None:
            hidden = packed.gather(_packed_model_outputs(model, packed, autocast)[0])
        else:
            inputs = model_inputs(batch, device)
            hidden = lean_hidden(model, **inputs, logits_to_keep=resp_len + 1)[:, :resp_len]
    tokens = batch.response_ids.to(device)
    if tempers(batch.sampling):  # (h / T) W^T = z / T, row by row
        assert batch.sampling is not None
        temperature = batch.sampling[:, 0].to(device=device, dtype=hidden.dtype)
        hidden = hidden / torch.where(temperature > 0, temperature, 1.0).view(-1, 1, 1)
    chunk = LOGITS_AT_ONCE // weight.shape[0]
    return TokenOutputs(
        *head_token_outputs(hidden, weight, tokens, chunk, entropy, log_sum_sq_probs)
    )


def critic_forward(
    critic: Any,
    batch: RolloutBatch,
    autocast: AutocastFactory = no_autocast,
    packing: Packing | None = None,
) -> torch.Tensor:
    """Critic values ``[B, R]``: V(state before response token t); ``packing`` as
    :func:`policy_forward`'s."""
    packed = packed_rows(batch, packing, critic)
    if packed is not None:
        device = _device_of(critic)
        mask = _packed_mask(critic, packed).to(device)
        with autocast():
            out = critic(
                input_ids=packed.input_ids.to(device),
                attention_mask=mask,
                position_ids=packed.position_ids.to(device),
            ).logits
        return packed.gather(out)[..., 0].float()
    device = _device_of(critic)
    prompt_len = batch.prompt_ids.shape[1]
    resp_len = batch.response_ids.shape[1]
    with autocast():
        out = critic(**model_inputs(batch, device)).logits
    return out[:, prompt_len - 1 : prompt_len + resp_len - 1, 0].float()


@contextlib.contextmanager
def evaluating(model: Any) -> Iterator[None]:
    """``model`` in eval mode (no dropout) for the block; its previous mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def sequence_logprob(
    model: Any,
    batch: RolloutBatch,
    autocast: AutocastFactory,
    truncate: bool = True,
    packing: Packing | None = None,
) -> torch.Tensor:
    """Sum of response log-probs per sample ``[B]`` (those of tokens outside the sampled
    support, :func:`outside_support`, left out)."""
    logprobs, _ = policy_forward(
        model, batch, autocast=autocast, truncate=truncate, packing=packing
    )
    mask = batch.response_mask.to(logprobs.device)
    logprobs, _ = outside_support(logprobs, mask)  # 0 where cut: left out of the sum
    return (logprobs * mask).sum(dim=-1)


def outside_support(
    logprobs: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor | float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs`` with each ``-inf`` (a token outside the support of the truncated
    distribution this forward pass computes: a sampler that kept a token top-k / top-p here
    cuts, or padding) replaced by ``fill`` (without a gradient), and where a trained token
    (``mask`` > 0) was ``[B, R]`` bool, so the caller masks those out of the loss and counts
    them (``rollout/outside_support``) instead of training through ``-inf``."""
    cut = torch.isneginf(logprobs)  # padding too: its token may lie outside the support
    outside = cut & (mask.to(logprobs.device) > 0)
    if not bool(cut.any()):
        return logprobs, outside
    if isinstance(fill, torch.Tensor):
        fill = fill.to(device=logprobs.device, dtype=logprobs.dtype)
    return torch.where(cut, fill, logprobs), outside


def chunks(size: int, chunk: int) -> Iterator[list[int]]:
    """Consecutive index lists of at most ``chunk`` items covering ``range(size)``."""
    for start in range(0, size, chunk):
        yield list(range(start, min(size, start + chunk)))


@torch.no_grad()
def no_grad_map(
    fn: Callable[[RolloutBatch], torch.Tensor], batch: RolloutBatch, micro_batch_size: int
) -> torch.Tensor:
    """``fn`` over micro-batches of ``batch`` without gradients, concatenated on the CPU."""
    parts = [
        fn(batch.select(idx)).detach().float().cpu() for idx in chunks(batch.size, micro_batch_size)
    ]
    return torch.cat(parts, dim=0)
