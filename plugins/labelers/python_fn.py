"""Labeler "python": any Python function with TRL's reward-function signature.

``function: "path/to/file.py:fn"`` (a file, relative to the working directory) or
``"pkg.module:fn"`` (an importable module). The function is imported when the labeler is built
(so ``alignzoo validate`` reports a missing file or name), never before a YAML names it.

Signature: ``fn(prompts, completions, **columns) -> list[float | None]`` with one list entry
per response; ``columns`` holds the dataset's other columns as lists (e.g. ``answer``). A
``None`` entry abstains (the arm's policy decides: by default the next labeler of the chain).
An ``async def`` function is awaited. A function may also return :class:`alignzoo.Score`
objects. With ``--jobs > 1`` each worker imports the function again from the same place.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.callables import load_callable


class PythonLabeler(Labeler):
    """A Python reward function ``fn(prompts, completions, **columns) -> list[float | None]``."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        function: str = Field(
            description="'path/to/file.py:fn' (relative to the working directory) or 'module:fn'."
        )
        kwargs: dict[str, Any] = Field(
            default_factory=dict, description="Extra keyword arguments passed on every call."
        )

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.fn = load_callable(self.params.function, "python labeler")

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        prompts = [r.prompt for r in requests]
        completions = [r.response for r in requests]
        names = sorted({k for r in requests for k in r.extra})
        columns = {k: [r.extra.get(k) for r in requests] for k in names}
        result = self.fn(prompts, completions, **columns, **self.params.kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_wait(result))
        if not isinstance(result, (list, tuple)):
            return result  # type: ignore[no-any-return]  # the stage rejects it, saying why
        return [_as_score(v) for v in result]


async def _wait(awaitable: Any) -> Any:
    return await awaitable


def _as_score(value: Any) -> Any:
    if value is None:
        return Score.abstain("the function returned None")
    if isinstance(value, Score):
        return value
    if isinstance(value, bool):
        return Score(float(value))
    if isinstance(value, (int, float)):
        return Score(float(value))
    return value  # not a number: the stage rejects this sample
