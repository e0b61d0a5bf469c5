"""Labeler "http": the client of ``alignzoo serve-labeler`` (protocol version 1, see
:mod:`alignzoo.labeling.service`), or of any service that speaks it.

One pooled ``httpx`` client per labeler (keep-alive), requests of at most ``batch_size``
items. What comes back becomes typed outcomes for the arm's labeling policies: HTTP 429 and
503 raise :class:`~alignzoo.errors.LabelerUnavailable` with the server's ``Retry-After``; other
5xx, refused or reset connections raise it too (``error``); a read timeout raises
:class:`~alignzoo.errors.LabelerTimeout` (``timeout``); a body that is not the protocol's JSON
gives ``parse_failure`` for the call's samples; a value that is null for a ``value`` outcome
(NaN on the server) or the wrong number of scores is ``rejected`` by the stage. The outcomes
are the same when the labeler runs in a worker process (``labeling.timeout_s``).

Its failed POSTs by kind are counters (:meth:`HTTPLabeler.stats`, declared in
``stats_counters``): the stage reports each pass's increase as ``labeler/<name>/<kind>``,
from a worker process too, and exports them as ``alignzoo_labeler_stat_total{stat=<kind>}``.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.errors import LabelerTimeout, LabelerUnavailable, UserError
from alignzoo.labeling.protocol import request_body, score_from_json


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class HTTPLabeler(Labeler):
    """Scores through a labeler server (POST <url>/v1/score)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        url: str = Field(description="Base URL of the server, e.g. http://127.0.0.1:8765.")
        token_env: str | None = Field(
            None, description="Environment variable holding the bearer token."
        )
        timeout_s: float = Field(30.0, gt=0, description="Read timeout of one POST.")
        connect_timeout_s: float = Field(
            5.0,
            gt=0,
            description="Seconds to open a connection before the call counts as an error.",
        )
        batch_size: int = Field(256, ge=1, description="Most requests in one POST.")

    params: Params

    FAILURE_KINDS = (
        "connect_errors",
        "network_errors",
        "timeouts",
        "rate_limited",
        "server_errors",
    )
    stats_counters: ClassVar[frozenset[str]] = frozenset(FAILURE_KINDS)
    """Every key of :meth:`stats` is a counter: the stage reports its increase per pass."""

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._client: Any = None
        self.failures: Counter[str] = Counter()

    def stats(self) -> dict[str, float]:
        """Failed POSTs since the labeler was built, by kind (``connect_errors``: refused or
        unreachable; ``network_errors``: reset or cut connections; ``timeouts``;
        ``rate_limited``: 429 and 503; ``server_errors``: other 5xx). Running totals, declared
        in ``stats_counters``: the labeling stage logs each pass's increase as
        ``labeler/<name>/<kind>``."""
        return {kind: float(self.failures[kind]) for kind in self.FAILURE_KINDS}

    def _http(self) -> Any:
        import httpx

        if self._client is None:
            headers = {}
            if self.params.token_env is not None:
                token = os.environ.get(self.params.token_env)
                if not token:
                    raise UserError(
                        f"http labeler: the environment variable {self.params.token_env} is not set"
                    )
                headers["Authorization"] = f"Bearer {token}"
            self._client = httpx.Client(
                base_url=self.params.url.rstrip("/"),
                headers=headers,
                timeout=httpx.Timeout(self.params.timeout_s, connect=self.params.connect_timeout_s),
            )
        return self._client

    def close(self) -> None:
        """Close the pooled connections (the labeling stage calls it at the end of a run)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:  # a worker process opens its own connections
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        out: list[Score] = []
        for start in range(0, len(requests), self.params.batch_size):
            out += self._post(requests[start : start + self.params.batch_size])
        return out

    def _post(self, requests: list[LabelRequest]) -> list[Score]:
        import httpx

        body = request_body(requests)
        try:
            reply = self._http().post("/v1/score", json=body)
        except httpx.TimeoutException as exc:
            self.failures["timeouts"] += 1
            raise LabelerTimeout(f"{self.params.url}: {type(exc).__name__}") from None
        except httpx.TransportError as exc:  # refused, reset, DNS, protocol errors
            connect = isinstance(exc, httpx.ConnectError)
            self.failures["connect_errors" if connect else "network_errors"] += 1
            raise LabelerUnavailable(f"{self.params.url}: {type(exc).__name__}: {exc}") from None
        if reply.status_code in (429, 503) or reply.status_code >= 500:
            limited = reply.status_code in (429, 503)
            self.failures["rate_limited" if limited else "server_errors"] += 1
            raise LabelerUnavailable(
                f"{self.params.url}: HTTP {reply.status_code}",
                retry_after=_retry_after(reply.headers.get("retry-after")),
            )
        if reply.status_code in (401, 403):
            raise UserError(
                f"http labeler: {self.params.url} refused the token ({reply.status_code})"
            )
        if reply.status_code != 200:
            raise LabelerUnavailable(
                f"{self.params.url}: HTTP {reply.status_code}: {reply.text[:200]}"
            )
        try:
            scores = reply.json()["scores"]
            if not isinstance(scores, list):
                raise TypeError("scores is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            return [
                Score.parse_failure(f"the server's reply is not protocol JSON ({exc})")
                for _ in requests
            ]
        return [score_from_json(s) for s in scores]
