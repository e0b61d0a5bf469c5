"""Locating a problem in an experiment file: the file, the line and the field where it is written.

A problem is found in the resolved experiment, where every arm holds the fields it inherits
from ``defaults``, the shared ``training`` and ``model`` sections, or the arm a sweep expanded.
A :class:`Locator`, built once per experiment file, reports it where the file writes the
value, so that one wrong shared value is one problem at its own line rather than one per arm.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from alignzoo.config.yamlfile import FieldPath, LineIndex
from alignzoo.errors import ConfigIssue


@dataclass(frozen=True)
class Locator:
    """Places a problem about a resolved field where the experiment file writes it."""

    file: str
    """The experiment file, as its issues name it."""
    index: LineIndex = field(default_factory=LineIndex)
    """The line of every field the file writes (empty: issues carry no line)."""
    fallbacks: Mapping[FieldPath, FieldPath] = field(default_factory=dict)
    """Resolved prefix -> where the file may write it instead: ``("arms", "a")`` ->
    ``("defaults",)``, ``("arms", "a", "training")`` -> ``("training",)``, and a swept arm's
    prefixes -> the arm it was expanded from."""

    @classmethod
    def for_experiment(
        cls, file: str, index: LineIndex, arms: Iterable[str], swept: Mapping[str, str]
    ) -> Locator:
        """The locator of an experiment file whose resolved ``arms`` inherit from ``defaults``
        and the shared sections, or, for an arm in ``swept`` (new arm -> its original), from
        the arm it was expanded from."""
        fallbacks: dict[FieldPath, FieldPath] = {}
        for arm in arms:
            for section in ("training", "model"):
                fallbacks[("arms", arm, section)] = (section,)
            fallbacks[("arms", arm)] = ("defaults",)
            if arm in swept:  # a problem in a swept arm is reported at the arm it came from
                fallbacks[("arms", arm)] = ("arms", swept[arm])
                for section in ("training", "model"):
                    fallbacks[("arms", arm, section)] = ("arms", swept[arm], section)
        return cls(file, index, fallbacks)

    def written_at(self, path: FieldPath) -> tuple[FieldPath, int | None]:
        """Where the value at resolved ``path`` is written, and its line: an arm's field that
        the arm leaves to ``defaults`` (or to the shared ``training`` / ``model``, or to the
        arm a sweep came from) is written there, so a problem in it is reported once, at its
        own place, rather than at every arm that inherits it."""
        lines = self.index.lines

        def unwritten(at: FieldPath) -> int:  # levels of ``at`` below its deepest written prefix
            return next(
                (len(at) - cut for cut in range(len(at), 0, -1) if at[:cut] in lines),
                len(at),
            )

        def scalar_above(at: FieldPath) -> bool:  # a shorthand (``labeler: name``) replaces it all
            cut = len(at) - unwritten(at)
            return 0 < cut < len(at) and not any(
                len(key) > cut and key[:cut] == at[:cut] for key in lines
            )

        # The arm's own path first, then defaults, then the shared sections: what the merge
        # lets win when two write the value equally deep.
        best, best_unwritten = path, unwritten(path)
        if best_unwritten == 0 or scalar_above(path):
            return path, self.index.line_of(path)
        for src, dst in sorted(self.fallbacks.items(), key=lambda item: len(item[0])):
            if path[: len(src)] == src:
                written = (*dst, *path[len(src) :])
                if unwritten(written) < best_unwritten:
                    best, best_unwritten = written, unwritten(written)
        line = lines.get(best)
        return best, line if line is not None else self.index.line_of(best)

    def issue(self, path: FieldPath, message: str) -> ConfigIssue:
        """A :class:`ConfigIssue` about the value at resolved ``path``, placed where it is
        written (:meth:`written_at`)."""
        written, line = self.written_at(path)
        return ConfigIssue(self.file, line, ".".join(map(str, written)), message)

    def validation_issues(
        self, exc: ValidationError, model: type[BaseModel], prefix: FieldPath = ()
    ) -> list[ConfigIssue]:
        """``exc``, raised validating ``model`` at resolved ``prefix``, as located issues: an
        unknown field with the closest known one, a missing one, or pydantic's message with
        the value found; one wrong shared value inherited by every arm is reported once."""
        issues: list[ConfigIssue] = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            known = _fields_at(model, _without_arm_name(loc[:-1])) if loc else []
            issues.append(self.issue((*prefix, *loc), _describe_error(err, known)))
        return list(dict.fromkeys(issues))


def _fields_at(model: type[BaseModel], loc: FieldPath) -> list[str]:
    """Field names of the pydantic model reached by walking ``loc`` (list indexes skipped)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        if part not in current.model_fields:
            return []
        current = _unwrap(current.model_fields[part].annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    """The pydantic model inside ``X | None``, ``list[X]`` or ``dict[str, X]``, else the annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation) or ():
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


def _without_arm_name(loc: FieldPath) -> FieldPath:
    """Drop the arm-name part when walking fields: arms.<name>.x -> arms.x for field lookup."""
    if len(loc) >= 2 and loc[0] == "arms":
        return ("arms", *loc[2:])
    return loc


def _describe_error(err: Any, known_fields: list[str]) -> str:
    """One pydantic error as the user reads it (``known_fields``: the fields a misspelled one
    is matched against)."""
    kind = err["type"]
    loc = err["loc"]
    if kind == "extra_forbidden":
        key = str(loc[-1]) if loc else "?"
        message = f"unknown field {key!r}"
        close = difflib.get_close_matches(key, known_fields, n=1, cutoff=0.6)
        if close:
            message += f"; did you mean {close[0]!r}?"
        elif known_fields:
            message += f"; expected one of: {', '.join(known_fields)}"
        return message
    if kind == "missing":
        return "required field is missing"
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if "input" in err and kind not in ("missing",) and not isinstance(err["input"], dict):
        message += f" (found {err['input']!r})"
    return message
