"""Offline data to tensors: prompt and response texts tokenised into a :class:`RolloutBatch`.

Prompts are encoded with the tokenizer's special tokens (as the backend encodes them when it
samples), left-padded; responses without special tokens, ended with EOS, right-padded.
"""

from __future__ import annotations

from typing import Any

import torch

from alignzoo.batch import RolloutBatch


def _encode(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    """Token ids of each text, in one batched tokenizer call (no padding, no truncation)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=special)["input_ids"]]


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
    return ids, mask


def _right_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1.0
    return ids, mask


def tokenized_batch(
    tokenizer: Any,
    prompts: list[str],
    responses: list[str],
    extras: list[dict[str, Any]],
    max_new_tokens: int,
) -> RolloutBatch:
    """A batch from texts: responses end with EOS and are cut to ``max_new_tokens`` tokens."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompt_ids, prompt_mask = _left_pad(_encode(tokenizer, prompts, True), pad)
    resp = [[*s, eos][:max_new_tokens] for s in _encode(tokenizer, responses, False)]
    response_ids, response_mask = _right_pad(resp, pad)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        group_ids=torch.arange(len(prompts)),
        prompts=list(prompts),
        responses=list(responses),
        extras=extras,
    )
