"""Rule labelers: regex match, format check and length penalty. Cheap, deterministic, no model.

Each reads only the response (and, for ``regex`` with ``answer_field``, the reference column).
Combine them with a correctness labeler through ``combine`` (e.g. arithmetic + format).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from alignzoo import Labeler, LabelRequest, Score


def _compiled(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression ({exc})") from None
    return pattern


class RegexLabeler(Labeler):
    """``match`` when the response matches ``pattern`` (search, or fullmatch), else ``miss``.

    With ``answer_field``, ``{answer}`` in the pattern is replaced by the (escaped) reference
    of that column, and the verdict is also ``info["correct"]``.
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        pattern: str = Field(description="A Python regular expression.")
        fullmatch: bool = Field(False, description="The whole response (stripped) must match.")
        match: float = Field(1.0, description="Score when the response matches.")
        miss: float = Field(0.0, description="Score when it does not.")
        answer_field: str | None = Field(
            None, description="Column whose value replaces {answer} in the pattern."
        )

        _check = field_validator("pattern")(classmethod(lambda cls, v: _compiled(v)))

    params: Params

    def score(self, request: LabelRequest) -> Score:
        pattern = self.params.pattern
        info: dict[str, Any] = {}
        if self.params.answer_field is not None:
            if self.params.answer_field not in request.extra:
                return Score.abstain(f"no {self.params.answer_field!r} column")
            pattern = pattern.replace(
                "{answer}", re.escape(str(request.extra[self.params.answer_field]))
            )
        text = request.response.strip() if self.params.fullmatch else request.response
        hit = (re.fullmatch if self.params.fullmatch else re.search)(pattern, text) is not None
        if self.params.answer_field is not None:
            info["correct"] = hit
        return Score(self.params.match if hit else self.params.miss, info=info)


class FormatLabeler(Labeler):
    """1.0 when the response has the required format (a regex fullmatch on the stripped
    response), else 0.0, with ``info["format_ok"]``: the check a reward-hacking detector and a
    ``combine`` with a correctness labeler use."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        pattern: str = Field(r"[+-]?\d+", description="The format, as a regex fullmatch.")
        ok: float = Field(1.0, description="Score when the response has the format.")
        bad: float = Field(0.0, description="Score when it does not.")

        _check = field_validator("pattern")(classmethod(lambda cls, v: _compiled(v)))

    params: Params

    def score(self, request: LabelRequest) -> Score:
        ok = re.fullmatch(self.params.pattern, request.response.strip()) is not None
        return Score(self.params.ok if ok else self.params.bad, info={"format_ok": ok})


class LengthPenaltyLabeler(Labeler):
    """``-coef * max(0, characters - max_chars)``: 0 up to ``max_chars``, linearly negative
    beyond (characters of the stripped response)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        max_chars: int = Field(
            200, ge=0, description="Characters allowed before the penalty starts."
        )
        coef: float = Field(0.01, ge=0, description="Penalty per character over max_chars.")

    params: Params

    def score(self, request: LabelRequest) -> Score:
        over = max(0, len(request.response.strip()) - self.params.max_chars)
        return Score(-self.params.coef * over, info={"chars_over": over})
