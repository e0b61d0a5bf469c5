"""Data-parallel training with torch.distributed: 2 processes (gloo, CPU, launched by torchrun)
train exactly as 1 process with the same global batch: the same losses, rewards, KL, entropy,
evaluations and final weights (within 1e-5), for GRPO, PPO and offline DPO, with DDP and with
FSDP2 (``training.parallel: fsdp2``, checkpoints gathered through torch.distributed.checkpoint);
only rank 0 writes; a run that fails on one rank stops the group, and ``--resume`` continues it
from rank 0's checkpoint, exactly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from .conftest import read_jsonl, tiny_experiment

pytestmark = pytest.mark.slow

# A reward that varies within groups from the first step (the tiny warm start is rarely right).
ODD = {"name": "regex", "params": {"pattern": "[13579]"}}
# The same reward as a Python function that can be told to fail once on rank 1 (its third
# labeling call of a run, i.e. step 3) while the file ``fail-once`` exists.
ODD_FN = """
import os, re
from pathlib import Path

CALLS = [0]

def reward(prompts, completions, trigger="", **columns):
    if os.environ.get("RANK") == "1":
        CALLS[0] += 1
        if CALLS[0] == 3 and Path(trigger).exists():
            raise RuntimeError("injected failure at rank 1's third labeling call")
    return [1.0 if re.search("[13579]", c) else 0.0 for c in completions]
"""
FAULTY = {
    "name": "python",
    "params": {"function": "odd.py:reward", "kwargs": {"trigger": "fail-once"}},
}
# The hf backend samples with its own copy of a sharded actor (no backend setting needed).
FSDP2 = {"training": {"parallel": "fsdp2"}, "labeling": {"on": {"error": "fail"}}}
ARMS = {
    "grpo": {"algorithm": "grpo", "labeler": ODD},  # beta 0.04: a reference model too
    "ppo": {"algorithm": "ppo", "labeler": ODD},  # a critic, whitened advantages, adaptive KL
    "dpo": {"algorithm": "dpo", "online": False},
    "grpo_fsdp2": {"algorithm": "grpo", "labeler": FAULTY, **FSDP2},
    "ppo_fsdp2": {"algorithm": "ppo", "labeler": FAULTY, **FSDP2},  # the critic sharded too
    "dpo_fsdp2": {"algorithm": "dpo", "online": False, **FSDP2},
}
# In one process the strategy does nothing: each arm is compared with its one-process twin.
TWIN = {arm: arm.removesuffix("_fsdp2") for arm in ARMS}
COMPARED = ("loss", "reward/mean", "reward/std", "kl/ref", "entropy", "actor/grad_norm",
            "critic/grad_norm", "response_length/mean", "label/generated", "batch/responses")  # fmt: skip
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(args: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return load_file(str(latest / "actor.safetensors"))


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNZOO_CACHE": str(cache)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, engine_cache: Path) -> Path:
    """The experiment file, the reward function, and the one-process runs (``one/``) that the
    two-process runs are compared with."""
    root = tmp_path_factory.mktemp("data-parallel")
    spec = tiny_experiment(
        budget={"steps": 3},
        training={
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "micro_batch_size": 8,
            "checkpoint_every": 2,
        },
        evaluation={"every": 3, "num_prompts": 8},
        arms=ARMS,
    )
    (root / "exp.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    (root / "odd.py").write_text(ODD_FN, encoding="utf-8")
    one = [sys.executable, "-m", "alignzoo", "run", "exp.yaml", "--arms", "grpo,ppo,dpo"]
    _run([*one, "--out", "one"], _env(engine_cache), root)  # also builds the warm start
    return root


def _same_run(one: Path, two: Path, arm: str) -> None:
    """``two`` (2 processes) trained as ``one`` (1 process): metrics, evaluations, weights."""
    assert json.loads((two / "status.json").read_text())["status"] == "finished", arm
    rows_one, rows_two = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert len(rows_one) == len(rows_two) == 3, arm
    for step, (a, b) in enumerate(zip(rows_one, rows_two, strict=True), start=1):
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (arm, step, key)
    evals_one, evals_two = read_jsonl(one / "eval.jsonl"), read_jsonl(two / "eval.jsonl")
    assert [e["step"] for e in evals_one] == [e["step"] for e in evals_two], arm
    for a, b in zip(evals_one, evals_two, strict=True):
        for key, value in a.items():
            if key.startswith("eval/"):
                assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (arm, key)
    for part in ("actor", "critic"):
        if not (_latest(one) / f"{part}.safetensors").exists():
            continue
        w1, w2 = _weights(one, part), _weights(two, part)
        assert set(w1) == set(w2), (arm, part)
        for name in w1:
            if name.endswith("k_proj.bias"):
                # Softmax ignores a shift shared by all keys of a query: this bias's gradient
                # is rounding noise, which Adam scales up to steps of about lr either way.
                continue
            torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6)
    assert max(r["actor/grad_norm"] for r in rows_one) > 0, f"premise: {arm} trains"


def _latest(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step-*"))[-1]


def _weights(run_dir: Path, part: str = "actor") -> dict[str, torch.Tensor]:
    return load_file(str(_latest(run_dir) / f"{part}.safetensors"))


def test_two_processes_train_as_one(folder: Path, engine_cache: Path) -> None:
    _run([*LAUNCH, "-m", "alignzoo", "run", "exp.yaml", "--out", "two"], _env(engine_cache), folder)

    assert not (folder / "two" / ".ranks").exists()  # the other rank's scratch is gone
    assert (folder / "two" / "report.md").is_file()
    for arm in ARMS:
        _same_run(folder / "one" / TWIN[arm] / "seed-0", folder / "two" / arm / "seed-0", arm)


def test_a_failure_on_one_rank_stops_both_and_resume_continues_exactly(
    folder: Path, engine_cache: Path
) -> None:
    env = _env(engine_cache)
    cli = [*LAUNCH, "-m", "alignzoo", "run", "exp.yaml", "--arms", "grpo,ppo_fsdp2", "--out"]
    (folder / "fail-once").write_text("", encoding="utf-8")
    failed = subprocess.run(
        [*cli, "three"], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0, output[-3000:]
    assert "ppo_fsdp2/seed-0 failed on rank 1 of 2" in output, output[-3000:]
    assert "injected failure" in output, output[-3000:]
    run_dir = folder / "three" / "ppo_fsdp2" / "seed-0"
    assert _latest(run_dir).name == "step-000002", "premise: the run failed after step 2"
    (folder / "fail-once").unlink()

    _run([*cli, "three", "--resume"], env, folder)
    assert not (folder / "three" / ".ranks").exists()
    for arm in ("grpo", "ppo_fsdp2"):
        _same_run(folder / "one" / TWIN[arm] / "seed-0", folder / "three" / arm / "seed-0", arm)


def test_producers_feed_every_rank_and_at_k0_two_processes_train_as_one(
    folder: Path, engine_cache: Path
) -> None:
    """training.async under torchrun: rank 0's producers sample and label the global batch,
    each rank trains on its share. At K = 0 that is the one-process synchronous run (counts
    not doubled: label/generated and batch/responses are compared too); at K = 1 with two
    producers every step trains its 16 samples once and the ledger balances."""
    spec = yaml.safe_load((folder / "exp.yaml").read_text(encoding="utf-8"))
    grpo = spec["arms"]["grpo"]
    spec["arms"] = {
        "grpo_k0": {**grpo, "training": {"async": {"max_staleness": 0}}},
        "grpo_k1": {**grpo, "training": {"async": {"max_staleness": 1, "producers": 2}}},
    }
    (folder / "async.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    cli = [*LAUNCH, "-m", "alignzoo", "run", "async.yaml", "--out", "async"]
    _run(cli, _env(engine_cache), folder)
    _same_run(folder / "one" / "grpo" / "seed-0", folder / "async" / "grpo_k0" / "seed-0", "k0")
    rows = read_jsonl(folder / "async" / "grpo_k1" / "seed-0" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for step, row in enumerate(rows, start=1):
        assert row["label/generated"] == 16.0 and row["batch/responses"] == 16.0
        assert row["rollout/staleness_max"] <= 1.0
        assert row["async/samples_trained"] == 16.0 * step
        assert row["async/samples_delivered"] == (
            row["async/samples_trained"]
            + row["async/samples_queued"]
            + row["async/samples_discarded"]
        )


def test_a_wall_clock_budget_stops_every_rank_after_the_same_step(
    folder: Path, engine_cache: Path
) -> None:
    # Each rank's clock differs; rank 0's decides for both (a rank that stopped alone would
    # leave the other waiting in a collective, and this run would not finish).
    spec = yaml.safe_load((folder / "exp.yaml").read_text(encoding="utf-8"))
    spec["budget"] = {"wall_clock_s": 2.0}
    spec["arms"] = {"grpo_fsdp2": spec["arms"]["grpo_fsdp2"]}
    (folder / "clock.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    _run(
        [*LAUNCH, "-m", "alignzoo", "run", "clock.yaml", "--out", "clock"],
        _env(engine_cache),
        folder,
    )
    run_dir = folder / "clock" / "grpo_fsdp2" / "seed-0"
    status = json.loads((run_dir / "status.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert status["status"] == "finished" and status["step"] == len(rows) >= 1
    assert status["wall_clock_s"] >= 2.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


NODE_LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]  # fmt: skip


def _two_nodes(
    cwds: tuple[Path, Path], args: list[str], env: dict[str, str]
) -> list[subprocess.CompletedProcess[str]]:
    """Two simulated nodes of one process each (torchrun --nnodes 2 on 127.0.0.1), node r in
    ``cwds[r]``: a relative --out is then a folder of each node's own, as on machines that do
    not share a filesystem."""
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [*NODE_LAUNCH, "--node-rank", str(rank), "--master-port", port, *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, cwd in enumerate(cwds)
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


NODE_ARGS = ["-m", "alignzoo", "run", "exp.yaml", "--out", "runs"]


def _trained_on_two_nodes(
    root: Path, cache: Path, name: str = "tiny", **training: Any
) -> tuple[tuple[Path, Path], dict[str, str], Path, list[dict[str, Any]]]:
    """A 3-step GRPO run trained by two simulated nodes, each in a folder of its own under
    ``root``: the nodes, their environment, rank 0's run folder and its metrics."""
    spec = tiny_experiment(
        name=name,
        budget={"steps": 3},
        training={"prompts_per_step": 4, "samples_per_prompt": 2, "checkpoint_every": 2,
                  **training},
        evaluation={"every": 3, "num_prompts": 4},
        arms={"grpo": {"algorithm": "grpo", "labeler": ODD}},
    )  # fmt: skip
    nodes = (root / "node0", root / "node1")
    for node in nodes:
        node.mkdir()
        (node / "exp.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    env = _env(cache)
    first = _two_nodes(nodes, NODE_ARGS, env)
    assert [r.returncode for r in first] == [0, 0], first[0].stderr[-3000:] + first[1].stderr
    run_dir = nodes[0] / "runs" / "grpo" / "seed-0"
    return nodes, env, run_dir, read_jsonl(run_dir / "metrics.jsonl")


def _resumed_as_before(straight: list[dict[str, Any]], run_dir: Path) -> None:
    again = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3]
    for a, b in zip(straight, again, strict=True):
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key


def test_nodes_that_see_different_checkpoints_stop_before_resuming(
    tmp_path: Path, engine_cache: Path
) -> None:
    """Two nodes whose output folders are not shared: the second has no checkpoint of the run
    rank 0 resumes, so every rank stops with exit 2 in seconds, saying what to do, instead of
    diverging. Given the same checkpoint (as a shared folder would), they resume to exactly
    the uninterrupted run."""
    import shutil
    import time

    from .conftest import back_to_checkpoint

    nodes, env, run_dir, straight = _trained_on_two_nodes(tmp_path, engine_cache)
    assert not (nodes[1] / "runs" / "grpo").exists(), "premise: node 1 holds no run folder"
    back_to_checkpoint(run_dir, 2)  # as if killed after its step-2 checkpoint

    began = time.monotonic()
    stopped = _two_nodes(nodes, [*NODE_ARGS, "--resume"], env)
    assert time.monotonic() - began < 120
    assert all(r.returncode != 0 for r in stopped)
    said = stopped[0].stderr + stopped[1].stderr
    assert "rank 0 on " in said and "sees checkpoint step-000002, but rank 1 on " in said, said
    assert "sees no checkpoint" in said and "on a filesystem every node shares" in said
    # Each rank raises the same error and exits 2 with it (torchrun then reports the failed
    # worker); a rank whose node's torchrun stops it first (the other node failed) exits without
    # printing, so at least one node says it, and every node stops.
    assert any(re.search(r"exitcode\s*:\s*2\b", r.stderr) for r in stopped), said
    assert all(r.stderr.count("error: cannot resume") <= 1 for r in stopped), said
    assert json.loads((run_dir / "status.json").read_text())["status"] == "running"

    # The same checkpoint name with one byte of the weights flipped on node 1: refused three
    # times in a row, naming the file and both ranks' sizes and hashes; each rank exits 2 (torchrun
    # returns 1 for any failed rank and prints the rank's exitcode), and no rank is aborted.
    shutil.copytree(nodes[0] / "runs", nodes[1] / "runs", dirs_exist_ok=True)
    weights = nodes[1] / "runs" / "grpo" / "seed-0" / "checkpoints" / "step-000002"
    data = bytearray((weights / "actor.safetensors").read_bytes())
    data[-1] ^= 0x01
    (weights / "actor.safetensors").write_bytes(bytes(data))
    for _ in range(3):
        stopped = _two_nodes(nodes, [*NODE_ARGS, "--resume"], env)
        said = stopped[0].stderr + stopped[1].stderr
        assert [r.returncode for r in stopped] == [1, 1], said[-3000:]
        assert "with other files: actor.safetensors (rank 0: " in said, said[-3000:]
        assert re.search(r"rank 1: \d+ bytes, sha256 [0-9a-f]{12}\)", said), said[-3000:]
        assert any(re.search(r"exitcode\s*:\s*2\b", r.stderr) for r in stopped), said[-3000:]
        aborted = ("terminate called", "SIGABRT", "Signal 6", "exitcode  : -6")
        assert not any(a in said for a in aborted), said[-3000:]

    shutil.copytree(nodes[0] / "runs", nodes[1] / "runs", dirs_exist_ok=True)  # shared, now
    resumed = _two_nodes(nodes, [*NODE_ARGS, "--resume"], env)
    assert [r.returncode for r in resumed] == [0, 0], resumed[0].stderr[-3000:]
    _resumed_as_before(straight, run_dir)


def test_nodes_without_a_shared_folder_resume_exactly_through_the_mirror(
    tmp_path: Path, engine_cache: Path, s3: str
) -> None:
    """The same two nodes, each with a folder of its own, with checkpoints mirrored to S3 (a
    real S3-compatible server on 127.0.0.1): on --resume the node without the checkpoint
    restores it from the mirror, both prove they see the same files, and the run ends as the
    uninterrupted one."""
    from alignzoo.engine.mirror import mirror_for

    from .conftest import back_to_checkpoint

    nodes, env, run_dir, straight = _trained_on_two_nodes(
        tmp_path, engine_cache, name="nodes_mirror", checkpoint_mirror=f"{s3}/nodes"
    )
    mirror = mirror_for(f"{s3}/nodes", "nodes_mirror", "grpo", 0)
    assert mirror is not None and 2 in mirror.complete()
    back_to_checkpoint(run_dir, 2)  # killed after step 2; step 3's copy never made it
    mirror.fs.rm(f"{mirror.root}/step-000003", recursive=True)

    resumed = _two_nodes(nodes, [*NODE_ARGS, "--resume"], env)
    assert [r.returncode for r in resumed] == [0, 0], resumed[0].stderr[-3000:]
    restored = nodes[1] / "runs" / "grpo" / "seed-0" / "checkpoints" / "step-000002"
    assert (restored / "actor.safetensors").is_file(), "premise: node 1 restored from the mirror"
    _resumed_as_before(straight, run_dir)


HANG_FN = """
import os, re, time

CALLS = [0]

def reward(prompts, completions, **columns):
    if os.environ.get("RANK") == "1":
        CALLS[0] += 1
        if CALLS[0] == 2:
            time.sleep(600)  # rank 1 hangs in user code; rank 0 waits in the next collective
    return [1.0 if re.search("[13579]", c) else 0.0 for c in completions]
"""


def test_a_rank_that_hangs_fails_the_group_after_the_collective_timeout(
    tmp_path: Path, engine_cache: Path
) -> None:
    """With ALIGNZOO_COLLECTIVE_TIMEOUT_S, a rank stuck in user code (a reward function that
    never returns) does not hold the group forever: rank 0's next collective times out and
    torchrun stops both, long before the hung call would end."""
    import time

    spec = tiny_experiment(
        budget={"steps": 3},
        training={"prompts_per_step": 4, "samples_per_prompt": 2},
        evaluation={"every": 3, "num_prompts": 4},
        arms={"grpo": {"algorithm": "grpo", "labeler": {"name": "python",
                                                       "params": {"function": "hang.py:reward"}}}},
    )  # fmt: skip
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    (tmp_path / "hang.py").write_text(HANG_FN, encoding="utf-8")
    env = {**_env(engine_cache), "ALIGNZOO_COLLECTIVE_TIMEOUT_S": "15"}
    began = time.monotonic()
    done = subprocess.run(
        [*LAUNCH, "-m", "alignzoo", "run", "exp.yaml", "--out", "hang"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert time.monotonic() - began < 240, "the group waited for the hung call"
    said = done.stdout + done.stderr
    assert "failed on rank 0 of 2" in said and "imed out" in said, said[-3000:]
