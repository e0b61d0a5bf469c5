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
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class LabelRequest:
    """One thing to score: the prompt, the response and any extra dataset columns.

    In a run two more fields are set (None outside one: relabel, a served labeler):
    ``completion_ids``, the token ids the policy sampled for the response (what TRL passes as
    ``completion_ids``), and ``step``, the training step the sample is for (in evaluation, the
    step evaluated: 0 before training). Neither is part of the request's identity: the label store keys on prompt, response
    and extra only.
    """

    prompt: str
    response: str
    extra: dict[str, Any] = field(default_factory=dict)
    completion_ids: list[int] | None = None
    step: int | None = None


class Outcome(str, Enum):
    """What became of one sample's label.

    ``value``: a number to train on (malformed *model output* is a value too, e.g. 0 with
    ``info["malformed"]``). ``abstain``: the labeler declines (no answer key, out of scope).
    ``timeout``: the call did not answer in time (its worker was killed). ``error``: the
    infrastructure failed (connection, 5xx, a crashed worker, an exception in the labeler).
    ``parse_failure``: the labeler's own answer was unreadable (a judge's reply). ``rejected``:
    the labeler answered something unusable (NaN, inf, the wrong count or type).
    Each arm's ``labeling.on`` says what to do with each (see
    :class:`alignzoo.config.schema.LabelingConfig`).
    """

    VALUE = "value"
    ABSTAIN = "abstain"
    TIMEOUT = "timeout"
    ERROR = "error"
    PARSE_FAILURE = "parse_failure"
    REJECTED = "rejected"


@dataclass
class Score:
    """A labeler's verdict on one response.

    ``outcome`` is :attr:`Outcome.VALUE` for a real score; a labeler that declines returns
    ``Score.abstain(reason)``, one that cannot read its own answer ``Score.parse_failure(reason)``
    (a labeler may also raise :class:`alignzoo.errors.LabelerUnavailable` for an infrastructure
    failure). ``valid`` is False for a value the labeler judged without confidence (kept for
    the ``reward/valid_frac`` metric; it is trained on). ``info`` carries anything worth logging
    (extracted answer, raw model score, latency). Two keys have a meaning for the engine:

    - ``info["correct"]`` (bool): the labeler knows the right answer and says whether the
      response has it. When every score of an evaluation carries it, the engine reports
      ``eval/exact_match`` (and ``eval/pass@k`` uses it); online unpaired data (KTO) counts a
      correct sample as desirable.
    - ``info["raw"]`` (number): the unscaled value of a labeler that rescales its scores per
      batch; evaluation reports it as ``eval/score`` so the metric means the same at every step.
    """

    value: float
    valid: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    outcome: Outcome = Outcome.VALUE

    @classmethod
    def abstain(cls, reason: str = "") -> Score:
        """The labeler declines to label this sample (not a zero)."""
        return cls(math.nan, False, {"reason": reason} if reason else {}, Outcome.ABSTAIN)

    @classmethod
    def parse_failure(cls, reason: str = "") -> Score:
        """The labeler could not read its own answer (e.g. a judge's reply without a score)."""
        return cls(math.nan, False, {"reason": reason} if reason else {}, Outcome.PARSE_FAILURE)


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


def check_scores(scores: Any, n: int) -> list[Score] | str:
    """One Score per request: what the labeler returned where usable, a ``rejected`` Score
    (with the reason) for an item that is not a Score or whose value is not a finite number;
    or the reason the whole answer is rejected (not a list, the wrong count)."""
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
        if problem is None:
            out.append(s)
        else:
            out.append(
                Score(math.nan, False, {"reason": f"the labeler {problem}"}, Outcome.REJECTED)
            )
    return out
