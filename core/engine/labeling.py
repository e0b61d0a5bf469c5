"""The label stage: score every response of a step through the labeler's ``score_batch`` hook.

Kept on its own so that it can grow timeouts, retries and fallbacks without touching the loop.
"""

from __future__ import annotations

from typing import Any

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.errors import RunError, UserError
from alignzoo.types import LabelRequest, Score


def label_requests(batch: RolloutBatch) -> list[LabelRequest]:
    """One request per sample: prompt text, response text and the dataset's extra columns."""
    extras = batch.extras or [{} for _ in range(batch.size)]
    return [
        LabelRequest(prompt=p, response=r, extra=dict(e))
        for p, r, e in zip(batch.prompts, batch.responses, extras, strict=True)
    ]


def score_requests(pm: Any, requests: list[LabelRequest]) -> list[Score]:
    """Call the labeler on ``requests`` and check that it answered one Score per request."""
    if not requests:
        return []
    try:
        scores = pm.hook.score_batch(requests=requests)
    except (UserError, RunError):
        raise
    except Exception as exc:  # name the stage: a bare traceback from a plugin says little
        raise RunError(f"the labeler failed: {type(exc).__name__}: {exc}") from exc
    if scores is None or len(scores) != len(requests):
        got = "nothing" if scores is None else f"{len(scores)} scores"
        raise RunError(f"the labeler returned {got} for {len(requests)} responses")
    for i, s in enumerate(scores):
        if not isinstance(s, Score):
            raise RunError(f"the labeler returned {type(s).__name__} for response {i}, not a Score")
        try:
            float(s.value)
        except (TypeError, ValueError):
            raise RunError(
                f"the labeler returned Score(value={s.value!r}) for response {i}; expected a number"
            ) from None
    return list(scores)


def label(pm: Any, batch: RolloutBatch) -> RolloutBatch:
    """Fill ``batch.scores``, ``batch.score_valid`` and ``batch.label_info`` (in place)."""
    scores = score_requests(pm, label_requests(batch))
    batch.scores = torch.tensor([float(s.value) for s in scores], dtype=torch.float32)
    batch.score_valid = torch.tensor([bool(s.valid) for s in scores], dtype=torch.bool)
    batch.label_info = [dict(s.info) for s in scores]
    if not torch.isfinite(batch.scores).all():
        bad = int((~torch.isfinite(batch.scores)).nonzero()[0])
        raise RunError(f"the labeler returned a non-finite score for response {bad}")
    return batch
