"""The annotation app in a real headless Chromium (Debian's /usr/bin/chromium, driven by
Playwright; no browser download): one annotator signs in and rates every item with the
keyboard, a second clicks and disagrees on one, and the export holds only the agreed items."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from alignzoo.config.schema import DataConfig
from alignzoo.engine.datasets import load_split
from alignzoo.human.export import export
from alignzoo.human.queue import HumanQueue
from alignzoo.types import LabelRequest

CHROMIUM = "/usr/bin/chromium"
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="Debian's chromium (make browser installs it)"
)
# Without the background-networking flags Chromium keeps dialling out of this closed network.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
ITEMS = [("1+1=", "2"), ("2+2=", "4"), ("3+3=", "7")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def app(tmp_path: Path):
    queue = HumanQueue(tmp_path / "q")
    queue.enqueue([LabelRequest(prompt=p, response=r) for p, r in ITEMS], raters=2, scale=(1, 5))
    queue.enqueue_pairs([("5+5=", "10", "11")], raters=2)
    tokens = {name: queue.add_annotator(name) for name in ("ann", "bob")}
    queue.close()
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "alignzoo", "annotate", str(tmp_path / "q"), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(200):
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url, tokens, tmp_path / "q"
    finally:
        server.terminate()
        server.wait(timeout=10)


def _sign_in(page, url: str, token: str, expect) -> None:
    page.goto(url)
    page.fill("#token", token)
    page.click("#signin button")
    expect(page.locator("#status")).to_contain_text("0 judged, 4 open")


def test_two_annotators_in_chromium_and_the_export_keeps_what_they_agree_on(app, tmp_path):
    url, tokens, queue_dir = app
    expect = sync_api.expect
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            ann = browser.new_context().new_page()
            _sign_in(ann, url, tokens["ann"], expect)
            for done, key in enumerate(["5", "5", "5", "a"], start=1):  # keyboard shortcuts
                expect(ann.locator("#buttons button")).not_to_have_count(0)
                ann.keyboard.press(key)
                expect(ann.locator("#status")).to_contain_text(f"{done} judged, {4 - done} open")
            expect(ann.locator("#done")).to_be_visible()

            bob = browser.new_context().new_page()  # a second annotator, a session of his own
            _sign_in(bob, url, tokens["bob"], expect)
            for done, label in enumerate(["5", "5", "1", "A is better"], start=1):  # clicks
                expect(bob.locator("#prompt")).to_have_text(
                    (*[p for p, _ in ITEMS], "5+5=")[done - 1]
                )
                bob.locator("#buttons button", has_text=label).click()
                expect(bob.locator("#status")).to_contain_text(f"{done} judged")
            expect(bob.locator("#done")).to_be_visible()
            expect(bob.locator("#agreement")).to_contain_text("pairs 1.00 raw")

            wrong = browser.new_context().new_page()
            wrong.goto(url)
            wrong.fill("#token", "not-a-token")
            wrong.click("#signin button")
            expect(wrong.locator("#message")).to_contain_text("sign in")
        finally:
            browser.close()

    export(queue_dir, tmp_path / "labels", "unpaired")
    rows = load_split(
        DataConfig(train=str(tmp_path / "labels"), eval="embedded"), "train", "unpaired"
    )
    assert {(r["prompt"], r["completion"], r["label"]) for r in rows.to_list()} == {
        ("1+1=", "2", True),
        ("2+2=", "4", True),  # "3+3=" (5 against 1) is left out
        ("5+5=", "10", True),
        ("5+5=", "11", False),
    }
