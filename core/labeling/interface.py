"""The labeler's side of labeling: what a labeler is asked and what it must answer.

A labeler (any plugin implementing the ``score_batch`` hook of :mod:`alignzoo.hookspecs`) gets
a list of :class:`LabelRequest` and returns one :class:`Score` per request, whose
:class:`Outcome` says what became of the label. :func:`check_scores` is the one place that
decides whether an answer is usable; :func:`start_labeler` runs a labeler's ``on_run_start``
outside a training run (a server, a worker process, ``alignzoo relabel``).

Layers of :mod:`alignzoo.labeling`: this interface; :mod:`~alignzoo.labeling.orchestrator`
(batches, timeouts, retries, fallbacks, through :mod:`~alignzoo.labeling.callers`); and
:mod:`~alignzoo.labeling.store` (labels kept across steps and restarts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# The labeler's records are part of the plugin contract, at the package root.
from alignzoo.types import LabelRequest as LabelRequest
from alignzoo.types import Outcome as Outcome
from alignzoo.types import Score as Score
from alignzoo.types import StepScore as StepScore


class StandaloneRun:
    """What a labeler's ``on_run_start`` gets outside a training run (a labeler server, a
    worker process, ``alignzoo relabel``): every role on ``device``, no folder, no console."""

    def __init__(self, name: str = "labeler", device: str = "cpu") -> None:
        self.name, self._device = name, device
        self.out_dir = None
        self.console = None
        self.state: dict[str, Any] = {}
        self.step = 0

    def device(self, role: str) -> str:
        return self._device


def start_labeler(pm: Any, run: Any = None) -> None:
    """Call the labeler's ``on_run_start`` (a reward model loads its weights there)."""
    pm.hook.on_run_start(run=run if run is not None else StandaloneRun())


def check_scores(scores: Any, n: int, responses: Sequence[str] | None = None) -> list[Score] | str:
    """One Score per request: what the labeler returned where usable, a ``rejected`` Score
    (with the reason) for an item that is not a Score, whose value is not a finite number or
    whose steps are unusable (:func:`step_problem`; with ``responses``, the requests' response
    texts, a span must also lie within its response); or the reason the whole answer is
    rejected (not a list, the wrong count). A value's ``info["rewards"]`` must pass
    :func:`rewards_problem`."""
    if not isinstance(scores, (list, tuple)):
        return f"returned {type(scores).__name__}, not a list of Score"
    if len(scores) != n:
        return f"returned {len(scores)} scores for {n} responses"
    out = []
    for i, s in enumerate(scores):
        problem = None
        if not isinstance(s, Score):
            problem = f"returned {type(s).__name__} for response {i}, not a Score"
        elif s.outcome == Outcome.VALUE:
            try:
                value = float(s.value)
            except (TypeError, ValueError):
                problem = f"returned Score(value={s.value!r}) for response {i}; expected a number"
            else:
                if not math.isfinite(value):
                    problem = f"returned a non-finite score ({value}) for response {i}"
            if problem is None and s.steps:
                length = len(responses[i]) if responses is not None else None
                found = step_problem(s.steps, length)
                if found is not None:
                    problem = f"returned {found} for response {i}"
            if problem is None and isinstance(s.info, dict) and "rewards" in s.info:
                found = rewards_problem(s.info["rewards"])
                if found is not None:
                    problem = f"returned {found} for response {i}"
        if problem is None:
            out.append(s)
        else:
            out.append(
                Score(math.nan, False, {"reason": f"the labeler {problem}"}, Outcome.REJECTED)
            )
    return out


def step_problem(steps: Any, length: int | None = None) -> str | None:
    """What makes a Score's ``steps`` unusable, or None: not a list of :class:`StepScore`, a
    span that is not integers ``0 <= start < end`` (``end <= length``, the response's length in
    characters, when given), or a score that is not a finite number."""
    if not isinstance(steps, (list, tuple)):
        return f"steps of type {type(steps).__name__}, not a list of StepScore"
    for k, step in enumerate(steps):
        if not isinstance(step, StepScore):
            return f"step {k} of type {type(step).__name__}, not a StepScore"
        start, end = step.start, step.end
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
            return f"step {k} with span [{start!r}, {end!r}); expected integers 0 <= start < end"
        if length is not None and end > length:
            return f"step {k} with span [{start}, {end}) past the response's {length} characters"
        try:
            score = float(step.score)
        except (TypeError, ValueError):
            return f"step {k} with score {step.score!r}; expected a number"
        if not math.isfinite(score):
            return f"step {k} with a non-finite score ({score})"
    return None


def rewards_problem(rewards: Any) -> str | None:
    """What makes a Score's ``info["rewards"]`` unusable, or None: not a dict of name ->
    number or None, a value ``float()`` does not take (a bool, a numpy or a one-element torch
    number are taken), or one that is infinite (None and NaN say the reward does not apply to
    the sample)."""
    if not isinstance(rewards, dict):
        return f"info['rewards'] of type {type(rewards).__name__}, not a dict of name -> number"
    for name, value in rewards.items():
        if not isinstance(name, str):
            return f"info['rewards'] with the name {name!r}; expected a string"
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            return f"info['rewards'][{name!r}] = {value!r}; expected a number or None"
        if math.isinf(number):
            return f"info['rewards'][{name!r}] = {value}; expected a finite number or None"
    return None


def reward_table(scores: Sequence[Score]) -> tuple[tuple[str, ...], list[list[float]]]:
    """The separate rewards the valued ``scores`` report (``info["rewards"]``): their names,
    in the order first seen, and one row per score, NaN where a reward is None or missing
    (and everywhere in a score that is not a value). No names and no rows when no score
    reports any."""
    reported = [
        s.info["rewards"]
        for s in scores
        if s.outcome == Outcome.VALUE and isinstance(s.info.get("rewards"), dict)
    ]
    names = tuple(dict.fromkeys(str(name) for rewards in reported for name in rewards))
    if not names:
        return (), []
    rows = []
    for s in scores:
        rewards = s.info.get("rewards") if s.outcome == Outcome.VALUE else None
        rewards = rewards if isinstance(rewards, dict) else {}
        rows.append([_number(rewards.get(name)) for name in names])
    return names, rows


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)
