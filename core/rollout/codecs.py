"""Tool-call codecs: how a chat template writes a tool call, read back from the model's text.

A codec turns the text of one model turn into :class:`~alignzoo.rollout.episode.ToolCall`
records, and lists the calls it found but could not read (bad JSON, a missing name) as errors
instead of raising: a malformed call is the model's mistake, answered by the environment as
an error observation. :func:`codec_for` picks the codec a tokenizer's chat template uses.

- ``hermes``: the format of Hermes, Qwen2/2.5/3 and most tool-calling templates, one JSON
  object per call between ``<tool_call>`` and ``</tool_call>``:
  ``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``.
- ``brackets``: the embedded world's plain-text syntax for a tokenizer without a chat
  template (:mod:`alignzoo.world.calculator`): ``[12*34]`` calls the calculator with that
  expression, and its answer is written ``=408`` and a newline. Such a codec also writes the
  environment's messages as text (:meth:`BracketCodec.plain_text`), which the plain renderer
  appends between turns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from alignzoo.errors import UserError
from alignzoo.rollout.episode import Message, ToolCall
from alignzoo.world import calculator

MAX_CALLS = 16
"""Most calls read from one turn; more are reported as one error."""


@dataclass(frozen=True)
class Parsed:
    """The calls read from one turn, and one line per call that could not be read."""

    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


def _assistant_message(text: str, calls: tuple[ToolCall, ...]) -> Message:
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


class HermesCodec:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes and Qwen write it."""

    name: ClassVar[str] = "hermes"
    plain: ClassVar[bool] = False
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)

    def parse(self, text: str) -> Parsed:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for found, (body, closing) in enumerate(self._CALL.findall(text)):
            if found >= MAX_CALLS:
                errors.append(f"more than {MAX_CALLS} tool calls in one turn; the rest ignored")
                break
            if not closing:
                errors.append("a <tool_call> without </tool_call>")
                continue
            call, problem = _call_from_json(body.strip())
            if call is not None:
                calls.append(call)
            else:
                errors.append(problem)
        return Parsed(tuple(calls), tuple(errors))

    def assistant_message(self, text: str, calls: tuple[ToolCall, ...]) -> Message:
        """The model's turn as a transcript message (tool calls in the template's field)."""
        return _assistant_message(text, calls)

    def prose(self, text: str) -> str:
        """The turn's text without its tool calls (an OpenAI-style message's ``content``)."""
        return self._CALL.sub("", text).strip()


class BracketCodec:
    """``[12*34]`` calls the calculator; its answer is written ``=408`` and a newline (the
    embedded world's syntax, for a tokenizer without a chat template)."""

    name: ClassVar[str] = "brackets"
    plain: ClassVar[bool] = True

    def parse(self, text: str) -> Parsed:
        expressions, errors = calculator.find_calls(text)
        if len(expressions) > MAX_CALLS:
            errors.append(f"more than {MAX_CALLS} tool calls in one turn; the rest ignored")
        calls = tuple(
            ToolCall(calculator.TOOL_NAME, {"expression": e}) for e in expressions[:MAX_CALLS]
        )
        return Parsed(calls, tuple(errors))

    def assistant_message(self, text: str, calls: tuple[ToolCall, ...]) -> Message:
        """The model's turn as a transcript message (its calls in the ``tool_calls`` field)."""
        return _assistant_message(text, calls)

    def plain_text(self, messages: list[Message]) -> str:
        """The environment's messages as the text appended after the model's turn: a tool's
        answer as ``=<content>`` and a newline, any other message as its content and a newline."""
        return "".join(
            calculator.format_result(str(m.get("content", "")))
            if m.get("role") == "tool"
            else f"{m.get('content', '')}\n"
            for m in messages
        )

    def stop_text(self) -> str:
        """Where a model turn that calls stops: right after the closing bracket."""
        return calculator.CALL_CLOSE

    def prose(self, text: str) -> str:
        """The turn's text without its calls (an OpenAI-style message's ``content``)."""
        return calculator.strip_calls(text).strip()


def _call_from_json(body: str) -> tuple[ToolCall | None, str]:
    """A call from the JSON between the tags, or None and why it cannot be read."""
    try:
        data: Any = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return None, f"tool call is not valid JSON ({exc.__class__.__name__}: {str(exc)[:80]})"
    if not isinstance(data, dict):
        return None, "tool call must be a JSON object with 'name' and 'arguments'"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, "tool call has no 'name'"
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, f"tool call {name!r}: 'arguments' is not a JSON object"
    if not isinstance(arguments, dict):
        return None, f"tool call {name!r}: 'arguments' must be a JSON object"
    return ToolCall(name, arguments), ""


Codec = HermesCodec | BracketCodec
"""A tool-call codec: ``parse`` a model turn, write it as an ``assistant_message`` (or its
``prose``, the text around the calls); ``plain``
says whether it also writes the environment's messages as text (``plain_text``), for a
tokenizer without a chat template."""

CODECS: dict[str, type[Codec]] = {
    HermesCodec.name: HermesCodec,
    BracketCodec.name: BracketCodec,
}


def codec_for(tokenizer: Any, name: str = "auto") -> Codec:
    """The codec ``name``, or with ``auto`` the one the tokenizer's chat template writes
    (``hermes`` when it mentions ``<tool_call>``); a UserError saying what to set otherwise
    (``brackets``, the embedded world's plain syntax, is only ever chosen by name: it reads
    nothing but calculator calls)."""
    if name != "auto":
        if name not in CODECS:
            raise UserError(f"unknown tool-call codec {name!r}; known: {', '.join(CODECS)}")
        return CODECS[name]()
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<tool_call>" in str(template):
        return HermesCodec()
    if not template:
        why = "this tokenizer has no chat template"
    else:
        why = "this tokenizer's chat template does not mention <tool_call>"
    raise UserError(
        f"cannot tell how tool calls are written ({why}); set episodes.codec: hermes for "
        "<tool_call> JSON, or brackets for the embedded world's plain [12*34] calculator calls"
    )
