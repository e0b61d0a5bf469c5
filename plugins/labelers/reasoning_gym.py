"""Labeler "reasoning_gym": a response scored by its reasoning-gym task's own scorer.

For rows from a ``{reasoning_gym: {...}}`` data source (which carry their spec and entry
index): the answer is read from the response (``extract``: reasoning-gym's
``<answer>...</answer>`` convention, the first line, or the whole text) and scored with the
generating dataset's own ``score_answer(answer, entry)``, with the task's config, also inside a
composite (each entry's own task).

All or nothing by default: some scorers give partial credit (chain_sum gives 0.86 of a point
to a wrong answer that contains the right one), which a policy can learn to farm; the value is then 1.0
for a full score and 0.0 otherwise, and ``partial_credit: true`` keeps the scorer's value.
Either way ``info["correct"]`` is a full score and ``info["task_score"]`` the scorer's value.
Needs the ``reasoning-gym`` extra.
"""

from __future__ import annotations

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
        source = request.extra.get(rg.SOURCE_COLUMN)
        index = request.extra.get(rg.INDEX_COLUMN)
        if not isinstance(source, str) or isinstance(index, bool) or not isinstance(index, int):
            raise UserError(
                f"reasoning_gym labeler: the row has no {rg.SOURCE_COLUMN!r} / {rg.INDEX_COLUMN!r} "
                "columns; use it with data from {reasoning_gym: {...}}"
            )
        answer = self._extract(request.response)
        value = rg.score(source, index, answer)
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
