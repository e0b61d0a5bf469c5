"""The tools environment: schemas from signatures and docstrings, calls answered in order,
errors answered not raised, an episode ending on a turn without a call."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest

from alignzoo.errors import UserError
from alignzoo.plugins.environments.tools import ToolsEnvironment
from alignzoo.rollout.episode import ToolCall, Turn

TOOLS = '''
import asyncio

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b

async def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to shout.
    """
    await asyncio.sleep(0)
    return text.upper() * 1000

def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("down")

def undocumented(x):
    return x

def stuck(seconds: float) -> str:
    """Sleeps (a tool that hangs).

    Args:
        seconds: How long.
    """
    import time

    time.sleep(seconds)
    return "woke"

async def stuck_async(seconds: float) -> str:
    """Sleeps without blocking (an async tool that hangs).

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"

def crash(code: int) -> str:
    """Ends its process at once (a tool that crashes the interpreter).

    Args:
        code: The exit code.
    """
    import os

    os._exit(code)
'''


@pytest.fixture
def env(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    functions = ["tools.py:add", "tools.py:shout", "tools.py:broken"]
    return ToolsEnvironment(
        {"functions": functions, "system": "Use tools.", "max_result_chars": 50}
    )


def step(env, state, turn):
    return asyncio.run(env.env_step(state=state, turn=turn))


def test_schemas_messages_and_calls(env):
    start = env.env_reset(row={"prompt": "2+3?", "answer": "5"}, seed=0)
    assert [m["role"] for m in start.messages] == ["system", "user"]
    assert [t["function"]["name"] for t in start.tools] == ["add", "shout", "broken"]
    assert start.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    calls = (ToolCall("add", {"a": 2, "b": 3}), ToolCall("shout", {"text": "hi"}),
             ToolCall("broken", {"x": 1}), ToolCall("nope", {}), ToolCall("add", {"a": 1}))  # fmt: skip
    result = step(env, start.state, Turn("calling", calls, ("tool call is not valid JSON",)))
    contents = [m["content"] for m in result.messages]
    assert contents[0] == "5"
    assert contents[1].startswith("HIHI") and len(contents[1]) == 50  # cut to max_result_chars
    assert contents[2] == "error: RuntimeError: down"
    assert contents[3].startswith("error: no tool named 'nope'")
    assert contents[4].startswith("error: TypeError")  # a missing argument
    assert contents[5] == "error: tool call is not valid JSON"
    metrics = result.info["metrics"]
    assert not result.done and (metrics["tool_calls"], metrics["tool_errors"]) == (5.0, 4.0)
    assert metrics["tool/add/calls"] == 2.0 and metrics["tool/add/errors"] == 1.0
    assert metrics["tool/broken/errors"] == 1.0 and "tool/nope/calls" not in metrics
    assert metrics["tool/shout/seconds"] >= 0.0
    assert step(env, start.state, Turn("The answer is 5.")).done  # no call: the episode ends


def test_conversational_rows_start_from_their_messages(env):
    messages = [{"role": "user", "content": "hello"}]
    start = env.env_reset(row={"prompt": "<rendered>", "prompt_messages": messages}, seed=0)
    assert start.messages[1:] == messages


def test_a_function_without_a_docstring_is_refused_naming_it(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"tools\.py:undocumented"):
        ToolsEnvironment({"functions": ["tools.py:undocumented"]})


ALL = [
    "tools.py:add",
    "tools.py:broken",
    "tools.py:stuck",
    "tools.py:stuck_async",
    "tools.py:crash",
]


def test_a_hanging_call_is_answered_at_its_timeout_and_the_episode_goes_on(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    env = ToolsEnvironment({"functions": ALL, "call_timeout_s": 0.3})
    start = env.env_reset(row={"prompt": "?"}, seed=0)
    calls = (ToolCall("stuck_async", {"seconds": 30}), ToolCall("add", {"a": 1, "b": 1}))
    began = time.monotonic()
    result = step(env, start.state, Turn("", calls))
    assert time.monotonic() - began < 5
    contents = [m["content"] for m in result.messages]
    assert contents == ["error: stuck_async timed out after 0.3s", "2"]
    assert result.info["metrics"]["tool/stuck_async/timeouts"] == 1.0 and not result.done


def test_process_isolation_kills_what_hangs_or_crashes_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    env = ToolsEnvironment({"functions": ALL, "call_timeout_s": 2.0, "isolation": "process"})
    monkeypatch.chdir(tmp_path.parent)  # the child finds the file wherever the run is
    start = env.env_reset(row={"prompt": "?"}, seed=0)
    calls = (
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("broken", {"x": 0}),
        ToolCall("stuck", {"seconds": 60}),
        ToolCall("crash", {"code": 3}),
        ToolCall("stuck_async", {"seconds": 0}),
    )
    began = time.monotonic()
    result = step(env, start.state, Turn("", calls))
    assert time.monotonic() - began < 20
    contents = [m["content"] for m in result.messages]
    assert contents[0] == "5"
    assert contents[1] == "error: RuntimeError: down"
    assert contents[2] == "error: stuck timed out after 2s"
    assert contents[3] == "error: the call's process ended with code 3"
    assert contents[4] == "woke"
    assert multiprocessing.active_children() == []  # every call's process killed and reaped
    metrics = result.info["metrics"]
    assert (metrics["tool_calls"], metrics["tool_errors"]) == (5.0, 3.0)
    assert metrics["tool/stuck/timeouts"] == 1.0 and metrics["tool/crash/errors"] == 1.0


def test_a_call_cancelled_by_the_step_timeout_ends_its_process_and_its_read_first(
    tmp_path, monkeypatch
):
    """The step's timeout cancels a call in flight: its process is killed, and the pipe is
    closed only once the thread reading it has finished (never under it)."""
    from alignzoo.plugins.environments import tools

    (tmp_path / "tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    read_ended: list[str] = []  # how the read ended: what it raised
    read = tools._receive

    def spy(receiver, timeout):
        try:
            return read(receiver, timeout)
        except BaseException as exc:
            read_ended.append(type(exc).__name__)
            raise

    monkeypatch.setattr(tools, "_receive", spy)

    async def cancel_one() -> None:
        call = asyncio.ensure_future(
            tools._call_in_process("tools.py:stuck", {"seconds": 60}, 30.0, 100)
        )
        await asyncio.sleep(1.0)  # the child runs, the thread waits on the pipe
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):  # the read ends as the killed child's end of the pipe closes
            if read_ended:
                break
            await asyncio.sleep(0.05)

    asyncio.run(cancel_one())
    assert read_ended == ["EOFError"]  # the child's end closed; not OSError: closed under it
    assert multiprocessing.active_children() == []
