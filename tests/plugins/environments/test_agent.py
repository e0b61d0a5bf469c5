"""The agent environment's programs: what each way an agent can fail becomes (an outcome, a
policy for its samples, never a stalled step), its process group killed at the limit, and the
refusals at validate. The agents are small Python programs written to a temporary folder,
calling the gateway with the openai SDK as any agent would; the policy is the tiny untrained
embedded model on the hf backend (what the agents' calls sample does not matter here)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from alignzoo.config.schema import EpisodeConfig
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.plugins.environments.agent import AgentEnvironment
from alignzoo.registry import build_plugin_manager
from alignzoo.rollout.agents import AgentEpisodes
from alignzoo.types import SamplingParams
from tests.core.tiny_world import build_world

ROOT = Path(__file__).resolve().parents[3]

CALL = """
import json, os, sys, time
from openai import OpenAI
task = json.loads(sys.stdin.read())
assert task == json.loads(os.environ["ALIGNZOO_TASK"])
api = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
def ask():
    return api.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}]
    ).choices[0].message.content
"""


@pytest.fixture(scope="module")
def world():
    model, tokenizer = build_world()
    backend = HFBackend()
    backend.on_run_start(SimpleNamespace(tokenizer=tokenizer, device=lambda r: "cpu", actor=model))
    return build_plugin_manager([backend]), tokenizer


def agent_program(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(CALL + textwrap.dedent(body))
    return path


def run_agents(world, tmp_path, body, rows=2, n=1, on_failure="drop_sample", **params):
    pm, tokenizer = world
    script = agent_program(tmp_path, "agent", body)
    environment = AgentEnvironment({"command": ["python", str(script)], **params})
    runner = AgentEpisodes(
        EpisodeConfig(codec="brackets", max_tokens=64, on_failure=on_failure),
        tokenizer,
        environment.agent_settings(),
        None,
    )
    prompts = [f"{i}+{i}=" for i in range(rows)]
    extras = [{"answer": str(2 * i), "flag": str(tmp_path / f"flag-{i}")} for i in range(rows)]
    started = time.monotonic()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    batch, metrics = runner.run(pm, prompts, extras, n, sampling, list(range(rows)))
    return batch, metrics, time.monotonic() - started


def test_an_agent_that_exits_cleanly_after_calling_is_done_and_sees_its_task(world, tmp_path):
    batch, metrics, _ = run_agents(
        world, tmp_path, "ask(); ask(); print('answered', task['answer'])"
    )
    assert metrics["env/done_frac"] == 1.0 and metrics["env/agent/calls"] == 2.0
    # the same request twice is two samples of it (the second a branch), each trained once
    assert batch.size == 4 and metrics["env/agent/branches"] == 1.0
    outputs = [e["agent"]["output"].strip() for e in batch.extras]
    assert outputs == ["answered 0", "answered 0", "answered 2", "answered 2"]
    assert all(e["agent"]["exit_code"] == 0 for e in batch.extras)


def test_a_crash_a_silent_exit_and_a_flood_are_outcomes(world, tmp_path):
    crash, m_crash, _ = run_agents(world, tmp_path, "ask(); sys.exit(3)")
    assert m_crash["env/error_frac"] == 1.0 and crash.size == 0  # drop_sample
    silent, m_silent, _ = run_agents(world, tmp_path, "pass")
    assert m_silent["env/no_calls_frac"] == 1.0 and silent.size == 0
    _, m_flood, seconds = run_agents(
        world, tmp_path, "while True: ask()", max_calls=5, time_limit_s=60
    )
    assert m_flood["env/calls_limit_frac"] == 1.0 and m_flood["env/agent/calls"] == 6.0
    assert m_flood["env/agent/refused"] == 1.0 and seconds < 30  # killed, not waited for
    kept, m_kept, _ = run_agents(world, tmp_path, "ask(); raise SystemExit(3)", on_failure="keep")
    assert kept.size == 2 and m_kept["env/kept_frac"] == 1.0
    assert "exited with code 3" in kept.extras[0]["episode"]["reason"]


def test_a_hung_agent_is_killed_with_its_process_group_at_the_time_limit(world, tmp_path):
    body = """
    import subprocess
    ask()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(task["flag"], "w").write(str(child.pid))
    time.sleep(600)
    """
    batch, metrics, seconds = run_agents(world, tmp_path, body, time_limit_s=3)
    assert metrics["env/timeout_frac"] == 1.0 and batch.size == 0
    assert seconds < 30
    for i in range(2):
        pid = int((tmp_path / f"flag-{i}").read_text())
        assert not _running(pid), f"the agent's child {pid} outlived its episode"


def _running(pid: int) -> bool:
    for _ in range(100):
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False
        if "State:\tZ" in state:  # killed, waiting for its parent to reap it
            return False
        time.sleep(0.05)
    return True


def test_drop_group_drops_the_failed_episodes_group_and_drop_sample_only_it(world, tmp_path):
    # the first of each group's two episodes to take the flag crashes after its call
    body = """
    ask()
    try:
        os.close(os.open(task["flag"], os.O_CREAT | os.O_EXCL))
        sys.exit(1)
    except FileExistsError:
        pass
    """
    sample, m_sample, _ = run_agents(world, tmp_path / "a", body, rows=2, n=2)
    assert m_sample["env/error_frac"] == 0.5 and sample.size == 2
    assert sorted(sample.group_ids.tolist()) == [0, 1]
    group, m_group, _ = run_agents(
        world, tmp_path / "b", body, rows=2, n=2, on_failure="drop_group"
    )
    assert m_group["env/error_frac"] == 0.5 and group.size == 0


@pytest.fixture(autouse=True)
def _folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()


def validate(tmp_path: Path, environment: dict, episodes: dict | None = None):
    spec = yaml.safe_load((ROOT / "experiments" / "agent_gateway.yaml").read_text())
    spec["arms"] = {"a": {"algorithm": "grpo", "environment": environment,
                          "episodes": episodes or {"codec": "brackets"}}}  # fmt: skip
    spec["baseline"] = "a"
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.run(
        [sys.executable, "-m", "alignzoo", "validate", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"command": ["no-such-agent-program"]}, "'no-such-agent-program' is not on PATH"),
        ({"command": ["python", "agents/missing.py"]}, "'agents/missing.py' does not exist"),
        ({"command": ["./not-executable.sh"]}, "is not executable (chmod +x)"),
        ({}, "set exactly one of command"),
        ({"command": ["python"], "function": "x.py:f"}, "set exactly one of command"),
        ({"command": ["python"], "max_calls": 0}, "max_calls"),
    ],
)
def test_an_agent_that_cannot_run_is_refused_at_validate(tmp_path, params, says):
    if params.get("command") == ["./not-executable.sh"]:
        script = tmp_path / "not-executable.sh"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o644)
        params = {"command": [str(script)]}
    result = validate(tmp_path, {"name": "agent", "params": params})
    output = result.stderr + result.stdout
    assert result.returncode == 2, output
    assert "Traceback" not in result.stderr
    assert "exp.yaml" in output and says in output and "environment" in output


def test_an_unknown_tool_codec_is_refused_at_validate(tmp_path):
    environment = {"name": "agent", "params": {"command": ["python", "-c", "pass"]}}
    result = validate(tmp_path, environment, {"codec": "xml"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    output = result.stderr + result.stdout
    assert "exp.yaml" in output and "episodes.codec" in output and "'hermes'" in output


def test_the_process_environment_is_inherited_with_the_three_added(world, tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNZOO_TEST_INHERITED", "yes")
    body = """
    ask()
    print(os.environ["ALIGNZOO_TEST_INHERITED"], os.environ["OPENAI_BASE_URL"].startswith(
        "http://127.0.0.1:"), os.environ["OPENAI_API_KEY"].startswith("az-"), os.environ["EXTRA"])
    """
    batch, _, _ = run_agents(world, tmp_path, body, env={"EXTRA": "x"})
    assert {e["agent"]["output"].strip() for e in batch.extras} == {"yes True True x"}
    assert os.environ.get("OPENAI_API_KEY", "") == "" or not os.environ[
        "OPENAI_API_KEY"
    ].startswith("az-")


def test_the_contract_suite_runs_an_agent_and_names_how_a_broken_one_fails(tmp_path):
    from alignzoo.testing.environments import check_environment

    example = {"command": ["python", str(ROOT / "examples/agents/calculator_agent.py")]}
    results = {r.name: r for r in check_environment("agent", example)}
    assert list(results) == ["instantiate", "agent_runs", "agent_recorded"]
    assert all(r.passed for r in results.values()), [r.detail for r in results.values()]
    broken = agent_program(tmp_path, "broken", "ask(); raise RuntimeError('my bug')")
    results = {r.name: r for r in check_environment("agent", {"command": ["python", str(broken)]})}
    assert not results["agent_runs"].passed
    assert "2 of 2 episodes failed" in results["agent_runs"].detail
    assert "RuntimeError: my bug" in results["agent_runs"].detail
