"""The annotation app's API: sign-in by token (stored hashed), each item to k annotators and
never twice to one, every bad request a clear 4xx that changes nothing, nothing lost when the
app restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from alignzoo.human.app import MAX_BODY, create_app
from alignzoo.human.queue import HumanQueue
from alignzoo.types import LabelRequest

REQUESTS = [LabelRequest(prompt=f"{i}+1=", response=str(i + 1)) for i in range(3)]


@pytest.fixture
def queue_dir(tmp_path: Path) -> Path:
    queue = HumanQueue(tmp_path / "q")
    queue.enqueue(REQUESTS, raters=2, scale=(1, 5))
    queue.enqueue_pairs([("2+2=", "4", "5")], raters=2)
    queue.close()
    return tmp_path / "q"


def _tokens(queue_dir: Path, *names: str) -> dict[str, str]:
    queue = HumanQueue(queue_dir)
    try:
        return {name: queue.add_annotator(name) for name in names}
    finally:
        queue.close()


def _judgements(queue_dir: Path) -> list[tuple[int, list[tuple[str, float | None]]]]:
    queue = HumanQueue(queue_dir)
    try:
        return [(item.id, given) for item, given in queue.items()]
    finally:
        queue.close()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_two_annotators_judge_every_item_once_and_a_restart_keeps_it_all(queue_dir) -> None:
    tokens = _tokens(queue_dir, "ann", "bob")
    raw = (queue_dir / "queue.sqlite").read_bytes() + b"".join(
        p.read_bytes() for p in queue_dir.glob("queue.sqlite-*")
    )
    assert not any(token.encode() in raw for token in tokens.values())  # only hashes stored
    with TestClient(create_app(queue_dir)) as client:
        assert "alignzoo annotate" in client.get("/").text
        me = client.get("/api/me", headers=auth(tokens["ann"])).json()
        assert me == {"annotator": "ann", "progress": {"judged": 0, "open": 4}}
        seen = []
        while item := client.get("/api/next", headers=auth(tokens["ann"])).json()["item"]:
            seen.append(item)
            value = 1 if item["kind"] == "pair" else 4
            answer = client.post(
                "/api/judge", headers=auth(tokens["ann"]), json={"item": item["id"], "value": value}
            )
            assert answer.status_code == 200 and answer.json()["stored"] is True
        assert [i["kind"] for i in seen] == ["rating"] * 3 + ["pair"]
        assert seen[3]["response"] == "4" and seen[3]["other"] == "5"
        assert seen[0]["low"] == 1 and seen[0]["high"] == 5
    # A restarted app serves the same queue: ann's judgements are there, bob sees every item.
    with TestClient(create_app(queue_dir)) as client:
        progress = client.get("/api/me", headers=auth(tokens["ann"])).json()["progress"]
        assert progress == {"judged": 4, "open": 0}
        first = client.get("/api/next", headers=auth(tokens["bob"])).json()["item"]
        assert first["id"] == seen[0]["id"]
        client.post(
            "/api/judge", headers=auth(tokens["bob"]), json={"item": first["id"], "value": None}
        )
        stats = client.get("/api/stats", headers=auth(tokens["bob"])).json()
        assert stats["progress"]["judgements"] == 5
    # With two judgements, an item is complete: a third annotator does not get it.
    cid = _tokens(queue_dir, "cid")["cid"]
    with TestClient(create_app(queue_dir)) as client:
        nxt = client.get("/api/next", headers=auth(cid)).json()["item"]
        assert nxt["id"] != first["id"]
        refused = client.post(
            "/api/judge", headers=auth(cid), json={"item": first["id"], "value": 3}
        )
        assert refused.status_code == 409 and "has all the 2 judgements" in refused.json()["error"]


@pytest.mark.parametrize(
    ("headers", "body", "status", "message"),
    [
        ({}, {"item": 1, "value": 3}, 401, "sign in"),
        ({"Authorization": "Bearer wrong"}, {"item": 1, "value": 3}, 401, "sign in"),
        ({"Authorization": "Basic abc"}, {"item": 1, "value": 3}, 401, "sign in"),
        (None, {"item": 99, "value": 3}, 404, "no queued item 99"),
        (None, {"item": 1, "value": 9}, 422, "off the scale"),
        (None, {"item": 1, "value": "good"}, 422, "value must be a number or null"),
        (None, {"item": 1, "value": True}, 422, "value must be a number or null"),
        (None, {"item": "1", "value": 3}, 422, "item must be an integer"),
        (None, {"item": 1}, 422, "send {"),
        (None, {"item": 1, "value": 3, "extra": 1}, 422, "send {"),
        (None, [1, 3], 422, "send {"),
        (None, {"item": 4, "value": 0.7}, 422, "is a pair: 1 (A better)"),
        (None, b'{"item": 1, "value": 1' + b"0" * 400 + b"}", 422, "too large to be a rating"),
        (None, b'{"item": 1, "value": 1e400}', 422, "is not a number"),
        (None, {"item": 2**70, "value": 3}, 404, "no queued item"),
        (None, b"{not json", 400, "not JSON"),
        (None, b"\xff\xfe", 400, "not JSON"),
        (None, b'{"item": 1, "value": "' + b"x" * MAX_BODY + b'"}', 413, "over 16384 bytes"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_change_nothing(queue_dir, headers, body, status, message):
    token = _tokens(queue_dir, "ann")["ann"]
    with TestClient(create_app(queue_dir)) as client:
        assert (
            client.post("/api/judge", headers=auth(token), json={"item": 2, "value": 5}).status_code
            == 200
        )
        before = _judgements(queue_dir)
        sent = auth(token) if headers is None else headers
        if isinstance(body, bytes):
            answer = client.post(
                "/api/judge", headers={**sent, "Content-Type": "application/json"}, content=body
            )
        else:
            answer = client.post("/api/judge", headers=sent, json=body)
        assert answer.status_code == status, answer.text
        assert message in answer.json()["error"]
        assert _judgements(queue_dir) == before  # nothing stored, nothing lost


def test_a_second_judgement_of_the_same_item_is_refused(queue_dir) -> None:
    token = _tokens(queue_dir, "ann")["ann"]
    with TestClient(create_app(queue_dir)) as client:
        assert (
            client.post("/api/judge", headers=auth(token), json={"item": 1, "value": 2}).status_code
            == 200
        )
        again = client.post("/api/judge", headers=auth(token), json={"item": 1, "value": 5})
        assert again.status_code == 409 and "judged it already" in again.json()["error"]
    assert _judgements(queue_dir)[0][1] == [("ann", 2.0)]


def test_every_api_call_needs_a_token(queue_dir) -> None:
    with TestClient(create_app(queue_dir)) as client:
        for path in ("/api/me", "/api/next", "/api/stats"):
            assert client.get(path).status_code == 401, path
