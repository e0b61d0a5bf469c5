"""Labeler "python": any Python function with TRL's reward-function signature.

``function: "path/to/file.py:fn"`` (a file, relative to the working directory) or
``"pkg.module:fn"`` (an importable module). The function is imported when the labeler is built
(so ``alignzoo validate`` reports a missing file or name), never before a YAML names it.

Signature: ``fn(prompts, completions, **columns) -> list[float | None]`` with one list entry
per response. The function is called by keyword, exactly as TRL calls reward functions:

- ``prompts``, ``completions``: texts; for conversational data (rows whose prompt is a list
  of messages) the prompt's messages and ``[{"role": "assistant", "content": text}]`` per
  completion, as TRL passes them;
- ``completion_ids``: the token ids the policy sampled for each completion;
- each dataset column by its name (e.g. ``answer``), as a list;
- ``trainer_state``: an object whose ``global_step`` is the training step the samples are
  for (TRL's ``TrainerState`` carries the same attribute), in evaluation the step evaluated
  (0 before training), None outside a run (``relabel``, a served labeler), and ``step``, the same number as a plain int;
- ``log_metric(name, value)``: a scalar for the step's metrics, as in TRL (reported as
  ``labeler/<name>/<metric>``, the mean of the values logged since the last labeling call);
  ``log_extra(column, values)``: one value per completion, kept in each sample's score info
  (``info["extra"][column]``, written to samples.jsonl);
- ``params.kwargs`` by name.

So ``def reward(completions, **kwargs)`` from TRL's documentation works as written; a
function without ``**kwargs`` gets only the arguments it names (and a clear error naming
what it asks for that the data does not have). ``alignzoo validate`` calls every python
function once on a real row of the arm's data, so a function that cannot be called is
refused before any model loads. A ``None`` entry abstains (the arm's policy decides: by
default the next labeler of the chain). An ``async def`` function is awaited. A function may
also return :class:`alignzoo.Score` objects. With ``--jobs > 1`` each worker imports the
function again from the same place.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.config.callables import load_callable
from alignzoo.errors import LabelerTimeout, LabelerUnavailable, UserError


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
        validate_call: bool = Field(
            True,
            description="alignzoo validate calls the function once on a real row of the data; "
            "false for a function whose calls cost something (a paid API).",
        )

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.fn = load_callable(self.params.function, "python labeler")
        self.accepts = accepted_arguments(self.fn)
        self.logged: dict[str, list[float]] = {}  # log_metric's values since stats() read them

    def stats(self) -> dict[str, float]:
        """The mean of each metric the function logged (``log_metric``) since the last read."""
        means = {name: sum(values) / len(values) for name, values in self.logged.items() if values}
        self.logged = {}
        return means

    def _log_metric(self, name: str, value: float) -> None:
        self.logged.setdefault(str(name), []).append(float(value))

    def provenance_sources(self) -> dict[str, str]:
        """The file the function is defined in, for the run's provenance."""
        try:
            return {"function": inspect.getfile(inspect.unwrap(self.fn))}
        except (TypeError, OSError):
            return {}

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        extra: dict[str, list[Any]] = {}

        def log_extra(column: str, values: list[Any]) -> None:
            extra.setdefault(str(column), []).extend(values)

        offered = offered_arguments(requests, self.params.kwargs)
        offered.update(log_metric=self._log_metric, log_extra=log_extra)
        arguments = self._arguments(offered)
        try:
            result = self.fn(**arguments)
        except (LabelerUnavailable, LabelerTimeout, UserError):  # keep what they mean
            raise
        except Exception as exc:  # named, so a run's failure says which function raised
            raise FunctionFailed(
                f"{self.params.function} raised {type(exc).__name__}: {exc}"
            ) from exc
        if inspect.isawaitable(result):
            result = asyncio.run(_wait(result))
        if not isinstance(result, (list, tuple)):
            return result  # type: ignore[no-any-return]  # the stage rejects it, saying why
        scores = [_as_score(v) for v in result]
        for column, values in extra.items():
            for score, value in zip(scores, values, strict=False):  # one per completion
                if isinstance(score, Score):
                    score.info.setdefault("extra", {})[column] = value
        return scores

    def dry_call(self, request: LabelRequest, where: str = "a row of the data") -> str:
        """Call the function once on ``request`` (from ``where``) as a training step would;
        '' when the answer is usable, else what went wrong and how to fix it (for
        ``alignzoo validate``)."""
        try:
            scores = self.score_batch([request])
        except Exception as raised:
            exc = raised.__cause__ if isinstance(raised, FunctionFailed) else raised
            text = f"{type(exc).__name__}: {exc}"
            hint = ""
            if isinstance(exc, TypeError) and not isinstance(exc, MissingArguments):
                hint = (
                    "; a reward function is called by keyword, as TRL calls it (prompts=, "
                    "completions=, completion_ids=, trainer_state=, each data column): take "
                    "**kwargs, or name only arguments the call gives"
                )
            return f"calling {self.params.function} on {where} raised {text}{hint}"
        if not isinstance(scores, (list, tuple)) or len(scores) != 1:
            return (
                f"{self.params.function} returned {type(scores).__name__} for one completion; "
                "expected a list with one number (or None) per completion"
            )
        if not isinstance(scores[0], Score):
            return (
                f"{self.params.function} returned {scores[0]!r} for a completion; expected a "
                "number, None (abstain) or an alignzoo.Score"
            )
        return ""

    def _arguments(self, offered: dict[str, Any]) -> dict[str, Any]:
        """What the function is called with: everything offered when it takes ``**kwargs``,
        else the arguments it names; a required one the call cannot give is a TypeError that
        says which and what there is."""
        if self.accepts is None:  # takes **kwargs (or cannot be inspected): TRL's call
            return offered
        names, required = self.accepts
        missing = [n for n in required if n not in offered]
        if missing:
            raise MissingArguments(
                f"{self.params.function} asks for {', '.join(missing)}, which the call does not "
                f"have (it offers {', '.join(sorted(offered))}): name a column of the data, "
                "give it in params.kwargs, or add **kwargs"
            )
        return {k: v for k, v in offered.items() if k in names}


class MissingArguments(TypeError):
    """The function names an argument the call cannot give (the message says which)."""


class FunctionFailed(RuntimeError):
    """The reward function raised (the original is the ``__cause__``); the message names the
    function."""


@dataclass(frozen=True)
class TrainerState:
    """What a reward function gets as ``trainer_state``: the step, under TRL's name."""

    global_step: int | None


def offered_arguments(requests: list[LabelRequest], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Everything a reward function may be called with for ``requests`` (TRL's names)."""
    conversational = bool(requests) and all(
        isinstance(r.extra.get("prompt_messages"), list) for r in requests
    )
    if conversational:
        prompts: list[Any] = [r.extra["prompt_messages"] for r in requests]
        completions: list[Any] = [[{"role": "assistant", "content": r.response}] for r in requests]
    else:
        prompts = [r.prompt for r in requests]
        completions = [r.response for r in requests]
    names = sorted({k for r in requests for k in r.extra})
    columns = {k: [r.extra.get(k) for r in requests] for k in names}
    step = requests[0].step if requests else None
    return {
        **columns,
        "prompts": prompts,
        "completions": completions,
        "completion_ids": [r.completion_ids for r in requests],
        "trainer_state": TrainerState(step),
        "step": step,
        **kwargs,
    }


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
