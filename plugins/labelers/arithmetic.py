"""Rule labeler for the embedded arithmetic task: exact match on the extracted number.

Every score says whether the answer is right in ``info["correct"]``, so the engine reports
``eval/exact_match`` and online KTO counts correct samples as desirable.

Pure Python (no torch): the response's first line must be an integer (see
:func:`alignzoo.world.task.extract_answer`); it is compared with the reference answer found in
``request.extra[answer_field]`` (the ``answer`` column of the data).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.errors import UserError
from alignzoo.plugin import Labeler, hookimpl
from alignzoo.types import LabelRequest, Score
from alignzoo.world.task import extract_answer


class ArithmeticLabeler(Labeler):
    """Exact-match reward for arithmetic answers (1 right, partial credit wrong, 0 malformed)."""

    marks_correct = True

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        partial_credit: float = Field(
            0.0,
            ge=0.0,
            le=1.0,
            description="Score of a well-formed but wrong number (malformed output scores 0).",
        )
        answer_field: str = Field(
            "answer", description="Column of the data (LabelRequest.extra) holding the answer."
        )

    params: Params

    def score(self, request: LabelRequest) -> Score:
        """1.0 for the right number, ``partial_credit`` for a wrong one, 0.0 (invalid) if malformed."""
        field = self.params.answer_field
        if field not in request.extra:
            found = ", ".join(sorted(request.extra)) or "none"
            raise UserError(
                f"arithmetic labeler: the data has no {field!r} column to check answers against "
                f"(extra columns found: {found}); set labeler.params.answer_field"
            )
        expected = extract_answer(str(request.extra[field]))
        if expected is None:
            raise UserError(
                f"arithmetic labeler: reference {field!r} = {request.extra[field]!r} "
                f"for prompt {request.prompt!r} is not an integer"
            )
        got = extract_answer(request.response)
        if got is None:
            return Score(0.0, valid=False, info={"malformed": True, "correct": False})
        if got == expected:
            return Score(1.0, info={"extracted": got, "correct": True})
        return Score(self.params.partial_credit, info={"extracted": got, "correct": False})

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        """Score each request in order (rules are cheap: no batching needed)."""
        return [self.score(request) for request in requests]
