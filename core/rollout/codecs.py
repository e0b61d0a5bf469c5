"""Tool-call codecs: how a chat template writes a tool call, read back from the model's text.

A codec turns the text of one model turn into :class:`~alignzoo.rollout.episode.ToolCall`
records, and lists the calls it found but could not read (bad JSON, a missing name) as errors
instead of raising: a malformed call is the model's mistake, answered by the environment as
an error observation. :func:`codec_for` picks the codec a tokenizer's chat template uses.

- ``hermes``: the format of Hermes, Qwen2/2.5/3 and most tool-calling templates, one JSON
  object per call between ``<tool_call>`` and ``</tool_call>``:
  ``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from alignzoo.errors import UserError
from alignzoo.rollout.episode import Message, ToolCall

MAX_CALLS = 16
"""Most calls read from one turn; more are reported as one error."""


@dataclass(frozen=True)
class Parsed:
    """The calls read from one turn, and one line per call that could not be read."""

    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


class HermesCodec:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes and Qwen write it."""

    name: ClassVar[str] = "hermes"
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
        message: Message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        return message


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


CODECS: dict[str, type[HermesCodec]] = {HermesCodec.name: HermesCodec}


def codec_for(tokenizer: Any, name: str = "auto") -> HermesCodec:
    """The codec ``name``, or with ``auto`` the one the tokenizer's chat template writes
    (``hermes`` when it mentions ``<tool_call>``); a UserError saying what to set otherwise."""
    if name != "auto":
        if name not in CODECS:
            raise UserError(f"unknown tool-call codec {name!r}; known: {', '.join(CODECS)}")
        return CODECS[name]()
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<tool_call>" in str(template):
        return HermesCodec()
    raise UserError(
        "cannot tell how this tokenizer's chat template writes tool calls (it does not mention "
        f"<tool_call>); set episodes.codec to one of {', '.join(CODECS)}"
    )
