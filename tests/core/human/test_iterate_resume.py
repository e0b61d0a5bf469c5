"""Iterated RLHF killed and resumed ends as the uninterrupted run, file for file: at a checkpoint
cadence (3) that does not divide the retraining cadence (2), before any checkpoint, inside a
round (its reward model trained, its swap requested), and with the run folder given relative to
another working directory or moved before the resume."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.human.iterate import Rounds

from ..engine.conftest import (
    KillWorkers,
    assert_same_run_files,
    back_to_checkpoint,
    read_jsonl,
)
from .test_iterate import _experiment

STEPS, EVERY = 6, 3  # rounds before steps 3 and 5, checkpoints after steps 3 and 6


def _rounds_swapped(out: Path) -> list[tuple[str, int]]:
    return [(r["request"], r["step"]) for r in read_jsonl(out / "swaps.jsonl")]


@pytest.mark.slow
def test_kills_before_a_checkpoint_inside_rounds_and_after_a_swap_resume_exactly(
    tmp_path: Path, base: str
) -> None:
    exp = _experiment(tmp_path, base, steps=STEPS, checkpoint_every=EVERY)
    workers = KillWorkers(tmp_path / "logs")
    try:
        full = tmp_path / "full"
        code, output = workers.run(exp, full, resume=False, kill_at=None)
        assert code == 0, output
        assert _rounds_swapped(full) == [("rlhf-round-1", 3), ("rlhf-round-2", 5)]

        killed = tmp_path / "killed"
        points = [
            "3:rlhf-request",  # round 1's swap requested, no checkpoint yet: starts over
            "5:rlhf-retrain",  # round 2's reward model trained: resumes from step 3
            "5:metrics",  # round 2's swap taken at step 5, killed after it: from step 3 again
        ]
        for i, point in enumerate(points):
            code, output = workers.run(exp, killed, resume=i > 0, kill_at=point)
            assert code == -signal.SIGKILL, f"kill at {point}: exit {code}\n{output}"
        code, output = workers.run(exp, killed, resume=True, kill_at=None)
        assert code == 0, output
    finally:
        workers.close()

    # The restart kept the killed attempt's requests and rounds aside, not in use.
    first = json.loads((killed / "attempts" / "1" / "attempt.json").read_text())
    assert first["kind"] == "restarted" and {"control", "rlhf"} <= set(first["files"])
    assert _rounds_swapped(killed) == [("rlhf-round-1", 3), ("rlhf-round-2", 5)]
    rounds = read_jsonl(killed / "rlhf_rounds.jsonl")
    assert [r["warm_start"] for r in rounds] == [str(tmp_path / "rm0"), "rlhf/rm-1"]
    assert all(r["judgements_stored"] == 3 * r["pairs_queued"] > 0 for r in rounds)
    assert_same_run_files(full, killed, "after kills at " + ", ".join(points))


@pytest.mark.slow
def test_a_run_folder_resumes_from_another_working_directory_and_after_a_move(
    tmp_path: Path, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    exp = _experiment(tmp_path, base, steps=STEPS, checkpoint_every=EVERY)
    loaded = load_experiment(exp)
    full = tmp_path / "full"
    assert run_one(loaded, "grpo", 0, full, rounds=Rounds).status == "finished"

    # Started with a relative --out ...
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(here)
    assert run_one(loaded, "grpo", 0, Path("relout"), rounds=Rounds).status == "finished"
    run = here / "relout"
    assert read_jsonl(run / "swaps.jsonl")[-1]["labeler"]["params"]["path"] == "rlhf/rm-2"
    # ... resumed from another folder by its absolute path, after the second swap was taken
    back_to_checkpoint(run, 3)
    monkeypatch.chdir(elsewhere)
    again = run_one(loaded, "grpo", 0, run.resolve(), resume=True, rounds=Rounds)
    assert again.status == "finished", again.error
    assert_same_run_files(full, run, "relative --out resumed from another folder")

    # Moved (as a restored mirror or a copied folder would be) and resumed where it lies now.
    back_to_checkpoint(run, 3)
    moved = tmp_path / "moved" / "run"
    moved.parent.mkdir()
    shutil.move(run, moved)
    again = run_one(loaded, "grpo", 0, moved, resume=True, rounds=Rounds)
    assert again.status == "finished", again.error
    assert_same_run_files(full, moved, "moved")
