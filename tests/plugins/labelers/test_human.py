"""The human queue and the "human" labeler: k raters per sample, never the same rater twice,
late ratings kept for the next call, pending abstains never stored, and a training run whose
labels come from a (simulated) rater working through the queue."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from alignzoo import LabelRequest, Outcome, Score
from alignzoo.human.queue import AlreadyJudged, HumanQueue, QueueError
from alignzoo.labeling.store import LabelStore
from alignzoo.plugins.labelers.human import HumanLabeler

REQS = [LabelRequest(prompt=f"{i}+1=", response=str(i + 1), extra={"answer": str(i + 1)})
        for i in range(3)]  # fmt: skip


def test_each_item_goes_to_k_raters_never_twice_to_one(tmp_path) -> None:
    queue = HumanQueue(tmp_path / "q")
    ids = queue.enqueue(REQS, raters=2, scale=(1, 5))
    assert queue.enqueue(REQS[:1], 1, (1, 5)) == ids[:1]  # queued once; raters never shrinks
    seen = []
    while (item := queue.next_for("ann")) is not None:
        seen.append(item.id)
        queue.submit(item.id, "ann", 4)
    assert seen == ids  # every item once, oldest first
    with pytest.raises(AlreadyJudged, match="judged it already"):
        queue.submit(ids[0], "ann", 3)  # a rater judges an item once
    with pytest.raises(ValueError, match="off the scale"):
        queue.submit(ids[0], "bob", 9)
    for item in ids:
        queue.submit(item, "bob", None if item == ids[2] else 2)
    assert queue.next_for("cid") is None  # everything has its two raters
    assert queue.judgements(ids) == {ids[0]: [4, 2], ids[1]: [4, 2], ids[2]: [4, None]}
    assert queue.progress() == {"items": 3, "complete": 3, "judgements": 6}


def test_the_labeler_waits_for_raters_and_keeps_late_ratings(tmp_path) -> None:
    params = {"queue": str(tmp_path / "q"), "raters": 2, "scale": (1, 5), "poll_s": 0.01}
    labeler = HumanLabeler(HumanLabeler.Params(**params, wait_s=0.05))
    early = labeler.score_batch(requests=REQS)  # nobody rates: every sample abstains, pending
    assert [s.outcome for s in early] == [Outcome.ABSTAIN] * 3
    assert all(s.info["pending"] for s in early)

    queue = HumanQueue(tmp_path / "q")
    for rater, value in (("ann", 5), ("bob", 2)):
        while (item := queue.next_for(rater)) is not None:
            cannot = rater == "ann" and item.prompt == "2+1="
            queue.submit(item.id, rater, None if cannot else value)
    late = labeler.score_batch(requests=REQS)  # the ratings given since are found
    assert [s.value for s in late[:2]] == [pytest.approx(0.625)] * 2  # mean 3.5 on [1, 5]
    assert late[0].info["ratings"] == [5, 2]
    assert late[2].outcome == Outcome.ABSTAIN and "pending" not in late[2].info  # ann could not

    median = HumanLabeler(HumanLabeler.Params(**params, wait_s=0, min_raters=1, aggregate="median"))
    assert median.score_batch(requests=REQS)[2].value == pytest.approx(0.25)  # bob's 2 alone


def test_a_waiting_labeler_answers_as_soon_as_raters_are_done(tmp_path) -> None:
    labeler = HumanLabeler(HumanLabeler.Params(queue=str(tmp_path / "q"), wait_s=30, poll_s=0.01))
    queue = HumanQueue(tmp_path / "q")
    stop = threading.Event()

    def rater() -> None:
        while not stop.is_set():
            item = queue.next_for("sim")
            if item is None:
                stop.wait(0.005)
                continue
            queue.submit(item.id, "sim", 5.0 if item.response == item.extra["answer"] else 1.0)

    thread = threading.Thread(target=rater)
    thread.start()
    try:
        scores = labeler.score_batch(requests=[*REQS, LabelRequest("1+1=", "3", {"answer": "2"})])
    finally:
        stop.set()
        thread.join()
    assert [s.value for s in scores] == [1.0, 1.0, 1.0, 0.0]


def test_bad_params_are_refused() -> None:
    with pytest.raises(ValidationError, match="min_raters"):
        HumanLabeler.Params(queue="q", raters=1, min_raters=2)
    with pytest.raises(ValidationError, match="scale"):
        HumanLabeler.Params(queue="q", scale=(5, 1))


def test_a_pending_abstain_is_not_stored_but_a_final_one_is(tmp_path) -> None:
    store = LabelStore(tmp_path / "labels.sqlite")
    pending = Score.abstain("waiting")
    pending.info["pending"] = True
    stored = store.put("human", [("k1", REQS[0], pending), ("k2", REQS[1], Score.abstain())], 0.1)
    assert stored == 1 and set(store.lookup("human", ["k1", "k2"])) == {"k2"}


def test_a_sample_is_rated_on_one_scale(tmp_path) -> None:
    queue = HumanQueue(tmp_path / "q")
    queue.enqueue(REQS[:1], raters=1, scale=(1, 5))
    with pytest.raises(QueueError, match=r"queued on the scale \[1.0, 5.0\], not \[0.0, 1.0\]"):
        queue.enqueue(REQS, raters=1, scale=(0, 1))
    assert queue.progress()["items"] == 1  # nothing of the refused call was queued
