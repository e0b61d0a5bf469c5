"""Kill -9 a run after its second checkpoint, resume it, and get exactly the uninterrupted metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import read_jsonl, tiny_experiment

ROOT = Path(__file__).resolve().parents[3]
VOLATILE = ("timing/", "throughput/", "labeler/")


def _worker(exp: Path, out: Path, resume: bool) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.core.engine._resume_worker",
            str(exp),
            "ppo",
            "3",
            str(out),
            "1" if resume else "0",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stable(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k != "time_s" and not k.startswith(VOLATILE)} for r in rows
    ]


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(write_experiment, tmp_path) -> None:
    spec = tiny_experiment(
        budget={"steps": 10},
        training={"checkpoint_every": 2, "micro_batch_size": 8, "epochs": 2, "minibatch_size": 8},
        evaluation={"every": 3, "num_prompts": 8, "pass_at_k": 2},
        arms={"ppo": {"algorithm": {"name": "ppo", "params": {"kl_controller": "adaptive"}}}},
    )
    exp = write_experiment(spec)
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = _worker(exp, full, resume=False)
    assert proc.wait(timeout=300) == 0, proc.stdout.read()

    proc = _worker(exp, killed, resume=False)
    latest = killed / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() == "step-000004":
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [r["step"] for r in read_jsonl(killed / "metrics.jsonl")]
    assert 4 <= max(done) < 10

    proc = _worker(exp, killed, resume=True)
    assert proc.wait(timeout=300) == 0, proc.stdout.read()

    for name in ("metrics.jsonl", "eval.jsonl", "samples.jsonl"):
        expected, got = read_jsonl(full / name), read_jsonl(killed / name)
        assert _stable(got) == _stable(expected), name
    steps = [r["step"] for r in read_jsonl(killed / "metrics.jsonl")]
    assert steps == list(range(1, 11))
    assert [r["step"] for r in read_jsonl(killed / "eval.jsonl")] == [0, 3, 6, 9, 10]
    # time_s keeps counting across the resume
    times = [r["time_s"] for r in read_jsonl(killed / "metrics.jsonl")]
    assert times == sorted(times)
    # the last two checkpoints kept (the latest is the end), and the best evaluated one:
    # of the evaluated steps (0, 3, 6, 9, 10) 6 and 10 had a checkpoint (every 2 steps)
    kept = sorted(p.name for p in (killed / "checkpoints").glob("step-*"))
    exact = {r["step"]: r["eval/exact_match"] for r in read_jsonl(killed / "eval.jsonl")}
    best = 6 if exact[6] >= exact[10] else 10  # the earliest of equals
    assert kept == sorted({"step-000008", "step-000010", f"step-{best:06d}"})


PHASES = ("label", "eval", "metrics", "ckpt-actor", "ckpt-trainer", "ckpt-latest")


@pytest.mark.slow
def test_sigkill_at_20_random_points_then_resume_matches(
    write_experiment, tmp_path, kill_workers
) -> None:
    """Twenty SIGKILLs, each at a random step and point (inside labeling, inside an
    evaluation, after a metrics line, and at three moments of writing a checkpoint), each
    followed by --resume: the run ends with exactly the uninterrupted run's history."""
    import random

    steps = 24
    spec = tiny_experiment(
        budget={"steps": steps},
        training={"checkpoint_every": 3},
        evaluation={"every": 4, "num_prompts": 8},
    )
    exp = write_experiment(spec)
    full, killed = tmp_path / "full", tmp_path / "killed"
    code, output = kill_workers.run(exp, full, resume=False, kill_at=None)
    assert code == 0, output

    rng = random.Random(20)
    # Increasing kill steps over the run, so every resume makes progress; checkpoint and
    # evaluation phases only where that step writes one.
    kill_steps = sorted(rng.sample(range(1, steps), 20))
    points = []
    for step in kill_steps:
        phases = ["label", "metrics"]
        phases += ["eval"] if step % 4 == 0 else []
        phases += ["ckpt-actor", "ckpt-trainer", "ckpt-latest"] if step % 3 == 0 else []
        points.append(f"{step}:{rng.choice(phases)}")
    assert {p.split(":")[1] for p in points} >= {"label", "metrics"}
    assert any(p.split(":")[1].startswith("ckpt") for p in points)

    for i, point in enumerate(points):
        code, output = kill_workers.run(exp, killed, resume=i > 0, kill_at=point)
        assert code == -signal.SIGKILL, f"kill at {point}: exit {code}\n{output}"
    code, output = kill_workers.run(exp, killed, resume=True, kill_at=None)
    assert code == 0, output

    for name in ("metrics.jsonl", "eval.jsonl", "samples.jsonl"):
        expected, got = read_jsonl(full / name), read_jsonl(killed / name)
        assert _stable(got) == _stable(expected), f"{name} after kills at {points}"
    assert [r["step"] for r in read_jsonl(killed / "metrics.jsonl")] == list(range(1, steps + 1))


class CallLog:
    """ASGI middleware: every (prompt, response) the server is asked to score, in order."""

    def __init__(self, app: Any) -> None:
        self.app, self.scored, self.lock = app, [], threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/score":
            await self.app(scope, receive, send)
            return
        body: list[bytes] = []

        async def read() -> dict[str, Any]:
            message = await receive()
            body.append(message.get("body", b""))
            return message

        await self.app(scope, read, send)
        with self.lock:
            for item in json.loads(b"".join(body))["requests"]:
                self.scored.append(json.dumps([item["prompt"], item["response"]]))


@pytest.mark.slow
def test_sigkill_during_labeling_then_resume_scores_no_sample_twice(
    write_experiment, tmp_path, kill_workers
) -> None:
    """A run labeling through a real labeler server, in calls of 4 requests, SIGKILLed between
    two calls of a step three times: every call's labels were stored as it returned, so the
    resumed runs replay from the label store, the server's call log holds each (prompt,
    response) once, the same set as an uninterrupted run's, and the history is the
    uninterrupted one."""
    from alignzoo.labeling.service import ServeConfig, build_app

    from ..labeling.test_labeler_server import ARITHMETIC, running

    servers = {name: CallLog(build_app(ServeConfig.model_validate(ARITHMETIC))) for name in ("full", "killed")}  # fmt: skip
    full, killed = tmp_path / "full", tmp_path / "killed"
    with running(servers["full"]) as full_url, running(servers["killed"]) as killed_url:
        exps = {}
        for name, url in (("full", full_url), ("killed", killed_url)):
            spec = tiny_experiment(
                budget={"steps": 12},
                training={"checkpoint_every": 3},
                evaluation={"every": 4, "num_prompts": 8},
                arms={
                    "grpo": {
                        "algorithm": "grpo",
                        "labeler": {"name": "http", "params": {"url": url}},
                        "labeling": {"batch_size": 4},
                    }
                },
            )
            exps[name] = write_experiment(spec, name=f"{name}.yaml")
        code, output = kill_workers.run(exps["full"], full, resume=False, kill_at=None)
        assert code == 0, output
        for i, point in enumerate(("2:label-2", "5:label-2", "10:label-2")):
            code, output = kill_workers.run(exps["killed"], killed, resume=i > 0, kill_at=point)
            assert code == -signal.SIGKILL, output
        code, output = kill_workers.run(exps["killed"], killed, resume=True, kill_at=None)
        assert code == 0, output

    scored = servers["killed"].scored
    assert len(scored) == len(set(scored)), "the server scored a sample twice"
    assert sorted(scored) == sorted(servers["full"].scored)
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert _stable(read_jsonl(killed / name)) == _stable(read_jsonl(full / name)), name


@pytest.mark.slow
def test_a_resume_trains_with_the_thread_count_its_checkpoint_records(
    write_experiment, tmp_path, monkeypatch
) -> None:
    # The same process, another count (as when the run was started in a worker of --jobs N
    # and is resumed alone in the main process): the run keeps its own.
    import torch

    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.checkpoint import recorded_threads
    from alignzoo.engine.loop import run_one
    from alignzoo.provenance import read_sessions

    from .conftest import back_to_checkpoint

    loaded = load_experiment(write_experiment(tiny_experiment(budget={"steps": 4})))
    first = torch.get_num_threads()
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    assert recorded_threads(out / "checkpoints" / "step-000004") == first
    back_to_checkpoint(out, 2)  # as if killed after the checkpoint of step 2

    monkeypatch.setenv("OMP_NUM_THREADS", str(first + 1))
    torch.set_num_threads(first + 1)
    try:
        assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
        # this process gets its own count back for whatever it runs next
        assert torch.get_num_threads() == first + 1
        assert os.environ["OMP_NUM_THREADS"] == str(first + 1)
    finally:
        torch.set_num_threads(first)
    sessions = read_sessions(out)
    assert [s["threads"] for s in sessions] == [first, first]
    assert sessions[1]["omp_num_threads"] == str(first)  # and processes it started had it too
    assert recorded_threads(out / "checkpoints" / "step-000004") == first
