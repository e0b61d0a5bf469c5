"""Labeler "verifiers": a response scored by its verifiers task's own rewards.

For rows from a ``{verifiers: {...}}`` data source (which carry their spec, index and task key):
the prompt and the response (an episode's whole transcript, when the arm ran episodes) become a
verifiers ``Trace`` and the task scores it with its ``@vf.reward`` functions, in process, as
``Task.score`` does; the value is the trace's reward (the rewards' weighted sum). ``info``
holds each reward (``rewards``) and ``@vf.metric`` (``metrics``) by name, and ``correct`` when
``correct_at`` is set (a reward at or above it is a correct answer, for ``eval/exact_match``).

A taskset whose scoring needs a runtime (a container, a sandbox) or a judge (a model endpoint)
is refused when its data is opened. Needs the ``verifiers`` extra
(:mod:`alignzoo.integrations.verifiers`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.errors import UserError
from alignzoo.integrations import verifiers as vfi
from alignzoo.plugin import Labeler
from alignzoo.types import LabelRequest, Score


class VerifiersLabeler(Labeler):
    """A verifiers task's own rewards, run in process (their weighted sum)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        correct_at: float | None = Field(
            None,
            description="A reward at or above this is a correct answer (info['correct'], "
            "for eval/exact_match); unset: the labeler does not say.",
        )

    params: Params

    def score(self, request: LabelRequest) -> Score:
        source = request.extra.get(vfi.SOURCE_COLUMN)
        index = request.extra.get(vfi.INDEX_COLUMN)
        if not isinstance(source, str) or isinstance(index, bool) or not isinstance(index, int):
            raise UserError(
                f"verifiers labeler: the row has no {vfi.SOURCE_COLUMN!r} / {vfi.INDEX_COLUMN!r} "
                "columns; use it with data from {verifiers: {...}}"
            )
        task = vfi.task_for(source, index, request.extra.get(vfi.KEY_COLUMN))
        value, info = vfi.score(task, self._messages(request))
        if self.params.correct_at is not None:
            info["correct"] = value >= self.params.correct_at
        return Score(value, info=info)

    @staticmethod
    def _messages(request: LabelRequest) -> list[dict[str, Any]]:
        transcript = request.extra.get("messages")
        if isinstance(transcript, list) and transcript:  # an episode: every turn as it went
            return [dict(m) for m in transcript if isinstance(m, dict)]
        prompt = request.extra.get("prompt_messages")
        opening = (
            [dict(m) for m in prompt]
            if isinstance(prompt, list)
            else [{"role": "user", "content": request.prompt}]
        )
        return [*opening, {"role": "assistant", "content": request.response}]
