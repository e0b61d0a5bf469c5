"""An agent written for the OpenAI API: it solves an arithmetic task with a calculator tool.

Nothing in it knows about alignzoo. It reads its task, calls a chat model through the ``openai``
SDK with one tool, runs each call the model makes, sends the results back, and prints the
model's final answer. Pointed at the OpenAI API it would run as it is; pointed at alignzoo's
gateway (``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, which an ``agent`` environment sets per
episode) every call it makes becomes training data.

    python examples/agents/calculator_agent.py                    # the task from stdin (JSON)
    python examples/agents/calculator_agent.py --broken-calculator

An ``agent`` environment runs it either way: as this program per episode (``command:``), or
in its own process by calling :func:`episode` (``function:``), which skips the interpreter's
start and the SDK's import (about 0.6 s of CPU an episode) and is otherwise the same agent.

The task is a JSON object with a ``prompt`` ("47*86="); alignzoo writes the dataset row there
(and in ``ALIGNZOO_TASK``). ``--broken-calculator`` answers every call with an error: the same
agent without a working tool, the other arm of experiments/agent_gateway.yaml.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys

from openai import OpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "For example 12*34."}},
            "required": ["expression"],
        },
    },
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The value of an integer expression (``+ - *`` and parentheses), or what is wrong."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers, + - * and parentheses")

    if len(expression) > 64:
        return "error: expression too long"
    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {exc}"


def solve(prompt: str, client: OpenAI, broken: bool, max_turns: int = 3) -> str:
    """Ask the model, run its tool calls, and return its final answer."""
    messages: list[dict] = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = (
            client.chat.completions.create(
                model=os.environ.get("AGENT_MODEL", "policy"), messages=messages, tools=[CALCULATOR]
            )
            .choices[0]
            .message
        )
        if not reply.tool_calls:
            return reply.content or ""
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = "error: no calculator" if broken else calculate(arguments["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def episode(task: dict, base_url: str, api_key: str) -> str:
    """One episode in-process (an ``agent`` environment's ``function:``)."""
    return solve(task["prompt"], OpenAI(base_url=base_url, api_key=api_key), broken=False)


def broken_episode(task: dict, base_url: str, api_key: str) -> str:
    """One episode with the calculator broken."""
    return solve(task["prompt"], OpenAI(base_url=base_url, api_key=api_key), broken=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broken-calculator", action="store_true")
    args = parser.parse_args()
    task = json.loads(sys.stdin.read() or os.environ.get("ALIGNZOO_TASK", "{}"))
    print(solve(task["prompt"], OpenAI(), args.broken_calculator))


if __name__ == "__main__":
    main()
