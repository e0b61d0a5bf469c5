"""Offline data to tensors: prompt and response texts tokenised into a :class:`RolloutBatch`.

Prompts are encoded with the tokenizer's special tokens (as the backend encodes them when it
samples), left-padded; responses without special tokens, ended with EOS, right-padded.

An offline mode tokenises its text columns once, before training (:func:`pretokenize`, as
TRL's trainers ``map`` their datasets): each text column ``c`` gets a column
:func:`token_column` ``(c)`` of token ids in the Arrow table, and a step reads its rows' ids
from there instead of calling the tokenizer.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from alignzoo.batch import RolloutBatch

TOKEN_PREFIX = "_alignzoo_ids:"
"""The prefix of the token-id columns :func:`pretokenize` adds (never a labeler's extra)."""


def token_column(column: str) -> str:
    """The name of the column that holds the token ids of text column ``column``."""
    return TOKEN_PREFIX + column


def is_token_column(name: str) -> bool:
    return name.startswith(TOKEN_PREFIX)


def _encode(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    """Token ids of each text, in one batched tokenizer call (no padding, no truncation)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=special)["input_ids"]]


def pretokenize(dataset: Any, tokenizer: Any, columns: dict[str, bool]) -> Any:
    """``dataset`` with a token-id column beside each of ``columns`` (text column -> encode
    with the tokenizer's special tokens), encoded in batches of 1000 rows; the id columns are
    held in memory (no cache file is written), the dataset's own columns are not copied."""
    if not columns or len(dataset) == 0:
        return dataset

    def encode(rows: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        return {
            token_column(c): _encode(tokenizer, [str(t) for t in rows[c]], special)
            for c, special in columns.items()
        }

    vocab = getattr(tokenizer, "name_or_path", "") + str(len(tokenizer))
    key = f"{dataset._fingerprint}|{vocab}|{sorted(columns.items())}"
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bar()
    try:
        ids = dataset.map(  # only the new columns in memory; the texts stay where they are
            encode,
            batched=True,
            batch_size=1000,
            keep_in_memory=True,
            remove_columns=dataset.column_names,
            new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16],
        )
        return datasets.concatenate_datasets([dataset, ids], axis=1)
    finally:
        if bars:
            datasets.enable_progress_bar()


def row_tokens(
    tokenizer: Any, rows: list[dict[str, Any]], column: str, special: bool
) -> list[list[int]]:
    """The token ids of ``column`` in each row: read from its :func:`token_column` where
    :func:`pretokenize` added one, else encoded now."""
    ids = token_column(column)
    if rows and all(ids in row for row in rows):
        return [list(row[ids]) for row in rows]
    return _encode(tokenizer, [str(row[column]) for row in rows], special)


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in seqs))
    ids = torch.tensor([[pad] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, mask


def _right_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in seqs))
    ids = torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)
    mask = torch.tensor(
        [[1.0] * len(s) + [0.0] * (width - len(s)) for s in seqs], dtype=torch.float32
    )
    return ids, mask


def _ended(tokens: list[int], eos: int, tokenizer: Any) -> list[int]:
    """``tokens`` ending with ``eos``: what follows their last ``eos`` dropped when it is only
    whitespace (a chat template's text after its end of turn, which sampling stops before),
    ``eos`` appended otherwise."""
    if eos in tokens:
        last = len(tokens) - 1 - tokens[::-1].index(eos)
        tail = tokens[last + 1 :]
        if not tail or not tokenizer.decode(tail).strip():
            return tokens[: last + 1]
    return [*tokens, eos]


def tokenized_batch(
    tokenizer: Any,
    prompts: list[str],
    responses: list[str],
    extras: list[dict[str, Any]],
    max_new_tokens: int,
    prompt_tokens: list[list[int]] | None = None,
    response_tokens: list[list[int]] | None = None,
) -> RolloutBatch:
    """A batch from texts: responses end where sampling would stop, at their last EOS when only
    whitespace follows it (a conversational completion's final end of turn, when the chat
    template's end-of-turn token is the tokenizer's EOS, as Qwen's and Llama's instruct
    tokenizers have it: the template's newline after it is never sampled, so it is not trained
    on either; earlier turns of a multi-message completion are kept), with EOS appended to
    any other response; then cut to ``max_new_tokens`` tokens. ``prompt_tokens`` /
    ``response_tokens``, when given, are the texts' ids already encoded (prompts with the
    special tokens, responses without)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if prompt_tokens is None:
        prompt_tokens = _encode(tokenizer, prompts, True)
    if response_tokens is None:
        response_tokens = _encode(tokenizer, responses, False)
    prompt_ids, prompt_mask = _left_pad(prompt_tokens, pad)
    resp = [_ended(list(s), eos, tokenizer)[:max_new_tokens] for s in response_tokens]
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
