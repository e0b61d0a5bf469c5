"""Labeler "python": any Python function with TRL's reward-function signature.

``function: "path/to/file.py:fn"`` (a file, relative to the working directory) or
``"pkg.module:fn"`` (an importable module). The function is imported when the labeler is built
(so ``alignzoo validate`` reports a missing file or name), never before a YAML names it.

Signature: ``fn(prompts, completions, **columns) -> list[float | None]`` with one list entry
per response; ``columns`` holds the dataset's other columns as lists (e.g. ``answer``). The
function is called by keyword, as TRL calls reward functions: ``prompts=``, ``completions=``,
each column and ``kwargs`` by name, so ``def reward(completions, **kwargs)`` from TRL's
documentation works as written; a function without ``**kwargs`` gets only the arguments it
names (and a clear error naming what it asks for that the data does not have). A
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
        self.accepts = accepted_arguments(self.fn)

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        prompts = [r.prompt for r in requests]
        completions = [r.response for r in requests]
        names = sorted({k for r in requests for k in r.extra})
        columns = {k: [r.extra.get(k) for r in requests] for k in names}
        offered = {
            "prompts": prompts,
            "completions": completions,
            **columns,
            **self.params.kwargs,
        }
        result = self.fn(**self._arguments(offered))
        if inspect.isawaitable(result):
            result = asyncio.run(_wait(result))
        if not isinstance(result, (list, tuple)):
            return result  # type: ignore[no-any-return]  # the stage rejects it, saying why
        return [_as_score(v) for v in result]

    def _arguments(self, offered: dict[str, Any]) -> dict[str, Any]:
        """What the function is called with: everything offered when it takes ``**kwargs``,
        else the arguments it names; a required one the call cannot give is a TypeError that
        says which and what there is."""
        if self.accepts is None:  # takes **kwargs (or cannot be inspected): TRL's call
            return offered
        names, required = self.accepts
        missing = [n for n in required if n not in offered]
        if missing:
            raise TypeError(
                f"{self.params.function} asks for {', '.join(missing)}, which the call does not "
                f"have (it offers {', '.join(sorted(offered))}): name a column of the data, "
                "give it in params.kwargs, or add **kwargs"
            )
        return {k: v for k, v in offered.items() if k in names}


def accepted_arguments(fn: Any) -> tuple[set[str], list[str]] | None:
    """The names ``fn`` takes by keyword and those it requires; None when it takes
    ``**kwargs`` (or its signature cannot be read)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    usable = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in params if p.kind in usable}
    required = [p.name for p in params if p.kind in usable and p.default is p.empty]
    return names, required


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
