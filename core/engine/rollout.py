"""Building a step's batch: sampled online (backend + pairing for DPO/KTO) or read offline.

Preference batches keep each pair adjacent: sample ``2i`` is the chosen response and ``2i + 1``
the rejected one, both with ``group_ids == i`` and ``labels`` 1.0 / 0.0.
Unpaired (KTO) batches hold one response per sample with ``labels`` 1.0 (desirable) or 0.0.
"""

from __future__ import annotations

from typing import Any

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.errors import RunError
from alignzoo.types import SamplingParams
from alignzoo.world.task import is_correct

PROMPT_COLUMN = "prompt"


def split_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Prompts, and the other columns of each row (what the labeler gets as ``extra``)."""
    prompts = [str(r[PROMPT_COLUMN]) for r in rows]
    extras = [{k: v for k, v in r.items() if k != PROMPT_COLUMN} for r in rows]
    return prompts, extras


def generate(
    pm: Any, prompts: list[str], extras: list[dict[str, Any]], n: int, sampling: SamplingParams
) -> RolloutBatch:
    """``n`` responses per prompt from the backend, checked against the hook's contract."""
    batch = pm.hook.generate(prompts=prompts, extras=extras, n=n, sampling=sampling)
    if not isinstance(batch, RolloutBatch):
        raise RunError(
            f"the backend's generate returned {type(batch).__name__}, not a RolloutBatch"
        )
    if batch.size != len(prompts) * n:
        raise RunError(f"the backend returned {batch.size} samples for {len(prompts)} x {n}")
    if not batch.extras:
        batch.extras = [dict(e) for e in extras for _ in range(n)]
    check_layout(batch, n)
    return batch


def check_layout(batch: RolloutBatch, n: int) -> None:
    """Raise a RunError naming the field when a backend's batch breaks the ``generate`` contract
    (shapes that disagree, texts of the wrong length, groups not ``i // n``)."""
    b = batch.size
    shapes = {
        "prompt_mask": (batch.prompt_mask, tuple(batch.prompt_ids.shape)),
        "response_mask": (batch.response_mask, tuple(batch.response_ids.shape)),
        "old_logprobs": (batch.old_logprobs, tuple(batch.response_ids.shape)),
        "group_ids": (batch.group_ids, (b,)),
    }
    for name, (tensor, expected) in shapes.items():
        if tensor is not None and tuple(tensor.shape) != expected:
            raise RunError(
                f"the backend's batch: {name} has shape {list(tensor.shape)}, "
                f"expected {list(expected)}"
            )
    if batch.prompt_ids.shape[0] != b:
        raise RunError(
            f"the backend's batch: prompt_ids has {batch.prompt_ids.shape[0]} rows for {b}"
        )
    for name in ("prompts", "responses", "extras"):
        if len(getattr(batch, name)) != b:
            raise RunError(
                f"the backend's batch: {name} has {len(getattr(batch, name))} items for {b} samples"
            )
    if not torch.equal(batch.group_ids.cpu(), torch.arange(b) // n):
        raise RunError("the backend's batch: group_ids must be i // n (samples grouped by prompt)")


def task_correct(batch: RolloutBatch) -> list[bool]:
    """Per sample: the response states the ``answer`` column of its row (False without one)."""
    extras = batch.extras or [{} for _ in range(batch.size)]
    return [
        "answer" in e and is_correct(r, str(e["answer"]))
        for r, e in zip(batch.responses, extras, strict=True)
    ]


# ------------------------------------------------------------------ online preference data


def pair_by_score(batch: RolloutBatch) -> RolloutBatch | None:
    """Online DPO: per group, the highest-scored sample is chosen and the lowest rejected.

    Groups whose best and worst scores tie give no pair and are dropped; None when no group is
    left. Ties are broken by sample order (the first best, the last worst).
    """
    assert batch.scores is not None
    order: list[int] = []
    for gid in torch.unique(batch.group_ids, sorted=True).tolist():
        members = (batch.group_ids == gid).nonzero().flatten().tolist()
        scores = batch.scores[members]
        best = members[int(torch.argmax(scores))]
        worst = members[len(members) - 1 - int(torch.argmin(scores.flip(0)))]
        if batch.scores[best] > batch.scores[worst]:
            order += [best, worst]
    if not order:
        return None
    pairs = batch.select(order)
    pairs.group_ids = torch.arange(len(order) // 2).repeat_interleave(2)
    pairs.labels = torch.tensor([1.0, 0.0]).repeat(len(order) // 2)
    return pairs


def label_desirable(batch: RolloutBatch, correct: list[bool]) -> RolloutBatch:
    """Online KTO: a sample is desirable when its score is above its group's mean score, or
    when it is exactly correct (``correct[i]``); otherwise undesirable."""
    assert batch.scores is not None
    labels = torch.zeros(batch.size)
    for gid in torch.unique(batch.group_ids).tolist():
        members = batch.group_ids == gid
        mean = batch.scores[members].mean()
        labels[members] = (batch.scores[members] > mean).float()
    labels = torch.maximum(labels, torch.tensor([float(c) for c in correct]))
    batch.labels = labels
    return batch


# ------------------------------------------------------------------ offline data


def _encode(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=special)["input_ids"] for t in texts]


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


def preference_batch(
    tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int
) -> RolloutBatch:
    """Offline DPO/SimPO: rows with prompt / chosen / rejected become adjacent pairs."""
    prompts, responses, extras = [], [], []
    for row in rows:
        extra = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
        for key in ("chosen", "rejected"):
            prompts.append(str(row["prompt"]))
            responses.append(str(row[key]))
            extras.append(dict(extra))
    batch = tokenized_batch(tokenizer, prompts, responses, extras, max_new_tokens)
    batch.group_ids = torch.arange(len(rows)).repeat_interleave(2)
    batch.labels = torch.tensor([1.0, 0.0]).repeat(len(rows))
    return batch


def unpaired_batch(tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> RolloutBatch:
    """Offline KTO: rows with prompt / completion / label (true = desirable)."""
    extras = [
        {k: v for k, v in r.items() if k not in ("prompt", "completion", "label")} for r in rows
    ]
    batch = tokenized_batch(
        tokenizer,
        [str(r["prompt"]) for r in rows],
        [str(r["completion"]) for r in rows],
        extras,
        max_new_tokens,
    )
    batch.labels = torch.tensor([1.0 if bool(r["label"]) else 0.0 for r in rows])
    return batch
