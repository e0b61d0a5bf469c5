"""The labeler service's wire format, protocol version 1 (JSON over HTTP): the one definition
the server (:mod:`alignzoo.labeling.service`) and its client (the ``http`` labeler) share.

- ``POST /v1/score``: a :class:`ScoreRequest` body ``{"version": 1, "requests": [{"prompt",
  "response", "extra"}, ...]}``, answered ``{"version": 1, "labeler": <identity>, "scores":
  [...]}`` with one :func:`score_to_json` object per request, in order.
- ``GET /health``: ``{"status": "ok", "labeler": <identity>, "version": 1}``.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.labeling.interface import LabelRequest, Outcome, Score

PROTOCOL_VERSION = 1


class RequestItem(BaseModel):
    """One request on the wire: a :class:`~alignzoo.labeling.interface.LabelRequest`."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    response: str
    extra: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    """The body of ``POST /v1/score``."""

    model_config = ConfigDict(extra="forbid")

    version: int = PROTOCOL_VERSION
    requests: list[RequestItem]


def request_body(requests: list[LabelRequest]) -> dict[str, Any]:
    """The JSON body of ``POST /v1/score`` for ``requests``."""
    return {
        "version": PROTOCOL_VERSION,
        "requests": [
            {"prompt": r.prompt, "response": r.response, "extra": r.extra} for r in requests
        ],
    }


def score_to_json(score: Score) -> dict[str, Any]:
    """One score on the wire (a value only for a ``value`` outcome; JSON has no NaN)."""
    value = float(score.value) if score.outcome == Outcome.VALUE else None
    if value is not None and not math.isfinite(value):
        value = None  # JSON has no NaN; the client sees a value-less 'value' outcome: rejected
    return {
        "value": value,
        "valid": bool(score.valid),
        "outcome": score.outcome.value,
        "info": score.info,
    }


def score_from_json(item: Any) -> Any:
    """The :class:`Score` a wire object stands for; anything that is not an object is returned
    as it is, for the labeling stage to reject. An unknown outcome reads as ``value``, and a
    null value of a ``value`` outcome as NaN (rejected by the stage)."""
    if not isinstance(item, dict):
        return item
    known = {o.value for o in Outcome}
    outcome = Outcome(item["outcome"]) if item.get("outcome") in known else Outcome.VALUE
    info = dict(item.get("info") or {})
    if outcome != Outcome.VALUE:
        return Score(math.nan, False, info, outcome)
    value = item.get("value")
    return Score(math.nan if value is None else value, bool(item.get("valid", True)), info)
