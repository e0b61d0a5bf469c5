"""Held-out evaluation: greedy decoding on the first ``evaluation.num_prompts`` eval prompts.

Run at step 0, every ``evaluation.every`` steps and at the end, identically for every arm.
Metrics (:mod:`alignzoo.metrics`): ``eval/score`` (the labeler's mean score, unscaled),
``eval/exact_match`` (the fraction the labeler marks correct, when it says so for every
response: ``Score.info["correct"]``), ``eval/response_length`` and, when
``evaluation.pass_at_k`` is set, ``eval/pass@k`` (a prompt passes when one of k sampled
responses is correct, or scores above 0 for a labeler that does not say what is correct).
A response that no labeler of the arm's chain could give a value is left out of these, and
``eval/labeled_frac`` says which share of the greedy responses was labeled (when none was,
it is the only score reported). An arm with an
environment evaluates by greedy episodes and adds their ``env/*`` metrics as ``eval/env/*``
(``eval/env/tool_calls``: the held-out tool-call rate, per episode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.modes import correct_flags, split_rows
from alignzoo.labeling import LabelingStage, label
from alignzoo.types import SamplingParams

if TYPE_CHECKING:
    from alignzoo.engine.hooks import Hooks

EVAL_CHUNK = 128


def eval_rows(dataset: Any, num_prompts: int | None) -> list[dict[str, Any]]:
    """The first ``num_prompts`` rows of the eval split (all when None), as dicts."""
    n = len(dataset) if num_prompts is None else min(num_prompts, len(dataset))
    columns = dataset.select(range(n)).to_dict()
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def _sample(
    hooks: Hooks,
    rows: list[dict[str, Any]],
    n: int,
    sampling: SamplingParams,
    labeling: LabelingStage | None = None,
    step: int | None = None,
) -> tuple[RolloutBatch, dict[str, float]]:
    """The labeled samples of ``rows`` and, for episodes, their ``env/*`` metrics (each a mean
    per episode over the chunks that reported it); ``step`` reaches the labelers with each
    request."""
    parts = []
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}  # the episodes of the chunks that reported each key
    for start in range(0, len(rows), EVAL_CHUNK):
        prompts, extras = split_rows(rows[start : start + EVAL_CHUNK])
        batch, env_metrics = hooks.rollout(prompts, extras, n, sampling)
        count = env_metrics.get("env/episodes", 0.0)
        for key, value in env_metrics.items():
            if key != "env/episodes":
                totals[key] = totals.get(key, 0.0) + value * count
                weights[key] = weights.get(key, 0.0) + count
        # raw values, state untouched
        report = label(hooks, batch, labeling, normalize=False, step=step)
        # A response no labeler of the chain could value is left out of the evaluation.
        parts.append(batch if len(report.keep) == batch.size else batch.select(report.keep))
    means = {key: total / weights[key] for key, total in totals.items() if weights[key]}
    return RolloutBatch.concat(parts), means


def evaluate(
    hooks: Hooks,
    rows: list[dict[str, Any]],
    max_new_tokens: int,
    pass_at_k: int | None = None,
    sampling: SamplingParams | None = None,
    labeling: LabelingStage | None = None,
    step: int | None = None,
) -> dict[str, float]:
    """Evaluate the backend's current weights on ``rows``; returns ``eval/*`` metrics.

    ``labeling``: the stage that labels the responses (``evaluation.labeler``); default the
    arm's own labeling. ``step``: the training step evaluated (the optimizer's steps so far),
    given to labelers with each request as in training (TRL's reward functions get it)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    batch, env_metrics = _sample(hooks, rows, 1, greedy, labeling, step)
    env = {f"eval/{key}": value for key, value in env_metrics.items()}
    if batch.size == 0:  # nothing to score (every episode failed, no label): said, not guessed
        return {"eval/labeled_frac": 0.0, **env}
    assert batch.scores is not None
    # A labeler that rescales its scores per call (normalize: true) keeps the value it rescaled
    # in info["raw"]; evaluation reports that, so eval/score stays comparable across steps.
    raw = [info.get("raw") for info in batch.label_info] if batch.label_info else []
    if raw and all(isinstance(r, (int, float)) for r in raw):
        out = {canonical.EVAL_SCORE: float(sum(raw) / len(raw))}
    else:
        out = {canonical.EVAL_SCORE: float(batch.scores.mean())}
    correct = correct_flags(batch)
    if correct is not None:
        out[canonical.EVAL_EXACT_MATCH] = sum(correct) / len(correct)
    out[canonical.EVAL_RESPONSE_LENGTH] = float(batch.response_mask.sum(dim=1).mean())
    out["eval/labeled_frac"] = batch.size / len(rows) if rows else 0.0
    out.update(env)
    if pass_at_k:
        params = (sampling or SamplingParams()).model_copy(
            update={"max_new_tokens": max_new_tokens}
        )
        if params.temperature == 0:
            params = params.model_copy(update={"temperature": 1.0})
        sampled, _ = _sample(hooks, rows, pass_at_k, params, labeling, step)
        hits = correct_flags(sampled)
        if hits is None:  # the labeler does not say what is correct: a score above 0 passes
            assert sampled.scores is not None
            hits = [bool(s > 0) for s in sampled.scores.tolist()]
        passed: dict[str, bool] = {}
        for prompt, hit in zip(sampled.prompts, hits, strict=True):
            passed[prompt] = passed.get(prompt, False) or hit
        per_prompt = list(passed.values())
        out[f"eval/pass@{pass_at_k}"] = sum(per_prompt) / len(per_prompt)
    return out
