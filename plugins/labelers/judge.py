"""Labeler "judge": an LLM judge behind an OpenAI-compatible chat endpoint (a vLLM server,
any hosted API speaking ``POST /v1/chat/completions``).

For each response, ``template`` is filled with ``{prompt}``, ``{response}`` and the sample's
columns (``{answer}``, ...) and sent as the user message (after ``system``, if given), at
temperature 0. ``score_pattern`` (a regex with one group) reads the number from the reply;
``scale: [low, high]`` maps it to [0, 1]. A reply without a number is a ``parse_failure``
(retried by default, then the next labeler). Requests are spaced to stay under
``requests_per_minute`` and ``tokens_per_minute`` (tokens as the endpoint reports them in
``usage``, estimated at 4 characters a token until it does); HTTP 429 and 503 raise
:class:`~alignzoo.errors.LabelerUnavailable` with the server's ``Retry-After``.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.errors import LabelerTimeout, LabelerUnavailable, UserError

DEFAULT_TEMPLATE = (
    "Rate the answer to the question on a scale from 1 to 10.\n\n"
    "Question: {prompt}\nAnswer: {response}\n\nReply with 'Score: <number>'."
)


class RateLimiter:
    """Sliding one-minute windows of requests and tokens; ``wait`` sleeps until both allow."""

    def __init__(
        self, rpm: int | None, tpm: int | None, clock: Any = time.monotonic, sleep: Any = time.sleep
    ) -> None:
        self.rpm, self.tpm, self.clock, self.sleep = rpm, tpm, clock, sleep
        self.requests: deque[float] = deque()
        self.tokens: deque[tuple[float, int]] = deque()
        self.lock = threading.Lock()
        self.waited = 0.0

    def _trim(self, now: float) -> None:
        while self.requests and now - self.requests[0] >= 60:
            self.requests.popleft()
        while self.tokens and now - self.tokens[0][0] >= 60:
            self.tokens.popleft()

    def wait(self, tokens: int) -> None:
        with self.lock:
            while True:
                now = self.clock()
                self._trim(now)
                used = sum(n for _, n in self.tokens)
                ok_r = self.rpm is None or len(self.requests) < self.rpm
                ok_t = self.tpm is None or used + tokens <= self.tpm or not self.tokens
                if ok_r and ok_t:
                    self.requests.append(now)
                    self.tokens.append((now, tokens))
                    return
                blocking = []
                if not ok_r:
                    blocking.append(self.requests[0])
                if not ok_t:
                    blocking.append(self.tokens[0][0])
                oldest = min(blocking)
                pause = max(0.01, 60 - (now - oldest))
                self.waited += pause
                self.sleep(pause)

    def correct(self, estimated: int, actual: int) -> None:
        """Replace the last estimate with what the endpoint reported."""
        with self.lock:
            if self.tokens:
                at, n = self.tokens[-1]
                if n == estimated:
                    self.tokens[-1] = (at, actual)


class JudgeLabeler(Labeler):
    """An LLM judge through an OpenAI-compatible chat endpoint."""

    stats_counters: ClassVar[frozenset[str]] = frozenset({"rate_limit_wait_s"})

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        base_url: str = Field(description="e.g. http://127.0.0.1:8000 (a vLLM server).")
        model: str = Field(description="The model name the endpoint serves.")
        api_key_env: str | None = Field(None, description="Environment variable of the API key.")
        system: str | None = Field(
            None, description="System message of the judge's chat request (none by default)."
        )
        template: str = Field(
            DEFAULT_TEMPLATE, description="User message: {prompt} and {response} are filled in."
        )
        score_pattern: str = Field(
            r"[Ss]core:\s*(-?\d+(?:\.\d+)?)",
            description="Regex with one group that reads the score from the judge's reply.",
        )
        scale: tuple[float, float] = Field((1.0, 10.0), description="[low, high] of the scores.")
        max_tokens: int = Field(64, ge=1, description="Longest judge reply.")
        timeout_s: float = Field(60.0, gt=0, description="Read timeout of one request.")
        requests_per_minute: int | None = Field(
            None, ge=1, description="Client-side request rate limit (none by default)."
        )
        tokens_per_minute: int | None = Field(
            None, ge=1, description="Client-side token rate limit, as the endpoint counts tokens."
        )

        @field_validator("score_pattern")
        @classmethod
        def _one_group(cls, v: str) -> str:
            try:
                if re.compile(v).groups != 1:
                    raise ValueError("score_pattern needs exactly one group (the number)")
            except re.error as exc:
                raise ValueError(f"not a valid regular expression ({exc})") from None
            return v

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._client: Any = None
        self.limiter = RateLimiter(self.params.requests_per_minute, self.params.tokens_per_minute)

    def _http(self) -> Any:
        import httpx

        if self._client is None:
            headers = {}
            if self.params.api_key_env is not None:
                key = os.environ.get(self.params.api_key_env)
                if not key:
                    raise UserError(f"judge labeler: {self.params.api_key_env} is not set")
                headers["Authorization"] = f"Bearer {key}"
            self._client = httpx.Client(
                base_url=self.params.base_url.rstrip("/"),
                headers=headers,
                timeout=self.params.timeout_s,
            )
        return self._client

    def stats(self) -> dict[str, float]:
        """Counters the labeling stage logs as ``labeler/<name>/*``: seconds waited for the
        rate limits so far."""
        return {"rate_limit_wait_s": self.limiter.waited}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        state["limiter"] = RateLimiter(
            self.params.requests_per_minute, self.params.tokens_per_minute
        )
        return state

    def message(self, request: LabelRequest) -> str:
        fields = {k: str(v) for k, v in request.extra.items()}
        try:
            return self.params.template.format(
                prompt=request.prompt, response=request.response, **fields
            )
        except KeyError as exc:
            raise UserError(
                f"judge labeler: the template names {exc}, a column the data lacks"
            ) from None

    def score(self, request: LabelRequest) -> Score:
        import httpx

        text = self.message(request)
        messages = [{"role": "system", "content": self.params.system}] if self.params.system else []
        messages.append({"role": "user", "content": text})
        estimate = (len(text) + len(self.params.system or "")) // 4 + self.params.max_tokens
        self.limiter.wait(estimate)
        body = {
            "model": self.params.model,
            "messages": messages,
            "temperature": 0.0,
            "max_tokens": self.params.max_tokens,
        }
        try:
            reply = self._http().post("/v1/chat/completions", json=body)
        except httpx.TimeoutException as exc:
            raise LabelerTimeout(f"judge: {type(exc).__name__}") from None
        except httpx.TransportError as exc:
            raise LabelerUnavailable(f"judge: {type(exc).__name__}: {exc}") from None
        if reply.status_code in (429, 503) or reply.status_code >= 500:
            after = reply.headers.get("retry-after")
            raise LabelerUnavailable(
                f"judge: HTTP {reply.status_code}",
                retry_after=float(after) if after and after.replace(".", "", 1).isdigit() else None,
            )
        if reply.status_code != 200:
            raise UserError(f"judge labeler: HTTP {reply.status_code}: {reply.text[:200]}")
        try:
            data = reply.json()
            content = data["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            return Score.parse_failure("the endpoint's reply is not a chat completion")
        usage = data.get("usage") or {}
        if isinstance(usage.get("total_tokens"), int):
            self.limiter.correct(estimate, usage["total_tokens"])
        match = re.search(self.params.score_pattern, content)
        if match is None:
            return Score.parse_failure(f"no score in the judge's reply: {content[:120]!r}")
        raw = float(match.group(1))
        low, high = self.params.scale
        value = (min(max(raw, low), high) - low) / ((high - low) or 1.0)
        return Score(value, info={"judge_score": raw, "judge": content[:500]})

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        return [self.score(r) for r in requests]
