"""The embedded world's calculator: how its tokenizer writes a tool call, and scripted traces.

The embedded tokenizer has no chat template, so the embedded world has a plain-text syntax of
its own. On the prompt ``"12*34="`` the model may answer at once (``"408"``, then EOS) or call
the calculator::

    12*34=[12*34]=408
    408<|endoftext|>

``[12*34]`` is the model's call (its turn stops at ``]``); ``=408`` and a newline are the
calculator's answer, appended by the environment (never trained on); ``408`` and EOS are the
model's final turn, the answer the labeler checks. :func:`evaluate` reads an expression of
integers with ``+``, ``-``, ``*`` and parentheses, and nothing else (no names, no powers, no
division, bounded size), so model-written text cannot make it do anything else.

:func:`scripted_demonstrations` builds the warm start's demonstrations: a share of the prompts
(``tool_share``) shown calling the calculator, the rest answered directly.
"""

from __future__ import annotations

import ast
import random
import re

CALL_OPEN = "["
CALL_CLOSE = "]"
TOOL_NAME = "calculator"
MAX_EXPRESSION_CHARS = 64
MAX_DIGITS = 18
"""Longest integer literal :func:`evaluate` reads (and longest result it returns)."""

_CALL = re.compile(r"\[([^\[\]]*)(\]|$)")

Segment = tuple[str, bool]
"""A piece of a demonstration: its text and whether the model wrote it (trained on)."""


class CalculatorError(ValueError):
    """The expression is not one the calculator reads; the message says why."""


def format_call(expression: str) -> str:
    """The model's call text: ``format_call("12*34") == "[12*34]"``."""
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}"


def format_result(content: str) -> str:
    """What the environment appends after a call: ``"=408\\n"`` (or ``"=error: ...\\n"``)."""
    return f"={content}\n"


def strip_calls(text: str) -> str:
    """``text`` without its calls (closed or not): ``strip_calls("x[1+2]") == "x"``."""
    return _CALL.sub("", text)


def find_calls(text: str) -> tuple[list[str], list[str]]:
    """The expressions of the calls in ``text`` and one line per call that is not closed."""
    calls, errors = [], []
    for body, closing in _CALL.findall(text):
        if closing:
            calls.append(body)
        else:
            errors.append(f"a call opened with {CALL_OPEN!r} is not closed with {CALL_CLOSE!r}")
    return calls, errors


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expression: str) -> int:
    """The value of an integer expression with ``+ - *`` and parentheses.

    Raises :class:`CalculatorError` (with the reason) for anything else: names, calls, other
    operators, floats, literals over :data:`MAX_DIGITS` digits, more than
    :data:`MAX_EXPRESSION_CHARS` characters, or a result over :data:`MAX_DIGITS` digits.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot read {expression!r}") from None
    value = _value(tree.body)
    if len(str(abs(value))) > MAX_DIGITS:
        raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
    return value


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if len(str(abs(node.value))) > MAX_DIGITS:
            raise CalculatorError(f"a number with more than {MAX_DIGITS} digits")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        result = _BINARY[type(node.op)](left, right)
        if len(str(abs(result))) > MAX_DIGITS:
            raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
        return result
    raise CalculatorError("only integers, + - * and parentheses")


def tool_trace(prompt: str) -> list[Segment]:
    """The demonstration of ``prompt`` that calls the calculator: the call, its result (not
    trained on), then the result copied as the answer. The prompt itself is not included; EOS
    is added by the encoder."""
    expression = prompt.rstrip("=")
    result = str(evaluate(expression))
    return [(format_call(expression), True), (format_result(result), False), (result, True)]


def direct_trace(answer: str) -> list[Segment]:
    """The demonstration that answers without the calculator."""
    return [(answer, True)]


def scripted_demonstrations(
    examples: list[dict[str, str]], tool_share: float, seed: int
) -> tuple[list[dict[str, object]], int]:
    """Each example as a scripted trace: calling the calculator with probability
    ``tool_share`` (and copying its result), answering with the example's answer otherwise (and
    where the calculator cannot read the prompt, e.g. a question in words). Returns dicts with ``prompt`` and
    ``segments`` (see :data:`Segment`), and how many call the calculator. Deterministic from
    ``seed``."""
    rng = random.Random(f"calculator/{seed}")
    out: list[dict[str, object]] = []
    calls = 0
    for ex in examples:
        trace = None
        if rng.random() < tool_share:
            try:
                trace = tool_trace(ex["prompt"])
            except CalculatorError:  # a prompt the calculator cannot read: answered directly
                trace = None
        if trace is not None:
            out.append({"prompt": ex["prompt"], "segments": trace})
            calls += 1
        else:
            out.append({"prompt": ex["prompt"], "segments": direct_trace(ex["answer"])})
    return out, calls
