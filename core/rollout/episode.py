"""What crosses an environment's hooks: the model's turn, the episode's start and each step's
result (light records, no torch).

A message is a chat message as Hugging Face chat templates take it: ``{"role": ..., "content":
...}``, with ``"tool_calls"`` on an assistant message and ``"name"`` on a tool message where a
template uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Turn:
    """The model's turn as the environment sees it.

    ``text``: what the model wrote (decoded, special tokens removed). ``tool_calls``: the calls
    the arm's codec read in it, in order. ``errors``: one line per call the codec found but
    could not read (bad JSON, no name): an environment answers them as an error observation
    so the model can recover; they never raise. ``index``: 0 for the first turn.
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()
    index: int = 0


@dataclass
class EpisodeStart:
    """What ``env_reset`` returns.

    ``state``: the episode's own state, handed back to ``env_step`` and ``env_close`` (any
    object; the engine never looks inside). ``messages``: the conversation the model starts
    from (a system message, the task as a user message). ``tools``: JSON schemas of the tools
    offered (``{"type": "function", "function": {...}}``, what ``apply_chat_template(tools=)``
    renders); None when the episode offers none.
    """

    state: Any
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


@dataclass
class StepResult:
    """What ``env_step`` returns after the model's turn.

    ``messages``: the environment's answer, appended to the conversation (tool results as
    ``{"role": "tool", "name": ..., "content": ...}``, or a user message); empty when the
    episode ends without one. ``reward``: this step's reward, if the environment gives one
    (the episode's reward is the sum, see the engine's ``episodes.reward``). ``done``: the
    episode is over. ``info``: anything worth logging about the step (kept in sample rows;
    numbers under ``info["metrics"]`` are averaged into the step's ``env/*`` metrics).
    """

    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
