"""Forward passes of the actor, the reference and the critic over a :class:`RolloutBatch`.

The model sees ``prompt_ids`` (left-padded) followed by ``response_ids`` (right-padded); the
log-prob of response token ``t`` comes from the logits at position ``P + t - 1``, and so does
the critic's value of the state before token ``t``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.ops import entropy_from_logits, logprobs_from_logits

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]


def no_autocast() -> contextlib.AbstractContextManager[Any]:
    """The autocast factory for fp32 (CPU) runs."""
    return contextlib.nullcontext()


def model_inputs(batch: RolloutBatch, device: torch.device | str) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and position_ids of prompt + response, on ``device``."""
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1).to(device)
    attention = torch.cat([batch.prompt_mask.long(), (batch.response_mask > 0).long()], dim=1)
    attention = attention.to(device)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions}


def _device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


def policy_forward(
    model: Any, batch: RolloutBatch, entropy: bool = False, autocast: AutocastFactory = no_autocast
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``[B, R]`` of ``batch.response_ids`` (and entropy ``[B, R]``)."""
    device = _device_of(model)
    prompt_len = batch.prompt_ids.shape[1]
    resp_len = batch.response_ids.shape[1]
    with autocast():
        logits = model(**model_inputs(batch, device)).logits
    logits = logits[:, prompt_len - 1 : prompt_len + resp_len - 1]
    logprobs = logprobs_from_logits(logits, batch.response_ids.to(device))
    ent = entropy_from_logits(logits) if entropy else None
    return logprobs, ent


def critic_forward(
    critic: Any, batch: RolloutBatch, autocast: AutocastFactory = no_autocast
) -> torch.Tensor:
    """Critic values ``[B, R]``: V(state before response token t)."""
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


def sequence_logprob(model: Any, batch: RolloutBatch, autocast: AutocastFactory) -> torch.Tensor:
    """Sum of response log-probs per sample ``[B]``."""
    logprobs, _ = policy_forward(model, batch, autocast=autocast)
    mask = batch.response_mask.to(logprobs.device)
    return (logprobs * mask).sum(dim=-1)


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
