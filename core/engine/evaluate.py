"""Held-out evaluation: greedy decoding on the first ``evaluation.num_prompts`` eval prompts.

Run at step 0, every ``evaluation.every`` steps and at the end, identically for every arm.
Metrics (:mod:`alignzoo.metrics`): ``eval/score`` (the labeler's mean score, unscaled),
``eval/exact_match`` (the fraction the labeler marks correct, when it says so for every
response: ``Score.info["correct"]``), ``eval/response_length`` and, when
``evaluation.pass_at_k`` is set, ``eval/pass@k``: the unbiased estimator of Chen et al. 2021
(:func:`pass_at_k_estimate`) on ``evaluation.pass_at_k_samples`` (n >= k, default k) sampled
responses of each evaluation row, averaged over the rows. A response passes when the labeler
marks it correct, or scores it above 0 for a labeler that does not say what is correct. Every
per-prompt figure is per evaluation *row*: a prompt that appears in two rows counts twice,
each time with its own samples (as exact match counts it twice), never pooled by its text.
A response that no labeler of the arm's chain could give a value is left out of these (a
row with fewer than k labeled samples is left out of pass@k), and
``eval/labeled_frac`` says which share of the greedy responses was labeled (when none was,
it is the only score reported). An arm with an
environment evaluates by greedy episodes and adds their ``env/*`` metrics as ``eval/env/*``
(``eval/env/tool_calls``: the held-out tool-call rate, per episode).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.modes import correct_flags, split_rows
from alignzoo.errors import UserError
from alignzoo.labeling import LabelingStage, label
from alignzoo.types import SamplingParams

if TYPE_CHECKING:
    from alignzoo.engine.hooks import Hooks
    from alignzoo.rollout.multiturn import Episodes

EVAL_CHUNK = 128


def eval_rows(dataset: Any, num_prompts: int | None) -> list[dict[str, Any]]:
    """The first ``num_prompts`` rows of the eval split (all when None), as dicts."""
    n = len(dataset) if num_prompts is None else min(num_prompts, len(dataset))
    columns = dataset.select(range(n)).to_dict()
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    """The probability that k of a row's ``n`` samples, ``c`` of them correct, drawn without
    replacement, hold a correct one (Chen et al. 2021, eq. 1, for one problem; ``n >= k``)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # 1 - C(n-c, k) / C(n, k)


def _sample(
    hooks: Hooks,
    rows: list[dict[str, Any]],
    n: int,
    sampling: SamplingParams,
    labeling: LabelingStage | None = None,
    step: int | None = None,
    episodes: Episodes | None = None,
) -> tuple[RolloutBatch, dict[str, float], list[int]]:
    """The labeled samples of ``rows``, for episodes their ``env/*`` metrics (each a mean per
    episode over the chunks that reported it), and per sample a key of the row it answers
    (the samples of one row share it, two rows never do, even with the same prompt text);
    ``step`` reaches the labelers with each request."""
    parts = []
    keys: list[int] = []
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}  # the episodes of the chunks that reported each key
    for start in range(0, len(rows), EVAL_CHUNK):
        prompts, extras = split_rows(rows[start : start + EVAL_CHUNK])
        batch, env_metrics = hooks.rollout(prompts, extras, n, sampling, episodes=episodes)
        count = env_metrics.get("env/episodes", 0.0)
        for key, value in env_metrics.items():
            if key != "env/episodes":
                totals[key] = totals.get(key, 0.0) + value * count
                weights[key] = weights.get(key, 0.0) + count
        # raw values, state untouched
        report = label(hooks, batch, labeling, normalize=False, step=step)
        # A response no labeler of the chain could value is left out of the evaluation.
        kept = batch if len(report.keep) == batch.size else batch.select(report.keep)
        parts.append(kept)
        # One rollout call groups the samples of each of its rows under one id (ids below
        # the chunk's size): offset by the chunk's start, a key per row of the evaluation.
        keys += [start + int(g) for g in kept.group_ids.tolist()]
    means = {key: total / weights[key] for key, total in totals.items() if weights[key]}
    return RolloutBatch.concat(parts), means, keys


def _pass_at_k(keys: list[int], hits: list[bool], k: int) -> float | None:
    """pass@k averaged over the evaluation rows (Chen et al. 2021, eq. 1), each row on its
    own samples; a row with fewer than k labeled samples is left out (None when none is left)."""
    counts: dict[int, list[int]] = {}  # row key -> [samples n, correct c]
    for key, hit in zip(keys, hits, strict=True):
        tally = counts.setdefault(key, [0, 0])
        tally[0] += 1
        tally[1] += int(hit)
    per_row = [pass_at_k_estimate(n, c, k) for n, c in counts.values() if n >= k]
    return sum(per_row) / len(per_row) if per_row else None  # E_rows[1 - C(n-c,k)/C(n,k)]


def evaluate(
    hooks: Hooks,
    rows: list[dict[str, Any]],
    max_new_tokens: int,
    pass_at_k: int | None = None,
    sampling: SamplingParams | None = None,
    labeling: LabelingStage | None = None,
    step: int | None = None,
    pass_at_k_samples: int | None = None,
    episodes: Episodes | None = None,
) -> dict[str, float]:
    """Evaluate the backend's current weights on ``rows``; returns ``eval/*`` metrics.

    ``labeling``: the stage that labels the responses (``evaluation.labeler``, else the arm's
    own; without one, a plain stage over ``hooks``). ``episodes``: the arm's episode runner,
    for an arm with an environment. ``step``: the training step evaluated (the optimizer's steps so far),
    given to labelers with each request as in training (TRL's reward functions get it).
    ``pass_at_k_samples``: the responses sampled per row for ``pass_at_k`` (n >= k; default k)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    batch, env_metrics, _ = _sample(hooks, rows, 1, greedy, labeling, step, episodes)
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
        n = pass_at_k_samples or pass_at_k
        if n < pass_at_k:
            raise UserError(
                f"evaluation.pass_at_k_samples: {n} samples per row cannot estimate "
                f"pass@{pass_at_k}; give at least {pass_at_k}"
            )
        sampled, _, keys = _sample(hooks, rows, n, params, labeling, step, episodes)
        hits = correct_flags(sampled)
        if hits is None:  # the labeler does not say what is correct: a score above 0 passes
            assert sampled.scores is not None
            hits = [bool(s > 0) for s in sampled.scores.tolist()]
        value = _pass_at_k(keys, hits, pass_at_k)
        if value is not None:
            out[f"eval/pass@{pass_at_k}"] = value
    return out
