"""``alignzoo serve-labeler`` hardened (issue 29): an item that makes the labeler raise fails
alone (its batch mates from other clients get their values), a failing labeler still answers
503 after a bounded number of extra calls, a body nested too deep (or not JSON at all) is a
one-line 400 and never a traceback, and a non-loopback address needs a token or --insecure."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from alignzoo import LabelRequest, cli
from alignzoo.errors import LabelerUnavailable
from alignzoo.labeling.protocol import MAX_JSON_DEPTH, JSONLimitError, loads_limited
from alignzoo.labeling.service import DOWN_AFTER_FAILED_CALLS, ServeConfig, build_app
from alignzoo.plugins.labelers.arithmetic import ArithmeticLabeler
from tests.core.labeling.test_labeler_server import running

SHARED_WINDOW = {"labeler": {"name": "arithmetic"}, "batching": {"max_wait_ms": 250}}


@pytest.fixture
def calls(monkeypatch) -> list[list[str]]:
    """The prompts of every call the served arithmetic labeler gets, in order."""
    log: list[list[str]] = []
    original = ArithmeticLabeler.score_batch

    @functools.wraps(original)  # keeps the hookimpl marker
    def spy(self: Any, requests: list[LabelRequest]) -> Any:
        log.append([r.prompt for r in requests])
        return original(self, requests)

    monkeypatch.setattr(ArithmeticLabeler, "score_batch", spy)
    return log


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def serving(cfg: dict[str, Any]) -> Iterator[tuple[str, Records]]:
    """A real server on 127.0.0.1 and what uvicorn logs (tracebacks of the app included)."""
    records = Records()
    with running(build_app(ServeConfig.model_validate(cfg))) as url:
        # After the server configured uvicorn's logging (which drops handlers set before).
        loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "uvicorn.access")]
        for logger in loggers:
            logger.addHandler(records)
        try:
            yield url, records
        finally:
            for logger in loggers:
                logger.removeHandler(records)


def item(i: int) -> dict[str, Any]:
    """A well-formed item: right (1.0) for odd i, wrong (0.0) for even i."""
    return {"prompt": f"{i}+1=", "response": str(i + 1 if i % 2 else i), "extra": {"answer": i + 1}}


POISON = {"prompt": "poison", "response": "2", "extra": {"answer": float("nan")}}  # raises


def post_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """POST every body at once (NaN written as JSON's NaN extension, as Python writes it)."""

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            headers = {"content-type": "application/json"}
            return list(
                await asyncio.gather(
                    *(
                        http.post("/v1/score", content=json.dumps(b), headers=headers)
                        for b in bodies
                    )
                )
            )

    return asyncio.run(send())


def test_a_poisoned_item_fails_alone_and_other_clients_batched_with_it_get_their_values(
    calls,
) -> None:
    goods = [{"version": 1, "requests": [item(i)]} for i in range(15)]
    poisoned = {"version": 1, "requests": [item(101), POISON]}
    shared = 0
    with serving(SHARED_WINDOW) as (url, records):
        for trial in range(5):
            first = len(calls)
            replies = post_all(url, [*goods[:7], poisoned, *goods[7:]])
            statuses = [r.status_code for r in replies]
            assert statuses == [200] * 16, (trial, statuses, [r.text[:200] for r in replies])
            for i, reply in zip([*range(7), None, *range(7, 15)], replies, strict=True):
                scores = reply.json()["scores"]
                if i is None:
                    continue
                assert scores == [
                    {
                        "value": 1.0 if i % 2 else 0.0,
                        "valid": True,
                        "outcome": "value",
                        "info": {"extracted": str(i + 1 if i % 2 else i), "correct": bool(i % 2)},
                    }
                ], (trial, i)
            value, error = replies[7].json()["scores"]
            assert value["outcome"] == "value" and value["value"] == 1.0
            assert error["outcome"] == "error" and error["value"] is None and not error["valid"]
            assert "not an integer" in error["info"]["reason"], error
            shared += any("poison" in c and len(c) > 1 for c in calls[first:])
            assert [c for c in calls[first:] if "poison" in c][-1] == ["poison"]  # alone at last
        assert shared, f"premise: no call batched the poisoned item with others: {calls}"
        metrics = httpx.get(f"{url}/metrics").text
        assert "alignzoo_labeler_item_errors_total 5.0" in metrics
        assert not [r for r in records.records if r.levelno >= logging.ERROR or r.exc_info]


def test_several_poisoned_clients_fail_alone_wherever_the_batch_splits(calls) -> None:
    """Two bad items in one server batch (they land in different halves of it) fail only their
    own requests: the labeler is judged failing only when items alone fail, never for a batch
    that holds bad items."""
    goods = [{"version": 1, "requests": [item(i)]} for i in range(14)]
    poisoned = {"version": 1, "requests": [POISON]}
    together = 0
    with serving(SHARED_WINDOW) as (url, _):
        for trial in range(4):
            first = len(calls)
            replies = post_all(url, [poisoned, *goods, poisoned])
            statuses = [r.status_code for r in replies]
            assert statuses == [200] * 16, (trial, statuses, [r.text[:200] for r in replies])
            for reply in (replies[0], replies[-1]):
                (error,) = reply.json()["scores"]
                assert error["outcome"] == "error" and "not an integer" in error["info"]["reason"]
            for i, reply in enumerate(replies[1:-1]):
                (value,) = reply.json()["scores"]
                assert value["outcome"] == "value" and value["value"] == (1.0 if i % 2 else 0.0)
            together += any(c.count("poison") == 2 for c in calls[first:])
    assert together, f"premise: no call batched both poisoned items: {calls}"


def test_a_labeler_failing_every_call_is_still_a_503_after_a_bounded_number_of_calls(
    monkeypatch,
) -> None:
    calls: list[list[str]] = []
    fail: list[BaseException] = []
    original = ArithmeticLabeler.score_batch

    @functools.wraps(original)
    def down(self: Any, requests: list[LabelRequest]) -> Any:
        calls.append([r.prompt for r in requests])
        if fail:
            raise fail[0]
        return original(self, requests)

    monkeypatch.setattr(ArithmeticLabeler, "score_batch", down)
    body = {"version": 1, "requests": [item(i) for i in range(12)]}  # one request: one batch
    with serving({**SHARED_WINDOW, "batching": {"max_wait_ms": 0}}) as (url, _):
        fail[:] = [RuntimeError("CUDA error: device lost")]
        reply = httpx.post(f"{url}/v1/score", json=body)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert "device lost" in reply.json()["error"]
        assert len(calls) == 1 + DOWN_AFTER_FAILED_CALLS  # the batch, then a few alone: down

        # Every item bad looks the same as a labeler that is down: 503 too, as before.
        calls.clear()
        fail.clear()
        bad = {"version": 1, "requests": [POISON] * 12}
        assert post_all(url, [bad])[0].status_code == 503
        assert len(calls) == 1 + DOWN_AFTER_FAILED_CALLS

        calls.clear()  # the labeler says it is unavailable: no item-by-item retries at all
        fail[:] = [LabelerUnavailable("upstream judge: HTTP 429", retry_after=7.0)]
        reply = httpx.post(f"{url}/v1/score", json=body)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "7"
        assert len(calls) == 1

        fail.clear()  # recovered
        reply = httpx.post(f"{url}/v1/score", json=body)
        assert reply.status_code == 200 and len(reply.json()["scores"]) == 12


BAD_BODIES = [
    b"[" * 16_000,
    b'{"version": 1, "requests": ' + b'[{"a": ' * 8_000,
    b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
    b"",
    b"{nope",
    b"\xff\xfe\x00{",
    "\ufeff{}".encode(),  # a UTF-8 byte-order mark
    b'{"version": 1, "requests": [',
    b'{"version": 1, "requests": [{"prompt": 1}]}',
    b'{"version": 1, "requests": [{"prompt": "a", "response": "b", "x": 2}]}',
]


def test_bodies_nested_too_deep_or_unparsable_are_a_one_line_400_never_a_traceback() -> None:
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH - 4):  # body, requests, item and extra are 4 levels
        deep = [deep]
    fine = {**item(1), "prompt": '[{"\\' * 20_000, "extra": {"answer": 2, "deep": deep}}
    with serving(SHARED_WINDOW) as (url, records):
        for body in BAD_BODIES:
            reply = httpx.post(
                f"{url}/v1/score", content=body, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 400, (body[:40], reply.text[:300])
            assert reply.headers["content-type"] == "application/json"
            error = reply.json()["error"]
            assert "\n" not in reply.text and "Traceback" not in reply.text, reply.text
            if body.startswith(b"[["):
                assert f"nested deeper than {MAX_JSON_DEPTH}" in error
        # Up to the limit, and brackets, quotes and backslashes inside strings, are fine.
        reply = httpx.post(f"{url}/v1/score", json={"version": 1, "requests": [fine]})
        assert reply.status_code == 200, reply.text[:300]
        assert reply.json()["scores"][0]["value"] == 1.0
        assert not [r for r in records.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('["[[[", "]]]", "\\"[[["]', 1),
        ('"\\\\"', 0),
        ('[["\\\\"], [[]]]', 3),
    ],
)
def test_loads_limited_counts_brackets_outside_strings_only(text: str, depth: int) -> None:
    assert loads_limited(text.encode(), max_depth=depth) == json.loads(text)
    if depth:
        with pytest.raises(JSONLimitError, match=f"nested deeper than {depth - 1}"):
            loads_limited(text.encode(), max_depth=depth - 1)


def test_loads_limited_refuses_what_json_loads_would_choke_on() -> None:
    for body in (b"[" * 100_000, b'{"a":' * 100_000, b"\xff", b"", b"[1,]", b'"\\'):
        with pytest.raises(JSONLimitError):
            loads_limited(body, max_depth=MAX_JSON_DEPTH)
    assert issubclass(JSONLimitError, ValueError)


# --- binding -----------------------------------------------------------------------------------


@pytest.fixture
def served(tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """A serve-labeler YAML, and the hosts uvicorn was asked to bind (nothing really binds)."""
    path = tmp_path / "labeler.yaml"
    path.write_text("labeler: {name: arithmetic}\n")
    hosts: list[str] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: hosts.append(host))
    return path, hosts


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "example.org", ""])
def test_a_non_loopback_address_without_a_token_exits_2_naming_insecure(
    served, host, capsys
) -> None:
    path, hosts = served
    assert cli.main(["serve-labeler", str(path), "--host", host]) == 2
    err = capsys.readouterr().err
    assert "--insecure" in err and "token_env" in err and "without authentication" in err, err
    assert hosts == []


def test_insecure_serves_with_a_warning_and_loopback_says_unauthenticated(
    served, capsys, monkeypatch
) -> None:
    path, hosts = served
    assert cli.main(["serve-labeler", str(path), "--host", "0.0.0.0", "--insecure"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err.lower() and "without authentication" in err and "0.0.0.0" in err
    for host in ("127.0.0.1", "localhost", "::1", "127.3.4.5"):
        assert cli.main(["serve-labeler", str(path), "--host", host]) == 0
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "unauthenticated" in lines[0], lines
    monkeypatch.setenv("LABEL_TOKEN", "s3cret")  # a token: any address, without a word
    path.write_text("labeler: {name: arithmetic}\ntoken_env: LABEL_TOKEN\n")
    assert cli.main(["serve-labeler", str(path), "--host", "0.0.0.0"]) == 0
    assert capsys.readouterr().err == ""
    assert hosts == ["0.0.0.0", "127.0.0.1", "localhost", "::1", "127.3.4.5", "0.0.0.0"]
