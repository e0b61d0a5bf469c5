"""Environment "calculator": the embedded tool-use task's calculator, one tool for integer
arithmetic.

An episode starts from the row's prompt (``"12*34="``). Each call of the model's turn is read
by the arm's codec (``[12*34]`` in the embedded world's plain syntax, or a
``<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>`` with a
chat template) and answered by a ``tool`` message with the value (``408``), or with what was
wrong (an expression it does not read, an unclosed call). The episode ends on a turn without a
call, whose text is the answer the arm's labeler scores (``arithmetic`` on the embedded task).
It gives no reward of its own.

``enabled: false`` keeps the episode and its syntax but answers every call with
``error: no calculator``: the no-tool arm of an A/B test, identical otherwise (same turns,
same token budget, same evaluation).

The evaluator (:func:`alignzoo.world.calculator.evaluate`) reads integers, ``+ - *`` and
parentheses only, within bounded sizes, so model-written text cannot make it do anything else.
Step metrics: ``env/tool_calls``, ``env/tool_errors`` and ``env/tool/calculator/calls`` /
``errors`` (means per episode).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.plugin import Environment, hookimpl
from alignzoo.rollout.episode import EpisodeStart, Message, StepResult, Turn
from alignzoo.world import calculator

SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": calculator.TOOL_NAME,
        "description": "Evaluate an integer expression with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "For example 12*34."}},
            "required": ["expression"],
        },
    },
}


class CalculatorEnvironment(Environment):
    """A calculator tool for integer arithmetic (the embedded tool-use task's environment)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        enabled: bool = Field(
            True,
            description="Answer calls with their value; false answers every call with "
            "'error: no calculator' (the no-tool arm of an A/B test, identical otherwise).",
        )

    params: Params

    @hookimpl
    def env_reset(self, row: dict[str, Any], seed: int) -> EpisodeStart:
        messages: list[Message] = [{"role": "user", "content": str(row.get("prompt", ""))}]
        tools = [SCHEMA] if self.params.enabled else None
        return EpisodeStart(state={"calls": 0}, messages=messages, tools=tools)

    @hookimpl
    def env_step(self, state: Any, turn: Turn) -> StepResult:
        if not turn.tool_calls and not turn.errors:  # the answer; a rate of 0 is logged as 0
            return StepResult(done=True, info={"metrics": {"tool_calls": 0.0, "tool_errors": 0.0}})
        answers: list[Message] = []
        errors = len(turn.errors)
        for call in turn.tool_calls:
            text = self._answer(call.name, call.arguments)
            errors += text.startswith("error")
            answers.append({"role": "tool", "name": call.name, "content": text})
        answers += [
            {"role": "tool", "name": "error", "content": f"error: {e}"} for e in turn.errors
        ]
        state["calls"] += len(turn.tool_calls)
        metrics = {
            "tool_calls": float(len(turn.tool_calls)),
            "tool_errors": float(errors),
            f"tool/{calculator.TOOL_NAME}/calls": float(len(turn.tool_calls)),
            f"tool/{calculator.TOOL_NAME}/errors": float(errors - len(turn.errors)),
        }
        return StepResult(messages=answers, info={"metrics": metrics})

    def _answer(self, name: str, arguments: dict[str, Any]) -> str:
        if not self.params.enabled:
            return "error: no calculator"
        if name != calculator.TOOL_NAME:
            return f"error: no tool named {name!r} (tools: {calculator.TOOL_NAME})"
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "error: 'expression' must be a string"
        try:
            return str(calculator.evaluate(expression))
        except calculator.CalculatorError as exc:
            return f"error: {exc}"
