"""Reward functions on the embedded task for the ``python`` labeler (TRL's signature).

:func:`exact_match` is the arithmetic rule's exact match after a fixed wait: a labeler with the
latency of a remote service, a judge model or a sandbox, for experiments on hiding labeling
behind training (``experiments/async.yaml``). Waiting takes no CPU, so on a small machine the
latency is what a slow labeler costs a run and nothing else.
"""

from __future__ import annotations

import time
from typing import Any

from alignzoo.types import Score
from alignzoo.world.task import extract_answer


def exact_match(
    completions: list[str], answer: list[str], latency_s: float = 0.0, **_: Any
) -> list[Score]:
    """1 for the right number, 0 for a wrong one, 0 (invalid) for a malformed answer, as the
    ``arithmetic`` labeler scores, each marked ``info["correct"]``; returned after ``latency_s``
    seconds per call (one call labels a whole step unless ``labeling.batch_size`` splits it)."""
    if latency_s < 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s}")
    time.sleep(latency_s)
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        got = extract_answer(completion)
        if got is None:
            scores.append(Score(0.0, valid=False, info={"malformed": True, "correct": False}))
        else:
            right = got == extract_answer(str(expected))
            scores.append(Score(float(right), info={"extracted": got, "correct": right}))
    return scores
