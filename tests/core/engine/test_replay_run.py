"""A GRPO run with the replay modifier: replayed groups join the batch from the second step,
the run trains, and a resumed run keeps the buffer (the same history as without the stop)."""

from __future__ import annotations

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

VOLATILE = ("time_s", "timing/", "throughput/", "labeler/")


def _stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def test_replay_in_a_run_and_across_a_resume(write_experiment, tmp_path) -> None:
    spec = tiny_experiment(
        budget={"steps": 6},
        training={"checkpoint_every": 2},
        arms={
            "grpo": {
                "algorithm": "grpo",
                "labeler": "arithmetic",
                "modifiers": [{"name": "replay", "params": {"ratio": 0.5}}],
            }
        },
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["replay/added"] == 0 and all(r["replay/added"] > 0 for r in rows[1:])
    assert all("loss" in r for r in rows)
    reference = _stable(rows)

    back_to_checkpoint(out, 4)
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    assert _stable(read_jsonl(out / "metrics.jsonl")) == reference
