"""A GRPO run labeled by people through the human queue: a simulated rater works through the
queue while the run waits, every sample is valued by the human labeler, and the queue holds
each judgement."""

from __future__ import annotations

import threading

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.human.queue import HumanQueue

from .conftest import read_jsonl, tiny_experiment


def test_a_run_labeled_by_a_rater_through_the_queue(write_experiment, tmp_path) -> None:
    queue_dir = tmp_path / "queue"
    queue = HumanQueue(queue_dir)
    stop = threading.Event()
    rated: list[float] = []

    def rater() -> None:  # 5 for a right answer, 1 otherwise
        while not stop.is_set():
            item = queue.next_for("sim")
            if item is None:
                stop.wait(0.005)
                continue
            value = 5.0 if item.response.strip() == str(item.extra["answer"]) else 1.0
            queue.submit(item.id, "sim", value)
            rated.append(value)

    labeler = {"name": "human", "params": {"queue": str(queue_dir), "wait_s": 60, "poll_s": 0.01}}
    spec = tiny_experiment(
        budget={"steps": 3},
        evaluation={"every": 100, "num_prompts": 4},
        arms={"grpo": {"algorithm": "grpo", "labeler": labeler}},
    )
    thread = threading.Thread(target=rater)
    thread.start()
    try:
        summary = run_one(load_experiment(write_experiment(spec)), "grpo", 0, tmp_path / "run")
    finally:
        stop.set()
        thread.join()
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["label/valued"] for r in rows] == [r["label/generated"] for r in rows]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    assert queue.progress()["judgements"] == len(rated) == queue.progress()["complete"]
    assert [r["human/items"] for r in rows] == sorted(r["human/items"] for r in rows)
    assert all(r["human/complete_frac"] == 1.0 for r in rows)  # the rater kept up
    assert all("human/alpha" not in r for r in rows)  # one judgement per sample: no agreement


def test_a_run_labeled_by_simulated_annotators_logs_their_agreement(write_experiment, tmp_path):
    labeler = {
        "name": "simulated_annotators",
        "params": {
            "queue": str(tmp_path / "queue"),
            "raters": 2,
            "rule": "arithmetic",
            "annotators": [{"name": "a", "noise": 0.1}, {"name": "b", "noise": 0.4, "bias": 0.2}],
        },
    }
    spec = tiny_experiment(
        budget={"steps": 2},
        evaluation={"every": 100, "num_prompts": 4},
        arms={"grpo": {"algorithm": "grpo", "labeler": labeler}},
    )
    summary = run_one(load_experiment(write_experiment(spec)), "grpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["human/items"] for r in rows][-1] > 0
    assert all(r["human/complete_frac"] == 1.0 for r in rows)
    assert all(-1.0 <= r["human/alpha"] <= 1.0 for r in rows)
    progress = HumanQueue(tmp_path / "queue").progress()
    assert progress["judgements"] == 2 * progress["items"] >= 2 * rows[-1]["human/items"]
