"""Environment "tools": plain Python functions the model may call, as TRL's ``tools=``.

``functions: ["path/to/file.py:add", "pkg.module:search"]``: each function's JSON schema is
read from its signature and its Google-style docstring (``transformers.utils.get_json_schema``)
and offered to the model through the chat template. An episode starts from the row's prompt
(its messages for conversational data, else one user message, after the optional ``system``
message). Each model turn's calls are run in order, each answered by a ``tool`` message with
the function's result (``str(result)``, cut to ``max_result_chars``) or the error it raised;
a malformed call is answered with what was wrong. The episode ends on a turn without a call
(TRL's rule). It gives no reward of its own: the arm's labeler scores the transcript.

Functions are stateless and run in a worker thread (``async def`` ones on the event loop), so
a slow one does not hold up the step's other episodes; one that hangs makes its episode time
out (``episodes.step_timeout_s``). Per tool the step's metrics carry ``env/tool/<name>/calls``,
``errors`` and ``seconds`` (means per episode), beside ``env/tool_calls`` and ``env/tool_errors``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.callables import load_callable
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

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        from transformers.utils import get_json_schema

        self.functions: dict[str, Any] = {}
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
                try:
                    result = await _call(fn, call.arguments)
                    text = str(result)
                except Exception as exc:  # the tool's failure is the model's to read
                    failed += 1
                    metrics[f"{prefix}/errors"] = metrics.get(f"{prefix}/errors", 0.0) + 1
                    text = f"error: {type(exc).__name__}: {exc}"
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
