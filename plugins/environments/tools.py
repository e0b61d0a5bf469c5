"""Environment "tools": plain Python functions the model may call, as TRL's ``tools=``.

``functions: ["path/to/file.py:add", "pkg.module:search"]``: each function's JSON schema is
read from its signature and its Google-style docstring (``transformers.utils.get_json_schema``)
and offered to the model through the chat template. An episode starts from the row's prompt
(its messages for conversational data, else one user message, after the optional ``system``
message). Each model turn's calls are run in order, each answered by a ``tool`` message with
the function's result (``str(result)``, cut to ``max_result_chars``) or the error it raised;
a malformed call is answered with what was wrong. The episode ends on a turn without a call
(TRL's rule). It gives no reward of its own: the arm's labeler scores the transcript.

Functions are stateless. Each call has ``call_timeout_s``; past it the model is answered
``error: ... timed out`` and the episode goes on (keep it below ``episodes.step_timeout_s``,
which ends the episode). Where a call runs is ``isolation``:

- ``thread`` (default, as TRL): in a worker thread (``async def`` ones on the event loop), so a
  slow one does not hold up the step's other episodes. A thread cannot be stopped: one that
  hangs runs on in the background after its answer (an ``async def`` one is cancelled).
- ``process``: in a child process of its own (forkserver), killed at the timeout, so a call
  that hangs, crashes the interpreter or leaks memory leaves nothing behind; each call pays a
  process start (about 0.2 s on 2 CPU cores) and its arguments and result cross a pipe. As with
  any multiprocessing program, a Python script that runs an experiment itself (not through the
  ``alignzoo`` command) needs the ``if __name__ == "__main__":`` guard: the child processes
  import the script's main module.

Per tool the step's metrics carry ``env/tool/<name>/calls``, ``errors``, ``timeouts`` and
``seconds`` (means per episode), beside ``env/tool_calls`` and ``env/tool_errors``.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.config.callables import load_callable
from alignzoo.errors import UserError
from alignzoo.plugin import Environment, hookimpl
from alignzoo.rollout.episode import EpisodeStart, Message, StepResult, Turn


class ToolsEnvironment(Environment):
    """Python functions as tools (TRL's tools=): an episode ends on a turn with no call."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        functions: list[str] = Field(
            min_length=1,
            description="'path/to/file.py:fn' or 'module:fn' per tool; schemas from their "
            "signatures and Google-style docstrings.",
        )
        system: str | None = Field(None, description="A system message before the prompt.")
        max_result_chars: int = Field(
            2000, ge=16, description="A tool's answer is cut to this many characters."
        )
        call_timeout_s: float = Field(
            10.0, gt=0, description="Longest tool call; past it the model is answered an error."
        )
        isolation: Literal["thread", "process"] = Field(
            "thread",
            description="Where calls run: 'thread' (fast; a hung call's thread runs on) or "
            "'process' (a child process per call, killed at the timeout).",
        )

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        from transformers.utils import get_json_schema

        self.functions: dict[str, Any] = {}
        self.specs: dict[str, str] = {}  # name -> spec with an absolute path, for child processes
        self.schemas: list[dict[str, Any]] = []
        for spec in self.params.functions:
            fn = load_callable(spec, "tools environment")
            try:
                schema = get_json_schema(fn)
            except Exception as exc:  # transformers says what the docstring lacks
                raise UserError(f"tools environment: {spec}: {exc}") from None
            name = schema["function"]["name"]
            if name in self.functions:
                raise UserError(f"tools environment: two tools are named {name!r}")
            self.functions[name] = fn
            self.specs[name] = _absolute(spec)
            self.schemas.append(schema)

    @hookimpl
    def env_reset(self, row: dict[str, Any], seed: int) -> EpisodeStart:
        messages: list[Message] = []
        if self.params.system:
            messages.append({"role": "system", "content": self.params.system})
        prompt = row.get("prompt_messages")
        if isinstance(prompt, list):
            messages += [dict(m) for m in prompt]
        else:
            messages.append({"role": "user", "content": str(row.get("prompt", ""))})
        return EpisodeStart(state={"calls": 0}, messages=messages, tools=self.schemas)

    @hookimpl
    async def env_step(self, state: Any, turn: Turn) -> StepResult:
        if not turn.tool_calls and not turn.errors:  # the answer; a rate of 0 is logged as 0
            return StepResult(done=True, info={"metrics": {"tool_calls": 0.0, "tool_errors": 0.0}})
        answers: list[Message] = []
        failed = 0
        metrics: dict[str, float] = {}
        for call in turn.tool_calls:
            fn = self.functions.get(call.name)
            if fn is None:
                failed += 1
                known = ", ".join(self.functions)
                text = f"error: no tool named {call.name!r} (tools: {known})"
            else:
                started = time.perf_counter()
                prefix = f"tool/{call.name}"
                metrics[f"{prefix}/calls"] = metrics.get(f"{prefix}/calls", 0.0) + 1
                timeout = self.params.call_timeout_s
                try:
                    if self.params.isolation == "process":
                        text = await _call_in_process(
                            self.specs[call.name],
                            call.arguments,
                            timeout,
                            self.params.max_result_chars,
                        )
                    else:
                        text = str(await asyncio.wait_for(_call(fn, call.arguments), timeout))
                except (asyncio.TimeoutError, TimeoutError):
                    failed += 1
                    metrics[f"{prefix}/timeouts"] = metrics.get(f"{prefix}/timeouts", 0.0) + 1
                    text = f"error: {call.name} timed out after {timeout:g}s"
                except Exception as exc:  # the tool's failure is the model's to read
                    failed += 1
                    metrics[f"{prefix}/errors"] = metrics.get(f"{prefix}/errors", 0.0) + 1
                    what = (
                        str(exc)
                        if isinstance(exc, ToolCallFailed)
                        else f"{type(exc).__name__}: {exc}"
                    )
                    text = f"error: {what}"
                seconds = time.perf_counter() - started
                metrics[f"{prefix}/seconds"] = metrics.get(f"{prefix}/seconds", 0.0) + seconds
            limit = self.params.max_result_chars
            text = text if len(text) <= limit else text[: limit - 1] + "…"
            answers.append({"role": "tool", "name": call.name, "content": text})
        answers += [
            {"role": "tool", "name": "error", "content": f"error: {e}"} for e in turn.errors
        ]
        state["calls"] += len(turn.tool_calls)
        metrics["tool_calls"] = float(len(turn.tool_calls))
        metrics["tool_errors"] = float(failed + len(turn.errors))
        return StepResult(messages=answers, info={"metrics": metrics})


async def _call(fn: Any, arguments: dict[str, Any]) -> Any:
    """``fn(**arguments)``: awaited when async, in a worker thread when not."""
    if inspect.iscoroutinefunction(fn):
        return await fn(**arguments)
    return await asyncio.to_thread(fn, **arguments)


def _absolute(spec: str) -> str:
    """``spec`` with a file path made absolute (a child process may start elsewhere)."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        return f"{Path(target).expanduser().resolve()}:{name}"
    return spec


class ToolCallFailed(RuntimeError):
    """A call in a child process failed: what it raised (``"ValueError: ..."``), or that the
    process ended without an answer (a crash, ``os._exit``, a kill)."""


def _run_call(spec: str, arguments: dict[str, Any], limit: int, conn: Any) -> None:
    """In the child process: load the tool, call it, send back ("ok"|"error", text)."""
    try:
        result = load_callable(spec, "tools environment")(**arguments)
        if inspect.isawaitable(result):
            result = asyncio.run(result)  # type: ignore[arg-type]
        conn.send(("ok", str(result)[: limit + 1]))
    except BaseException as exc:  # everything the call raises is the model's to read
        conn.send(("error", f"{type(exc).__name__}: {exc}"[: limit + 1]))
    finally:
        conn.close()


def _receive(receiver: Any, timeout: float) -> tuple[str, str] | None:
    """The child's answer, or None when none came within ``timeout`` (EOFError: it ended
    without one). Runs in a worker thread, which closes the pipe when done: a call cancelled
    meanwhile never closes it under the read."""
    try:
        if not receiver.poll(timeout):
            return None
        status, text = receiver.recv()
        return str(status), str(text)
    finally:
        receiver.close()


async def _call_in_process(spec: str, arguments: dict[str, Any], timeout: float, limit: int) -> str:
    """``spec(**arguments)`` in a child process, killed (and reaped) at ``timeout``; its text,
    or the error it raised as an exception here."""
    context = multiprocessing.get_context("forkserver")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_run_call, args=(spec, arguments, limit, sender), daemon=True)
    child.start()
    sender.close()
    # A call cancelled meanwhile (the step's timeout) kills the child, which ends the read.
    try:
        received = await asyncio.to_thread(_receive, receiver, timeout)
    except EOFError:
        child.join(1.0)
        raise ToolCallFailed(f"the call's process ended with code {child.exitcode}") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
    if received is None:
        raise TimeoutError
    status, text = received
    if status == "error":
        raise ToolCallFailed(text)
    return str(text)
