"""The label stage: score every response of a step through the labeler's ``score_batch`` hook.

Kept on its own so that it can grow timeouts, retries and fallbacks without touching the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.types import LabelRequest

if TYPE_CHECKING:
    from alignzoo.engine.hooks import Hooks


def label_requests(batch: RolloutBatch) -> list[LabelRequest]:
    """One request per sample: prompt text, response text and the dataset's extra columns."""
    extras = batch.extras or [{} for _ in range(batch.size)]
    return [
        LabelRequest(prompt=p, response=r, extra=dict(e))
        for p, r, e in zip(batch.prompts, batch.responses, extras, strict=True)
    ]


def label(hooks: Hooks, batch: RolloutBatch) -> RolloutBatch:
    """Fill ``batch.scores``, ``batch.score_valid`` and ``batch.label_info`` (in place)."""
    scores = hooks.score_batch(label_requests(batch))
    batch.scores = torch.tensor([float(s.value) for s in scores], dtype=torch.float32)
    batch.score_valid = torch.tensor([bool(s.valid) for s in scores], dtype=torch.bool)
    batch.label_info = [dict(s.info) for s in scores]
    return batch
