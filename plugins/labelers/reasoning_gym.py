"""Labeler "reasoning_gym": a response scored by its reasoning-gym task's own scorer.

For rows from a ``{reasoning_gym: {...}}`` data source (which carry the task's name and the
whole entry): the answer is read from the response (``extract``: reasoning-gym's
``<answer>...</answer>`` convention, the first line, or the whole text) and scored with the
task's ``score_answer(answer, entry)``, also inside a composite (each entry's own task).

All or nothing by default: some scorers give partial credit (chain_sum gives 0.125 for a wrong
answer that contains the right one), which a policy can learn to farm; the value is then 1.0
for a full score and 0.0 otherwise, and ``partial_credit: true`` keeps the scorer's value.
Either way ``info["correct"]`` is a full score and ``info["task_score"]`` the scorer's value.
Needs the ``reasoning-gym`` extra.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.errors import UserError
from alignzoo.integrations import reasoning_gym as rg
from alignzoo.plugin import Labeler
from alignzoo.types import LabelRequest, Score


class ReasoningGymLabeler(Labeler):
    """A reasoning-gym task's own scorer (all or nothing unless partial_credit)."""

    marks_correct = True

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        extract: Literal["answer_tag", "first_line", "full"] = Field(
            "answer_tag",
            description="How the answer is read from the response: the last <tag>...</tag> "
            "(reasoning-gym's convention), its first line, or the whole text (stripped).",
        )
        tag: str = Field("answer", description="The tag of extract: answer_tag.")
        partial_credit: bool = Field(
            False, description="Keep the scorer's partial credit instead of all or nothing."
        )

    params: Params

    def score(self, request: LabelRequest) -> Score:
        task = request.extra.get(rg.TASK_COLUMN)
        entry = request.extra.get(rg.ENTRY_COLUMN)
        if not isinstance(task, str) or not isinstance(entry, str):
            raise UserError(
                f"reasoning_gym labeler: the row has no {rg.TASK_COLUMN!r} / {rg.ENTRY_COLUMN!r} "
                "columns; use it with data from {reasoning_gym: {...}}"
            )
        answer = self._extract(request.response)
        value = float(rg.scorer(task)(answer, json.loads(entry)))
        correct = value >= 1.0
        scored = value if self.params.partial_credit else float(correct)
        return Score(scored, info={"correct": correct, "task_score": value, "extracted": answer})

    def _extract(self, response: str) -> str | None:
        if self.params.extract == "answer_tag":
            return rg.extract_answer_tag(response, self.params.tag)
        if self.params.extract == "first_line":
            lines = response.strip().splitlines()
            return lines[0].strip() if lines else None
        return response.strip()
