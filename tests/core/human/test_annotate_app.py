"""The annotation app's API: sign-in by token (stored hashed; revoked and reissued at once),
each item to k annotators and never twice to one, only the item served judged, every bad
request a clear one-line 4xx that changes nothing, nothing lost when the app restarts, undo
within its window, the queue's instructions with each item, security headers on every
response, private queue files, and agreement kept up to date without reading the queue."""

from __future__ import annotations

import json
import random
import stat
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from alignzoo import cli
from alignzoo.human.app import MAX_BODY, SECURITY_HEADERS, create_app, nested_too_deep
from alignzoo.human.export import agreement
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
        assert me == {"annotator": "ann", "progress": {"judged": 0, "open": 4}, "undo_seconds": 30}
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
        (None, b"[" * 16000, 400, "nested over 32 deep"),
        (None, b'{"item": ' + b"[" * 40 + b"1" + b"]" * 40 + b', "value": 3}', 400, "nested"),
        (None, b'{"item": 2, "value": 1' + b"0" * 5000 + b"}", 422, "is not a number"),
        (None, b'{"item": 2' + b"0" * 5000 + b', "value": 3}', 422, "item must be an integer"),
        (None, b'{"item": 1, "value": "' + b"x" * MAX_BODY + b'"}', 413, "over 16384 bytes"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_change_nothing(queue_dir, headers, body, status, message):
    token = _tokens(queue_dir, "ann")["ann"]
    with TestClient(create_app(queue_dir)) as client:
        assert client.get("/api/next", headers=auth(token)).json()["item"]["id"] == 1
        assert (
            client.post("/api/judge", headers=auth(token), json={"item": 1, "value": 5}).status_code
            == 200
        )
        assert client.get("/api/next", headers=auth(token)).json()["item"]["id"] == 2
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
        assert "\n" not in answer.text and "Traceback" not in answer.text  # one line, no trace
        assert _judgements(queue_dir) == before  # nothing stored, nothing lost


def test_a_second_judgement_of_the_same_item_is_refused(queue_dir) -> None:
    token = _tokens(queue_dir, "ann")["ann"]
    with TestClient(create_app(queue_dir)) as client:
        client.get("/api/next", headers=auth(token))
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
        assert client.post("/api/undo").status_code == 401


def _judge(client: TestClient, token: str, item: int, value: float | None) -> int:
    return client.post(
        "/api/judge", headers=auth(token), json={"item": item, "value": value}
    ).status_code


def test_only_the_item_served_to_an_annotator_can_be_judged(queue_dir) -> None:
    tokens = _tokens(queue_dir, "ann", "bob")
    with TestClient(create_app(queue_dir)) as client:
        refused = client.post(
            "/api/judge", headers=auth(tokens["ann"]), json={"item": 1, "value": 3}
        )
        assert refused.status_code == 409  # nothing served yet
        assert "not the item served to you (none is)" in refused.json()["error"]
        served = client.get("/api/next", headers=auth(tokens["ann"])).json()["item"]["id"]
        assert served == 1
        # A reload serves the same item; another item, open and unjudged, is still refused.
        assert client.get("/api/next", headers=auth(tokens["ann"])).json()["item"]["id"] == 1
        other = client.post("/api/judge", headers=auth(tokens["ann"]), json={"item": 3, "value": 3})
        assert other.status_code == 409
        assert other.json()["error"].startswith("item 3 is not the item served to you (item 1 is)")
        assert _judge(client, tokens["bob"], 1, 3) == 409  # served to ann, not to bob
        assert _judge(client, tokens["ann"], 1, 3) == 200
        assert _judge(client, tokens["ann"], 2, 3) == 409  # judging does not serve the next one
        assert client.get("/api/next", headers=auth(tokens["ann"])).json()["item"]["id"] == 2
        assert _judge(client, tokens["ann"], 2, 3) == 200
    assert [given for _, given in _judgements(queue_dir)][:3] == [
        [("ann", 3.0)],
        [("ann", 3.0)],
        [],
    ]


def test_an_item_served_is_held_for_its_annotator_while_it_wants_no_more(tmp_path: Path) -> None:
    queue = HumanQueue(tmp_path / "q")
    try:
        queue.enqueue(REQUESTS, raters=1, scale=(1, 5))
        served = {name: queue.serve(name) for name in ("ann", "bob", "cid")}
        assert {name: item and item.id for name, item in served.items()} == {
            "ann": 1, "bob": 2, "cid": 3
        }  # fmt: skip
        assert queue.serve("dan") is None  # every item held for someone
        assert queue.serve("dan", hold=0) is not None  # holds lapse (someone walked away)
        assert queue.serve("ann").id == 1  # a reload: the same item
    finally:
        queue.close()


def test_every_response_carries_the_security_headers_and_the_page_no_inline_script(
    queue_dir,
) -> None:
    token = _tokens(queue_dir, "ann")["ann"]
    with TestClient(create_app(queue_dir)) as client:
        client.get("/api/next", headers=auth(token))
        answers = [
            client.get("/"),
            client.get("/app.js"),
            client.get("/app.css"),
            client.get("/api/me"),  # 401
            client.get("/api/me", headers=auth(token)),
            client.get("/api/stats", headers=auth(token)),
            client.get("/no/such/page"),  # 404
            client.get("/api/judge", headers=auth(token)),  # 405
            client.post("/api/judge", headers=auth(token), content=b"[" * 16000),  # 400
            client.post("/api/judge", headers=auth(token), json={"item": 1, "value": 3}),
        ]
        page = answers[0].text
    assert [a.status_code for a in answers] == [200, 200, 200, 401, 200, 200, 404, 405, 400, 200]
    for answer in answers:
        for name, value in SECURITY_HEADERS.items():
            assert answer.headers.get(name) == value, (answer.url, name)
    csp = SECURITY_HEADERS["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert SECURITY_HEADERS["x-frame-options"] == "DENY"
    assert SECURITY_HEADERS["x-content-type-options"] == "nosniff"
    assert answers[1].headers["content-type"].startswith("text/javascript")
    # The page's only script and style come from those two files: nothing inline to allow.
    assert page.count("<script") == 1 and '<script src="/app.js" defer></script>' in page
    assert "<style" not in page and " style=" not in page and " on" + "click=" not in page


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_queue_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    queue = HumanQueue(tmp_path / "q")
    queue.enqueue(REQUESTS, raters=1, scale=(1, 5))
    queue.add_annotator("ann")
    queue.submit(1, "ann", 3)
    files = sorted(p.name for p in (tmp_path / "q").iterdir())
    assert files == ["queue.sqlite", "queue.sqlite-shm", "queue.sqlite-wal"]
    assert {name: _mode(tmp_path / "q" / name) for name in files} == dict.fromkeys(files, 0o600)
    queue.close()
    # A queue an earlier version left world-readable is made private when opened.
    for name in files:
        if (tmp_path / "q" / name).exists():
            (tmp_path / "q" / name).chmod(0o644)
    HumanQueue(tmp_path / "q").close()
    assert {p.name: _mode(p) for p in (tmp_path / "q").iterdir()} == dict.fromkeys(
        (p.name for p in (tmp_path / "q").iterdir()), 0o600
    )


def test_the_depth_check_counts_brackets_outside_strings_only() -> None:
    assert nested_too_deep(b"[" * 33) and not nested_too_deep(b"[" * 32 + b"]" * 32)
    assert not nested_too_deep(b'{"item": "' + b"[" * 5000 + b'", "value": 1}')
    # An escaped backslash ends before the quote; an escaped quote does not end the string.
    assert not nested_too_deep(rb'["\\", "\"[[[[", ' + b"[]," * 3000 + b"[]]")
    assert nested_too_deep(rb'["\"", ' + b"{" * 40 + b"]")
    assert not nested_too_deep(rb'["\\\"' + b"{" * 40 + b'"]')


def test_undo_takes_back_the_last_judgement_within_its_window(queue_dir) -> None:
    token = _tokens(queue_dir, "ann")["ann"]
    with TestClient(create_app(queue_dir)) as client:
        nothing = client.post("/api/undo", headers=auth(token))
        assert nothing.status_code == 409 and "nothing to undo" in nothing.json()["error"]
        client.get("/api/next", headers=auth(token))
        assert _judge(client, token, 1, 2) == 200
        client.get("/api/next", headers=auth(token))  # item 2 served now
        wrong = client.post("/api/undo", headers=auth(token), json={"item": 2})
        assert wrong.status_code == 409 and "is of item 1, not 2" in wrong.json()["error"]
        undone = client.post("/api/undo", headers=auth(token), json={"item": 1})
        assert undone.status_code == 200, undone.text
        body = undone.json()
        assert body["undone"] == 1 and body["item"]["id"] == 1
        assert body["progress"] == {"judged": 0, "open": 4}
        assert _judgements(queue_dir)[0][1] == []
        # The item is served again (not item 2): judged anew, with another value.
        assert client.get("/api/next", headers=auth(token)).json()["item"]["id"] == 1
        assert _judge(client, token, 1, 4) == 200
        assert client.get("/api/stats", headers=auth(token)).json()["progress"]["judgements"] == 1
    assert _judgements(queue_dir)[0][1] == [("ann", 4.0)]
    with TestClient(create_app(queue_dir, undo_seconds=0.05)) as client:
        time.sleep(0.1)
        late = client.post("/api/undo", headers=auth(token))
        assert late.status_code == 409 and "over 0.05 s old" in late.json()["error"]
    assert _judgements(queue_dir)[0][1] == [("ann", 4.0)]


def test_revoke_and_reissue_from_the_command_line_take_effect_at_once(
    queue_dir, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = _tokens(queue_dir, "ann", "bob")
    with TestClient(create_app(queue_dir)) as client:  # the app runs while the CLI acts
        assert client.get("/api/me", headers=auth(tokens["ann"])).status_code == 200
        assert cli.main(["annotate", "revoke", str(queue_dir), "ann"]) == 0
        assert client.get("/api/me", headers=auth(tokens["ann"])).status_code == 401
        assert client.get("/api/me", headers=auth(tokens["bob"])).status_code == 200
        capsys.readouterr()
        assert cli.main(["annotate", "status", str(queue_dir)]) == 0
        assert json.loads(capsys.readouterr().out)["revoked"] == ["ann"]
        assert cli.main(["annotate", "reissue", str(queue_dir), "ann"]) == 0
        new = capsys.readouterr().out.strip().splitlines()[-1]
        assert new not in tokens.values()
        assert client.get("/api/me", headers=auth(tokens["ann"])).status_code == 401
        assert client.get("/api/me", headers=auth(new)).json()["annotator"] == "ann"
        assert cli.main(["annotate", "reissue", str(queue_dir), "bob"]) == 0
        assert client.get("/api/me", headers=auth(tokens["bob"])).status_code == 401
    assert cli.main(["annotate", "revoke", str(queue_dir), "nobody"]) == 2
    assert "no annotator named 'nobody'" in capsys.readouterr().err


def test_each_item_carries_the_queue_instructions_and_the_page_shows_them(
    queue_dir, capsys: pytest.CaptureFixture[str]
) -> None:
    token = _tokens(queue_dir, "ann")["ann"]
    with TestClient(create_app(queue_dir)) as client:
        item = client.get("/api/next", headers=auth(token)).json()["item"]
        assert item["question"] == "How good is the response as an answer to the prompt?"
        assert [v for v, _ in item["labels"]] == [1, 3, 5]  # defaults: the ends and the middle
        assert item["labels"][0][1].startswith("very poor")
        page = client.get("/").text
        assert 'id="question"' in page and 'id="guide"' in page and 'id="help"' in page
    args = ["annotate", "instructions", str(queue_dir), "--question", "Is the sum right?"]
    labels = ["--scale-label", "1=wrong", "--scale-label", "5=right and explained"]
    assert cli.main([*args, *labels, "--scale-label", "9=off the scale"]) == 0
    assert cli.main(["annotate", "instructions", str(queue_dir), "--kind", "pair",
                     "--question", "Which sum is right?"]) == 0  # fmt: skip
    assert cli.main(["annotate", "instructions", str(queue_dir), "--scale-label", "x"]) == 2
    capsys.readouterr()
    assert cli.main(["annotate", "instructions", str(queue_dir)]) == 0
    assert '"question": "Is the sum right?"' in capsys.readouterr().out
    with TestClient(create_app(queue_dir)) as client:
        item = client.get("/api/next", headers=auth(token)).json()["item"]
        assert item["question"] == "Is the sum right?"
        assert item["labels"] == [[1, "wrong"], [5, "right and explained"]]  # 9: not on [1, 5]
        for value in (1, 2, 3):
            client.get("/api/next", headers=auth(token))
            assert _judge(client, token, value, 3) == 200
        pair = client.get("/api/next", headers=auth(token)).json()["item"]
        assert pair["kind"] == "pair" and pair["question"] == "Which sum is right?"
        assert [v for v, _ in pair["labels"]] == [1, 0, 0.5]


def test_agreement_is_kept_up_to_date_and_equals_the_computation_over_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = HumanQueue(tmp_path / "q")
    queue.enqueue([LabelRequest(prompt=f"{i}", response="r") for i in range(12)], 3, (1, 5))
    queue.enqueue([LabelRequest(prompt=f"{i}", response="s") for i in range(6)], 3, (0, 1))
    queue.enqueue_pairs([(f"{i}", "a", "b") for i in range(14)], raters=3)
    tokens = {name: queue.add_annotator(name) for name in ("ann", "bob", "cid")}
    rng = random.Random(0)
    for item, _ in queue.items()[:8]:  # judged before the app starts (another writer)
        queue.submit(item.id, "sim", None if rng.random() < 0.2 else item.low)
    with TestClient(create_app(tmp_path / "q")) as client:
        for step in range(100):
            name = rng.choice(list(tokens))
            if step % 7 == 6:
                client.post("/api/undo", headers=auth(tokens[name]))
            else:
                item = client.get("/api/next", headers=auth(tokens[name])).json()["item"]
                if item is None:
                    continue
                if item["kind"] == "pair":
                    value = rng.choice([0, 0.5, 1, None])
                elif item["high"] == 1:
                    value = rng.choice([0, 0.25, 0.3, 1])
                else:
                    value = rng.choice([1, 2, 3, 4, 5, None])
                assert _judge(client, tokens[name], item["id"], value) == 200
            if step % 10 == 0:  # another process judges meanwhile
                for item, given in queue.items()[step // 10 :: 7]:
                    if len(given) < item.raters and "sim2" not in dict(given):
                        queue.submit(item.id, "sim2", item.high)
            if step % 3:
                continue
            live = client.get("/api/stats", headers=auth(tokens[name])).json()
            full = agreement(queue)
            for kind in ("ratings", "pairs"):
                assert live["agreement"][kind].keys() == full[kind].keys()
                for key, value in full[kind].items():
                    assert live["agreement"][kind][key] == pytest.approx(value, abs=2e-6), step
        assert live["agreement"]["pairs"]["items"] > 5 and live["agreement"]["ratings"]["items"] > 5
        # A judgement and the stats after it read what changed, not every item and judgement.
        item = client.get("/api/next", headers=auth(tokens["ann"])).json()["item"]
        with monkeypatch.context() as patch:
            for name in ("items", "judgements"):
                patch.setattr(HumanQueue, name, _not_the_whole_queue)
            if item is not None:
                assert _judge(client, tokens["ann"], item["id"], None) == 200
            assert client.get("/api/stats", headers=auth(tokens["ann"])).status_code == 200
    queue.close()


def _not_the_whole_queue(*args: object) -> None:
    raise AssertionError("read the whole queue")


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_serving_beyond_loopback_warns_that_it_is_plain_http(queue_dir, monkeypatch, capsys, host):
    import alignzoo.human.app as app

    served: list[str] = []
    monkeypatch.setattr(app, "serve", lambda queue, host, port: served.append(host))
    assert cli.main(["annotate", "serve", str(queue_dir), "--host", host]) == 0
    err = capsys.readouterr().err
    assert served == [host]
    assert ("plain HTTP" in err) is (host == "0.0.0.0"), err
