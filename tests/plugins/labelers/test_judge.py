"""The judge labeler against a local stub of an OpenAI-compatible chat endpoint."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from alignzoo import LabelRequest
from alignzoo.errors import LabelerUnavailable
from alignzoo.plugins.labelers.judge import JudgeLabeler, RateLimiter
from alignzoo.types import Outcome
from tests.core.labeling.test_labeler_server import running

SEEN: list[dict] = []


async def chat(request: Request) -> JSONResponse:
    body = await request.json()
    SEEN.append(body)
    text = body["messages"][-1]["content"]
    if "busy" in text:
        return JSONResponse({"error": "rate"}, status_code=429, headers={"Retry-After": "3"})
    content = (
        "I cannot say." if "mumble" in text else ("Score: 9" if "A: 42 " in text else "Score: 2")
    )
    return JSONResponse({"choices": [{"message": {"role": "assistant", "content": content}}],
                         "usage": {"total_tokens": 50}})  # fmt: skip


def judge(url: str, **params) -> JudgeLabeler:
    return JudgeLabeler(
        JudgeLabeler.Params(base_url=url, model="stub", system="Be strict.", **params)
    )


def test_the_judge_scores_parses_and_normalises() -> None:
    SEEN.clear()
    with running(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])) as url:
        labeler = judge(url, template="Q: {prompt} A: {response} (key {answer})")
        good = labeler.score(LabelRequest("6*7=", "42", {"answer": "42"}))
        bad = labeler.score(LabelRequest("6*7=", "41", {"answer": "42"}))
        vague = labeler.score(LabelRequest("6*7=", "mumble", {"answer": "42"}))
        with pytest.raises(LabelerUnavailable) as caught:
            labeler.score(LabelRequest("6*7=", "busy", {"answer": "42"}))
        labeler.close()
    assert good.value == pytest.approx(8 / 9) and bad.value == pytest.approx(1 / 9)
    assert good.info["judge_score"] == 9.0
    assert vague.outcome == Outcome.PARSE_FAILURE
    assert caught.value.retry_after == 3.0
    assert SEEN[0]["messages"][0] == {"role": "system", "content": "Be strict."}
    assert SEEN[0]["messages"][1]["content"] == "Q: 6*7= A: 42 (key 42)"
    assert SEEN[0]["temperature"] == 0.0 and SEEN[0]["model"] == "stub"


def test_rate_limits_space_the_requests() -> None:
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    limiter = RateLimiter(rpm=2, tpm=100, clock=lambda: now[0], sleep=sleep)
    limiter.wait(10)
    limiter.wait(10)
    assert sleeps == []
    limiter.wait(10)  # a third request within the minute waits for the first to age out
    assert sleeps and now[0] >= 60
    limiter = RateLimiter(rpm=None, tpm=100, clock=lambda: now[0], sleep=sleep)
    limiter.wait(80)
    before = now[0]
    limiter.wait(30)  # 110 tokens would exceed 100 within the minute
    assert now[0] - before >= 59


def test_template_and_pattern_errors() -> None:
    with pytest.raises(ValueError, match="exactly one group"):
        JudgeLabeler.Params(base_url="http://x", model="m", score_pattern=r"\d+")
