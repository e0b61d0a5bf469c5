"""The openenv environment against the real package: an OpenEnv environment served with
create_app on 127.0.0.1 plays episodes through the hooks and trains a few steps, in process
too; a server that dies mid-episode fails those episodes, never the run."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.rollout.episode import Turn

from ...core.engine.conftest import episode_experiment, read_jsonl
from ...core.engine.test_episodes_run import chat_policy  # noqa: F401 - a fixture

pytest.importorskip("openenv.core", reason="the openenv extra is not installed")

from alignzoo.plugins.environments.openenv import OpenEnvEnvironment

SERVER = Path(__file__).with_name("openenv_says.py")
IN_PROCESS = f"{SERVER}:Says"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def serve():
    started = []

    def start(die_after: int = 0) -> str:
        port = free_port()
        process = subprocess.Popen([sys.executable, str(SERVER), str(port), str(die_after)])
        started.append(process)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return f"http://127.0.0.1:{port}"
            time.sleep(0.1)
        raise AssertionError("the OpenEnv server did not start")

    yield start
    for process in started:
        process.kill()
        process.wait()


async def play(env, seed):
    start = await env.env_reset(row={"prompt": "Hello."}, seed=seed)
    first = await env.env_step(state=start.state, turn=Turn("abc"))
    last = await env.env_step(state=start.state, turn=Turn("abcde", index=1))
    await env.env_close(state=start.state)
    return start, first, last


@pytest.mark.parametrize("where", ["server", "in process"])
def test_an_episode_through_the_hooks(serve, where):
    params = {"url": serve()} if where == "server" else {"environment": IN_PROCESS}
    start, first, last = asyncio.run(play(OpenEnvEnvironment(params), 3))
    assert start.messages[0]["content"] == "Hello.\n\nSay something (round 3)."
    assert first.messages == [{"role": "user", "content": "heard 3 characters"}]
    assert first.reward == pytest.approx(1 / 3) and not first.done
    assert last.done and last.reward == 1.0


def test_a_slow_environment_in_process_holds_its_episode_not_the_others():
    env = OpenEnvEnvironment({"environment": f"{SERVER}:SlowSays"})

    async def three():
        starts = [await env.env_reset(row={}, seed=s) for s in range(3)]
        began = time.monotonic()
        await asyncio.gather(*(env.env_step(state=x.state, turn=Turn("hi")) for x in starts))
        return time.monotonic() - began

    assert asyncio.run(three()) < 2.5  # three 1-second steps side by side, not one after another


def spec(policy, environment, steps=2):
    return episode_experiment(
        policy, "says", {"name": "openenv", "params": environment}, steps,
        max_tokens=256, step_timeout_s=20, on_failure="drop_sample",
    )  # fmt: skip


def run(tmp_path, experiment):
    path = tmp_path / "says.yaml"
    path.write_text(yaml.safe_dump(experiment))
    summary = run_one(load_experiment(path), "says", 0, tmp_path / "run")
    return summary, read_jsonl(tmp_path / "run" / "metrics.jsonl")


def test_an_arm_trains_against_a_served_openenv_environment(serve, tmp_path, chat_policy):  # noqa: F811
    summary, rows = run(tmp_path, spec(chat_policy, {"url": serve()}))
    assert summary.status == "finished", summary.error
    assert len(rows) == 2 and all(r["env/done_frac"] == 1.0 for r in rows)
    assert all(r["label/valued"] == 4.0 and r["env/turns"] == 2.0 for r in rows)


def test_a_server_that_dies_mid_episode_fails_episodes_not_the_run(serve, tmp_path, chat_policy):  # noqa: F811
    # Evaluation at step 0 plays 2 episodes (4 steps); the server dies at its 6th step, inside
    # the first training step's episodes.
    summary, rows = run(tmp_path, spec(chat_policy, {"url": serve(die_after=6)}, steps=3))
    assert summary.status == "finished", summary.error
    assert rows[0]["env/error_frac"] > 0  # the episodes in flight when it died
    assert rows[-1]["env/error_frac"] == 1.0  # later ones cannot connect: errors, not a crash
