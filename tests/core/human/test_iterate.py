"""Iterated RLHF at a tiny size, end to end: rounds sample the live policy's pairs into the
queue, simulated annotators judge them, the reward model is retrained on every agreed pair so
far (warm-started from the one in use) and hot-swapped in; a run SIGKILLed between the
retraining and the swap resumes without losing or re-asking a judgement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from alignzoo.config.schema import IterateConfig
from alignzoo.human.iterate import due
from alignzoo.human.queue import HumanQueue
from alignzoo.human.reward_model import train_reward_model

from ..engine.conftest import read_jsonl, tiny_experiment
from .test_rlhf_pipeline import ANNOTATORS as PIPELINE_ANNOTATORS
from .test_train_rm import _pairs

# The pipeline test's annotators, every one of whom judges every pair (no "cannot judge"), so
# each round's pairs get exactly three judgements.
ANNOTATORS = {
    **PIPELINE_ANNOTATORS,
    "annotators": [
        {k: v for k, v in a.items() if k != "cannot_judge"}
        for a in PIPELINE_ANNOTATORS["annotators"]
    ],
}


def test_iterate_needs_an_arm_labeled_by_a_reward_model() -> None:
    from pydantic import ValidationError

    from alignzoo.config.schema import ArmSpec

    with pytest.raises(ValidationError, match="the labeler must be reward_model"):
        ArmSpec.model_validate({"algorithm": "ppo", "labeling": {"iterate": {"every": 2}}})


def test_a_round_is_due_after_every_n_steps_but_not_after_the_last() -> None:
    cfg = IterateConfig(every=2)
    assert [due(cfg, step, 6) for step in range(1, 8)] == [None, None, 1, None, 2, None, None]
    assert due(cfg, 7) == 3  # no step budget: every multiple


def _experiment(tmp_path: Path, base_model: str, steps: int = 5, checkpoint_every: int = 2) -> Path:
    """An iterated-RLHF experiment (a round every 2 steps) in ``tmp_path``; its first reward
    model is trained there once."""
    if not (tmp_path / "rm0").is_dir():
        _pairs(tmp_path / "prefs.jsonl")
        train_reward_model(
            tmp_path / "prefs.jsonl", base_model, tmp_path / "rm0", epochs=1, lr=3e-3
        )
        (tmp_path / "annotators.yaml").write_text(yaml.safe_dump(ANNOTATORS), encoding="utf-8")
    spec = tiny_experiment(
        name="iterated",
        budget={"steps": steps},
        training={"checkpoint_every": checkpoint_every},
        evaluation={"every": 5, "num_prompts": 4},
        arms={
            "grpo": {
                "algorithm": "grpo",
                "labeler": {"name": "reward_model", "params": {"path": str(tmp_path / "rm0")}},
                "labeling": {
                    "iterate": {
                        "every": 2,
                        "prompts": 8,
                        "annotators": str(tmp_path / "annotators.yaml"),
                        "data": str(tmp_path / "prefs.jsonl"),
                        "epochs": 1,
                        "lr": 3e-3,
                        "min_heldout_accuracy": 0.0,
                    }
                },
            }
        },
    )
    path = tmp_path / f"exp-{steps}-{checkpoint_every}.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return path


# Runs one arm; with KILL set, SIGKILLs itself right after round KILL's retraining returned
# (before its swap is requested).
WORKER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.loop import run_one
    from alignzoo.human import iterate

    kill = int(os.environ.get("KILL", "0"))
    original = iterate.Rounds._retrain

    def retrain(self, k, current, out):
        original(self, k, current, out)
        if k == kill:
            os.kill(os.getpid(), signal.SIGKILL)

    iterate.Rounds._retrain = retrain
    exp, out, resume = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
    summary = run_one(
        load_experiment(exp), "grpo", 0, out, resume=resume, rounds=iterate.Rounds
    )
    print(summary.status, summary.error)
    sys.exit(0 if summary.status == "finished" else 1)
    """
)


def _run(exp: Path, out: Path, resume: bool, kill: int = 0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KILL": str(kill)}
    return subprocess.run(
        [sys.executable, "-c", WORKER, str(exp), str(out), "1" if resume else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _judgements(queue_dir: Path) -> list[tuple[int, str, float | None]]:
    queue = HumanQueue(queue_dir)
    try:
        return sorted(
            (item.id, rater, value) for item, given in queue.items() for rater, value in given
        )
    finally:
        queue.close()


@pytest.mark.slow
def test_rounds_retrain_and_swap_and_a_kill_between_retrain_and_swap_resumes(
    tmp_path: Path, base: str
) -> None:
    exp = _experiment(tmp_path, base)
    out = tmp_path / "run"
    killed = _run(exp, out, resume=False, kill=1)
    assert killed.returncode == -9, killed.stderr[-3000:]
    rlhf = out / "rlhf"
    assert (rlhf / "rm-1" / "train_rm.json").is_file()  # retrained ...
    assert not (out / "control" / "labeler.yaml").exists()  # ... but not yet swapped
    items = json.loads((rlhf / "round-1.json").read_text())["items"]
    judged_before = _judgements(rlhf / "queue")
    assert items and len(judged_before) == 3 * len(items), "premise: every pair judged by 3"
    trained_at = (rlhf / "rm-1" / "train_rm.json").stat().st_mtime_ns

    done = _run(exp, out, resume=True)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])

    # Round 1 again, from its files: the same pairs, no judgement asked twice or lost, the
    # reward model it trained before the kill (not trained again), then swapped in.
    assert json.loads((rlhf / "round-1.json").read_text())["items"] == items
    judged = _judgements(rlhf / "queue")
    assert [j for j in judged if j[0] in items] == judged_before
    assert (rlhf / "rm-1" / "train_rm.json").stat().st_mtime_ns == trained_at
    rounds = read_jsonl(out / "rlhf_rounds.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]  # each once, after steps 2 and 4
    assert [r["after_step"] for r in rounds] == [2, 4]
    # every pair's three judgements, those given before the kill included
    assert [r["judgements_stored"] for r in rounds] == [3 * r["pairs_queued"] for r in rounds]
    assert rounds[1]["judgements_stored"] > 0
    assert all(r["swapped"] for r in rounds)
    # round 2 warm-starts from round 1's reward model and trains on more pairs
    assert rounds[0]["warm_start"] == str(tmp_path / "rm0")
    assert rounds[1]["warm_start"] == "rlhf/rm-1"  # inside the run folder: relative to it
    assert rounds[1]["training_pairs"] > rounds[0]["training_pairs"]
    # the swaps went through the hot-swap machinery, once each
    swaps = read_jsonl(out / "swaps.jsonl")
    assert [(s["request"], s["status"]) for s in swaps] == [
        ("rlhf-round-1", "applied"),
        ("rlhf-round-2", "applied"),
    ]
    assert swaps[1]["labeler"]["params"]["path"] == "rlhf/rm-2"
    assert swaps[1]["labeler"]["run_relative"] == ["path"]
    assert json.loads((out / "status.json").read_text())["status"] == "finished"
