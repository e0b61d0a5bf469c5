"""Unpaired feedback, online or offline (KTO): single completions, each desirable or not.

A training batch holds one response per sample with ``labels`` 1.0 (desirable) or 0.0.

- Offline: rows with ``prompt`` / ``completion`` / ``label`` (TRL's unpaired format).
- Online: ``samples_per_prompt`` responses per prompt, scored; a sample is desirable when its
  score is above its prompt's mean score, or when the labeler says it is correct
  (``Score.info["correct"]``), otherwise undesirable.

Mismatched pairs (KTO's reference point, Ethayarajh et al. 2024): after the batch transforms,
the mode scores each prompt ``i`` with the response of sample ``(i + 1) mod B`` under the
behaviour snapshot and the reference, without gradients, and puts the sequence log-probs in
``batch.columns["mismatched_logprobs"]`` and ``batch.columns["mismatched_ref_logprobs"]``
(``[B]``; the second only when a reference is loaded).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.modes.base import (
    OFFLINE_MAX_TOKENS,
    Collected,
    DataMode,
    StepSource,
    correct_flags,
    read_rows,
    sample_and_label,
)
from alignzoo.engine.modes.demonstrations import demonstrations_batch
from alignzoo.engine.scoring import Scorer

COLUMNS = ("prompt", "completion", "label")
MISMATCHED_LOGPROBS = "mismatched_logprobs"
MISMATCHED_REF_LOGPROBS = "mismatched_ref_logprobs"


def mismatch_partners(size: int) -> list[int]:
    """Mismatched pairs: sample ``i`` is paired with the response of ``(i + 1) mod B``."""
    return [(i + 1) % size for i in range(size)]


def mismatched_view(batch: RolloutBatch) -> RolloutBatch:
    """Prompt ``i`` of ``batch`` with the response of its partner sample."""
    other = batch.select(mismatch_partners(batch.size))
    return RolloutBatch(
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask,
        response_ids=other.response_ids,
        response_mask=other.response_mask,
        group_ids=batch.group_ids,
        sampling=batch.sampling,
    )


def label_desirable(batch: RolloutBatch, correct: list[bool] | None) -> RolloutBatch:
    """A sample is desirable when its score is above its group's mean score, or when it is
    correct (``correct[i]``); otherwise undesirable."""
    assert batch.scores is not None
    labels = torch.zeros(batch.size)
    for gid in torch.unique(batch.group_ids).tolist():
        members = batch.group_ids == gid
        mean = batch.scores[members].mean()
        labels[members] = (batch.scores[members] > mean).float()
    if correct is not None:
        labels = torch.maximum(labels, torch.tensor([float(c) for c in correct]))
    batch.labels = labels
    return batch


def unpaired_batch(tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> RolloutBatch:
    """Rows with prompt / completion / label (true = desirable) as a batch: the demonstrations'
    batch of the rows, with their labels."""
    batch = demonstrations_batch(tokenizer, rows, max_new_tokens, columns=COLUMNS)
    batch.labels = torch.tensor([1.0 if bool(r["label"]) else 0.0 for r in rows])
    return batch


class _Unpaired(DataMode):
    kind = "unpaired"

    def prepare(self, batch: RolloutBatch, scorer: Scorer) -> RolloutBatch:
        view = mismatched_view(batch)
        # Responses not sampled for these prompts: at the sampling temperature, not cut by
        # top-k / top-p (which would cut many of their tokens), for the policy and the reference.
        batch.columns[MISMATCHED_LOGPROBS] = scorer.sequence_logprobs(view, "actor", False)
        if scorer.models.reference is not None:
            batch.columns[MISMATCHED_REF_LOGPROBS] = scorer.sequence_logprobs(view, "ref")
        return batch


class OnlineUnpaired(_Unpaired):
    """Sampled responses, labelled desirable (above the prompt's mean, or correct) or not."""

    name: ClassVar[str] = "online unpaired"
    online = True

    def collect(self, rows: list[dict[str, Any]], source: StepSource) -> Collected:
        return sample_and_label(rows, source)

    def select(self, batch: RolloutBatch, metrics: dict[str, float]) -> RolloutBatch | None:
        batch = label_desirable(batch, correct_flags(batch))
        assert batch.labels is not None
        metrics["batch/desirable_frac"] = float(batch.labels.mean())
        return batch


class OfflineUnpaired(_Unpaired):
    """prompt / completion / label rows from the train data."""

    name: ClassVar[str] = "offline unpaired"
    online = False
    columns: ClassVar[tuple[str, ...]] = COLUMNS
    token_columns: ClassVar[dict[str, bool]] = {"prompt": True, "completion": False}

    def collect(self, rows: list[dict[str, Any]], source: StepSource) -> Collected:
        return read_rows(unpaired_batch(source.tokenizer, rows, OFFLINE_MAX_TOKENS), len(rows))

    def step_sizes(self, cfg: TrainingConfig) -> tuple[int, int]:
        return cfg.prompts_per_step, cfg.prompts_per_step
