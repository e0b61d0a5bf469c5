"""Held-out evaluation: greedy decoding on the first ``evaluation.num_prompts`` eval prompts.

Run at step 0, every ``evaluation.every`` steps and at the end, identically for every arm.
Metrics: ``eval/score`` (the labeler's mean score), ``eval/exact_match`` (the task's own check,
when the eval data has an ``answer`` column) and, when ``evaluation.pass_at_k`` is set,
``eval/pass@k`` (a prompt passes when one of k sampled responses is correct).
"""

from __future__ import annotations

from typing import Any

from alignzoo.batch import RolloutBatch
from alignzoo.engine.labeling import label
from alignzoo.engine.rollout import generate, split_rows, task_correct
from alignzoo.types import SamplingParams

EVAL_CHUNK = 128


def eval_rows(dataset: Any, num_prompts: int | None) -> list[dict[str, Any]]:
    """The first ``num_prompts`` rows of the eval split (all when None), as dicts."""
    n = len(dataset) if num_prompts is None else min(num_prompts, len(dataset))
    columns = dataset.select(range(n)).to_dict()
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def _correct(batch: RolloutBatch) -> list[bool] | None:
    """The task's check per sample, or None when the eval data has no ``answer`` column."""
    if not batch.extras or "answer" not in batch.extras[0]:
        return None
    return task_correct(batch)


def _sample(pm: Any, rows: list[dict[str, Any]], n: int, sampling: SamplingParams) -> RolloutBatch:
    parts = []
    for start in range(0, len(rows), EVAL_CHUNK):
        prompts, extras = split_rows(rows[start : start + EVAL_CHUNK])
        parts.append(label(pm, generate(pm, prompts, extras, n, sampling)))
    return RolloutBatch.concat(parts)


def evaluate(
    pm: Any,
    rows: list[dict[str, Any]],
    max_new_tokens: int,
    pass_at_k: int | None = None,
    sampling: SamplingParams | None = None,
) -> dict[str, float]:
    """Evaluate the backend's current weights on ``rows``; returns ``eval/*`` metrics."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    batch = _sample(pm, rows, 1, greedy)
    assert batch.scores is not None
    # A labeler that rescales its scores per call (normalize: true) keeps the value it rescaled
    # in info["raw"]; evaluation reports that, so eval/score stays comparable across steps.
    raw = [info.get("raw") for info in batch.label_info] if batch.label_info else []
    if raw and all(isinstance(r, (int, float)) for r in raw):
        out = {"eval/score": float(sum(raw) / len(raw))}
    else:
        out = {"eval/score": float(batch.scores.mean())}
    correct = _correct(batch)
    if correct is not None:
        out["eval/exact_match"] = sum(correct) / len(correct)
    out["eval/response_length"] = float(batch.response_mask.sum(dim=1).mean())
    if pass_at_k:
        params = (sampling or SamplingParams()).model_copy(
            update={"max_new_tokens": max_new_tokens}
        )
        if params.temperature == 0:
            params = params.model_copy(update={"temperature": 1.0})
        sampled = _sample(pm, rows, pass_at_k, params)
        hits = _correct(sampled)
        if hits is None:  # no task check: a prompt passes when one sample scores > 0
            assert sampled.scores is not None
            hits = [bool(s > 0) for s in sampled.scores.tolist()]
        per_prompt = [any(hits[i : i + pass_at_k]) for i in range(0, len(hits), pass_at_k)]
        out[f"eval/pass@{pass_at_k}"] = sum(per_prompt) / len(per_prompt)
    return out
