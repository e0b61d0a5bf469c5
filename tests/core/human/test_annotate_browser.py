"""The annotation app in a real headless Chromium (Debian's /usr/bin/chromium, driven by
Playwright; no browser download): one annotator signs in and rates every item with the
keyboard, a second clicks and disagrees on one, and the export holds only the agreed items;
and, as a place to work: the question and scale labels shown, a button per point of a 0-10
scale and a slider for a 0-1 one, the keyboard help, undo, sign-out, a 3,000-character
unbroken response kept inside the window with the controls in view, no script error on any
key."""

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


def _serve(tmp_path: Path, tokens: dict[str, str]):
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


@pytest.fixture
def app(tmp_path: Path):
    queue = HumanQueue(tmp_path / "q")
    queue.enqueue([LabelRequest(prompt=p, response=r) for p, r in ITEMS], raters=2, scale=(1, 5))
    queue.enqueue_pairs([("5+5=", "10", "11")], raters=2)
    tokens = {name: queue.add_annotator(name) for name in ("ann", "bob")}
    queue.close()
    yield from _serve(tmp_path, tokens)


LONG = "x" * 3000  # one unbroken word


@pytest.fixture
def scales(tmp_path: Path):
    """A 0-10 item, a 0-1 item, a 3,000-character unbroken response, a pair of such."""
    queue = HumanQueue(tmp_path / "q")
    queue.enqueue([LabelRequest(prompt="Rate 7*6=42", response="42")], scale=(0, 10))
    queue.enqueue([LabelRequest(prompt="Rate 1+1=2", response="2")], scale=(0, 1))
    queue.enqueue([LabelRequest(prompt="Rate " + LONG, response=LONG)], scale=(1, 5))
    queue.enqueue_pairs([("Which? " + LONG, LONG, "y" * 3000)])
    queue.set_instructions("rating", "Is the arithmetic right?", {0: "wrong", 10: "perfect"})
    tokens = {"ann": queue.add_annotator("ann")}
    queue.close()
    yield from _serve(tmp_path, tokens)


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


def _inside_the_window(page) -> None:
    """No horizontal overflow, and every control button within the viewport."""
    size = page.evaluate("[window.innerWidth, window.innerHeight]")
    assert page.evaluate("document.documentElement.scrollWidth") <= size[0]
    boxes = [b.bounding_box() for b in page.locator("#controls button:visible").all()]
    assert boxes
    for box in boxes:
        assert box is not None
        assert box["x"] >= 0 and box["x"] + box["width"] <= size[0], box
        assert box["y"] >= 0 and box["y"] + box["height"] <= size[1], box


def test_a_place_to_work_scales_help_undo_long_texts_and_sign_out(scales) -> None:
    url, tokens, queue_dir = scales
    expect = sync_api.expect
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 720}).new_page()
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(url)
            page.keyboard.press('"')  # on the sign-in page too
            page.fill("#token", tokens["ann"])
            page.click("#signin button")
            status = page.locator("#status")
            expect(status).to_contain_text("0 judged, 4 open")

            # The question and what the scale's ends mean; 0-10: a button per point, keys 0-9.
            expect(page.locator("#question")).to_have_text("Is the arithmetic right?")
            expect(page.locator("#guide")).to_contain_text("0: wrong")
            expect(page.locator("#guide")).to_contain_text("10: perfect")
            points = page.locator("#buttons button[data-value]")
            expect(points).to_have_count(11)
            values = [b.get_attribute("data-value") for b in points.all()]
            assert values == [str(v) for v in range(11)]
            keys = [b.get_attribute("data-key") for b in points.all()]
            assert keys == [str(v) for v in range(10)] + [""]  # 10: a click (or Tab, Enter)
            expect(points.first).to_contain_text("wrong")  # the labelled points say so
            for key in ['"', "'", "\\", "]", "Shift", "F2", "ArrowDown", "Escape", "z"]:
                page.keyboard.press(key)  # no button, no error
            expect(status).to_contain_text("0 judged, 4 open")

            page.keyboard.press("?")  # the keyboard help
            expect(page.locator("#help")).to_be_visible()
            expect(page.locator("#help")).to_contain_text("undo your last judgement")
            page.keyboard.press("7")  # keys do nothing while the help is open
            page.keyboard.press("Escape")
            expect(page.locator("#help")).to_be_hidden()
            expect(status).to_contain_text("0 judged, 4 open")

            page.keyboard.press("7")
            expect(status).to_contain_text("1 judged, 3 open")
            expect(page.locator("#prompt")).to_have_text("Rate 1+1=2")
            expect(page.locator("#undo")).to_be_visible()
            page.keyboard.press("u")  # undo: the 0-10 item again
            expect(status).to_contain_text("0 judged, 4 open")
            expect(page.locator("#prompt")).to_have_text("Rate 7*6=42")
            expect(page.locator("#message")).to_contain_text("taken back")
            page.locator("#buttons button[data-value='10']").click()
            expect(status).to_contain_text("1 judged, 3 open")

            # 0-1: a slider (no two-button scale); the keys move it, Enter sends it.
            expect(page.locator("#scale")).to_be_visible()
            expect(page.locator("#buttons")).to_be_hidden()
            expect(page.locator("#scalevalue")).to_have_text("0.50")
            page.keyboard.press("ArrowRight")
            page.keyboard.press("Shift+ArrowRight")
            expect(page.locator("#scalevalue")).to_have_text("0.61")
            page.locator("#scale").fill("0.75")
            expect(page.locator("#scalevalue")).to_have_text("0.75")
            page.keyboard.press("Enter")
            expect(status).to_contain_text("2 judged, 2 open")

            # 3,000 unbroken characters wrap inside their box; the controls stay in view.
            expect(page.locator("#response")).to_have_text(LONG)
            _inside_the_window(page)
            page.keyboard.press("4")
            expect(status).to_contain_text("3 judged, 1 open")
            expect(page.locator("#a")).to_have_text(LONG)
            _inside_the_window(page)
            small = browser.new_context(viewport={"width": 390, "height": 640}).new_page()
            small.on("pageerror", lambda error: errors.append(str(error)))
            small.goto(url)  # a phone-sized window, another session of the same annotator
            small.fill("#token", tokens["ann"])
            small.click("#signin button")
            expect(small.locator("#b")).to_have_text("y" * 3000)
            _inside_the_window(small)

            page.click("#signout")  # sign out: the sign-in form, and a reload stays signed out
            expect(page.locator("#signin")).to_be_visible()
            expect(page.locator("#work")).to_be_hidden()
            page.reload()
            expect(page.locator("#signin")).to_be_visible()
            expect(page.locator("#work")).to_be_hidden()
            assert page.evaluate("sessionStorage.length") == 0
        finally:
            browser.close()
    assert errors == []
    queue = HumanQueue(queue_dir)
    try:
        given = [values for _, values in queue.items()]
    finally:
        queue.close()
    assert given == [[("ann", 10.0)], [("ann", 0.75)], [("ann", 4.0)], []]
