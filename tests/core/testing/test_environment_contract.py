"""The environment contract suite: the built-in tools environment passes; environments that
share state between episodes, raise on a malformed call, answer with the wrong type or leave
an open episode silent fail the check that names the problem."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from alignzoo.plugin import Environment, hookimpl
from alignzoo.rollout.episode import EpisodeStart, StepResult
from alignzoo.testing.components import check_component
from alignzoo.testing.environments import check_environment

TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''


def failed(results: list[Any]) -> dict[str, str]:
    return {r.name: r.detail for r in results if not r.passed}


def test_the_tools_environment_meets_the_contract(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    results = check_component("environment", "tools", {"functions": ["tools.py:add"]}, 10)
    assert failed(results) == {}
    assert [r.name for r in results] == [
        "instantiate", "reset", "step", "episodes_independent", "close"
    ]  # fmt: skip


class Base(Environment):
    @hookimpl
    def env_reset(self, row, seed):
        return EpisodeStart({"n": 0}, [{"role": "user", "content": row["prompt"]}])


class SharedCounter(Base):
    """Counts turns on the component, not the episode."""

    count: ClassVar[int] = 0

    @hookimpl
    def env_step(self, state, turn):
        SharedCounter.count += 1
        return StepResult([{"role": "tool", "content": str(SharedCounter.count)}])


class RaisesOnBadCalls(Base):
    @hookimpl
    def env_step(self, state, turn):
        if turn.errors:
            raise ValueError("cannot parse")
        return StepResult(done=True)


class WrongType(Base):
    @hookimpl
    def env_step(self, state, turn):
        return {"messages": []}


class Silent(Base):
    @hookimpl
    def env_step(self, state, turn):
        return StepResult()  # not done, nothing said


@pytest.mark.parametrize(
    ("environment", "check", "message"),
    [
        (SharedCounter, "episodes_independent", "state is shared between episodes"),
        (RaisesOnBadCalls, "step", "env_step raised ValueError"),
        (WrongType, "step", "returned dict, not StepResult"),
        (Silent, "step", "must answer the turn"),
    ],
)
def test_broken_environments_fail_the_check_that_names_the_problem(environment, check, message):
    problems = failed(check_environment(environment, max_examples=15))
    assert check in problems, problems
    assert message in problems[check]
    assert len(problems[check]) < 1500
