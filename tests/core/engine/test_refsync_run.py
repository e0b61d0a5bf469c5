"""Runs with a moving reference (``training.sync_ref_model``): a run stopped after a checkpoint
(or SIGKILLed, twice) and resumed writes the uninterrupted run's metrics and evaluations (grpo,
offline dpo, kto, a LoRA grpo arm, whose reference is then a copy of its own, and grpo with
labeling.overlap); the syncs fall after exactly the optimizer steps whose count is a multiple
of ``ref_model_sync_steps``, also inside a step of several optimizer steps; ``alignzoo run`` of
dpo, grpo, kto and LoRA grpo arms with a hard sync (alpha 1) shows the reference's log-probs
catching up with the policy's (``kl/ref`` is 0 and DPO's loss log 2 right after each sync, and
the checkpoint of a sync's step holds a reference equal to the actor); and two torchrun
processes (DDP, FSDP2) move the reference as one process does."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys

import pytest
import yaml
from safetensors.torch import load_file

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

pytestmark = pytest.mark.slow

VOLATILE = ("time_s", "timing/", "throughput/", "labeler/")
SYNCS = "reference/syncs"
FILES = ("actor", "reference")
ARMS = {
    "grpo": {"algorithm": "grpo", "labeler": "arithmetic"},
    "dpo": {"algorithm": "dpo", "online": False},
    "kto": {"algorithm": "kto"},
    "grpo_lora": {"algorithm": "grpo", "model": {"lora": {"r": 2, "alpha": 4}}},
    "grpo_overlap": {"algorithm": "grpo", "labeling": {"overlap": True}},
}


def _stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.parametrize("arm", list(ARMS))
def test_a_run_with_a_moving_reference_resumes_exactly(write_experiment, tmp_path, arm) -> None:
    # Syncs after optimizer steps 3 and 6, checkpoints at 4 and 7: the resumed run must load the
    # reference moved at step 3 and sync again at step 6, counting from the checkpoint's.
    spec = tiny_experiment(
        budget={"steps": 7},
        training={"checkpoint_every": 4, "sync_ref_model": True, "ref_model_sync_steps": 3},
        evaluation={"every": 2},
        arms={arm: ARMS[arm]},
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, arm, 0, out).status == "finished"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r[SYNCS] for r in rows] == [0, 0, 1, 1, 1, 2, 2]
    # premise: the policy leaves its reference (with labeling.overlap the reference scores a
    # batch as it is generated, a step ahead, on the weights before step 1's update)
    assert all(r["kl/ref"] > 0 for r in rows[2:]), [r["kl/ref"] for r in rows]
    reference, evaluations = _stable(rows), _stable(read_jsonl(out / "eval.jsonl"))
    assert (out / "checkpoints" / "step-000004" / "reference.safetensors").is_file()

    back_to_checkpoint(out, 4)
    assert run_one(loaded, arm, 0, out, resume=True).status == "finished"
    assert _stable(read_jsonl(out / "metrics.jsonl")) == reference
    assert _stable(read_jsonl(out / "eval.jsonl")) == evaluations


def test_a_run_with_a_moving_reference_killed_twice_resumes_exactly(
    write_experiment, tmp_path, kill_workers
) -> None:
    # SIGKILLs after step 5's metrics (the reference moved at step 3 is in checkpoint 4), then
    # while checkpoint 6 is written, between actor.safetensors and reference.safetensors (the
    # half-written folder is never renamed into place: the run resumes from 4 again).
    spec = tiny_experiment(
        budget={"steps": 7},
        training={"checkpoint_every": 2, "sync_ref_model": True, "ref_model_sync_steps": 3},
        evaluation={"every": 2},
        arms={"grpo": ARMS["grpo"]},
    )
    exp = write_experiment(spec)
    full, killed = tmp_path / "full", tmp_path / "killed"
    code, output = kill_workers.run(exp, full, resume=False, kill_at=None)
    assert code == 0, output
    for i, point in enumerate(["5:metrics", "6:ckpt-actor"]):
        code, output = kill_workers.run(exp, killed, resume=i > 0, kill_at=point)
        assert code == -signal.SIGKILL, f"kill at {point}: exit {code}\n{output}"
    code, output = kill_workers.run(exp, killed, resume=True, kill_at=None)
    assert code == 0, output
    for name in ("metrics.jsonl", "eval.jsonl", "samples.jsonl"):
        assert _stable(read_jsonl(killed / name)) == _stable(read_jsonl(full / name)), name
    rows = read_jsonl(killed / "metrics.jsonl")
    assert [r[SYNCS] for r in rows] == [0, 0, 1, 1, 1, 2, 2]


def test_the_syncs_fall_after_the_counted_optimizer_steps(write_experiment, tmp_path) -> None:
    # Two optimizer steps per training step (minibatches of 8 of the 16 samples), a hard sync
    # every 3: after optimizer steps 3 (inside step 2), 6 (the end of step 3), 9 (inside step
    # 5) and 12 (the end of step 6). A step starting right after a sync starts at the reference.
    spec = tiny_experiment(
        budget={"steps": 7},
        training={
            "minibatch_size": 8,
            "sync_ref_model": True,
            "ref_model_mixup_alpha": 1.0,
            "ref_model_sync_steps": 3,
        },
        arms={"grpo": ARMS["grpo"]},
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r[SYNCS] for r in rows] == [0, 1, 2, 2, 3, 4, 4]
    at_reference = [r["step"] for r in rows if r["kl/ref"] == pytest.approx(0.0, abs=1e-7)]
    assert at_reference == [1, 4, 7], [r["kl/ref"] for r in rows]


def test_alignzoo_run_shows_the_reference_catching_up(tmp_path, engine_cache) -> None:
    spec = tiny_experiment(
        budget={"steps": 5},
        training={"sync_ref_model": True, "ref_model_mixup_alpha": 1.0, "ref_model_sync_steps": 2},
        arms={arm: ARMS[arm] for arm in ("dpo", "grpo", "kto", "grpo_lora")},
    )
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "alignzoo", "run", "exp.yaml", "--out", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "ALIGNZOO_CACHE": str(engine_cache)},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for arm in ("dpo", "grpo", "kto", "grpo_lora"):
        run = tmp_path / "out" / arm / "seed-0"
        rows = read_jsonl(run / "metrics.jsonl")
        assert [r[SYNCS] for r in rows] == [0, 1, 1, 2, 2], arm
        kl = [r["kl/ref"] for r in rows]
        # after the hard syncs of optimizer steps 2 and 4 the reference is the policy again
        assert [kl[0], kl[2], kl[4]] == pytest.approx([0.0] * 3, abs=1e-7), (arm, kl)
        assert kl[1] > 1e-6 and kl[3] > 1e-6, (arm, kl)
        if arm == "dpo":  # no margin against the reference: -log sigmoid(0)
            for row in (rows[0], rows[2], rows[4]):
                assert row["loss"] == pytest.approx(math.log(2), abs=1e-6)
        if arm == "grpo_lora":  # its checkpoints hold the adapters, its reference whole
            continue
        synced = run / "checkpoints" / "step-000004"  # the sync of optimizer step 4 copied it
        actor, reference = (load_file(str(synced / f"{f}.safetensors")) for f in FILES)
        assert set(reference) <= set(actor) and reference
        assert all((reference[k] == actor[k]).all() for k in reference), arm


def test_two_processes_move_the_reference_as_one(tmp_path, engine_cache) -> None:
    """Under torchrun (2 processes, gloo) every rank syncs its whole reference after the same
    optimizer steps: with DDP, and with an FSDP2-sharded actor whose shards are gathered for
    it, the runs write the one-process run's metrics, weights and reference."""
    import torch

    from .test_data_parallel import LAUNCH, ODD, _env, _latest, _run, _same_run

    arms = {
        "grpo": {"algorithm": "grpo", "labeler": ODD},
        "dpo": ARMS["dpo"],
        "dpo_fsdp2": {**ARMS["dpo"], "training": {"parallel": "fsdp2"}},
    }
    spec = tiny_experiment(
        budget={"steps": 3},
        training={"checkpoint_every": 2, "sync_ref_model": True, "ref_model_sync_steps": 2},
        evaluation={"every": 3},
        arms=arms,
    )
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    env = _env(engine_cache)
    single = [sys.executable, "-m", "alignzoo", "run", "exp.yaml", "--arms", "grpo,dpo"]
    _run([*single, "--out", "one"], env, tmp_path)
    _run([*LAUNCH, "-m", "alignzoo", "run", "exp.yaml", "--out", "two"], env, tmp_path)
    for arm in arms:
        one = tmp_path / "one" / arm.removesuffix("_fsdp2") / "seed-0"
        two = tmp_path / "two" / arm / "seed-0"
        _same_run(one, two, arm)
        syncs = [[r[SYNCS] for r in read_jsonl(run / "metrics.jsonl")] for run in (one, two)]
        assert syncs[0] == syncs[1] == [0, 1, 1], arm
        expected, got = (
            load_file(str(_latest(run) / "reference.safetensors")) for run in (one, two)
        )
        assert set(got) == set(expected), arm
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6, msg=name)
