"""What crosses an environment's hooks: the model's turn, the episode's start and each step's
result (light records, no torch).

A message is a chat message as Hugging Face chat templates take it: ``{"role": ..., "content":
...}``, with ``"tool_calls"`` on an assistant message and ``"name"`` on a tool message where a
template uses them.
"""

from __future__ import annotations

# The records live at the package root (alignzoo.types), part of the plugin contract; this is
# the path the docs and environments import them from.
from alignzoo.types import EpisodeStart, Message, StepResult, ToolCall, Turn

__all__ = ["EpisodeStart", "Message", "StepResult", "ToolCall", "Turn"]
