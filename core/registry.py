"""Component discovery through the ``alignzoo`` entry-point group, and per-run plugin managers.

Discovery reads entry-point metadata only; a component's module is imported when the component
is first asked for (or when ``alignzoo plugins`` loads everything to show summaries). Built-ins
are found exactly like outside packages: through the entry points in pyproject.toml.

Entry-point names are ``"<kind>.<name>"``, values ``"module:Class"``::

    [project.entry-points.alignzoo]
    "algorithm.my_grpo" = "my_package.algo:MyGRPO"
"""

from __future__ import annotations

import difflib
import importlib.metadata as metadata
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import pluggy
from pydantic import BaseModel

from alignzoo import hookspecs
from alignzoo.errors import (
    DuplicateComponentError,
    PluginLoadError,
    UnknownComponentError,
    UserError,
)
from alignzoo.plugin import KINDS, PROJECT, Component

ENTRY_POINT_GROUP = "alignzoo"
TRACE_ENV = "ALIGNZOO_TRACE_HOOKS"


@dataclass
class ComponentEntry:
    """One component as discovered: where it comes from, and (once loaded) its class or error."""

    kind: str
    name: str
    target: str
    distribution: str
    version: str
    entry_point: metadata.EntryPoint | None = None
    component: type[Component] | None = None
    error: str | None = None
    duplicates: list[ComponentEntry] = field(default_factory=list)

    @property
    def provider(self) -> str:
        return f"{self.distribution} {self.version}"

    def describe(self) -> str:
        return f"{self.kind} {self.name!r} ({self.target}, from {self.provider})"


class Registry:
    """All components installed, by kind and name."""

    def __init__(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> None:
        self._entries: dict[tuple[str, str], ComponentEntry] = {}
        self.malformed: list[ComponentEntry] = []
        if entry_points is None:
            entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in entry_points:
            self._add_entry_point(ep)

    # ------------------------------------------------------------------ discovery
    def _add_entry_point(self, ep: metadata.EntryPoint) -> None:
        dist = getattr(ep, "dist", None)
        entry = ComponentEntry(
            kind="?",
            name=ep.name,
            target=ep.value,
            distribution=dist.name if dist is not None else "<unknown>",
            version=dist.version if dist is not None else "?",
            entry_point=ep,
        )
        kind, sep, name = ep.name.partition(".")
        if not sep or kind not in KINDS or not name:
            entry.error = (
                f"entry point name {ep.name!r} must be '<kind>.<name>' with kind one of "
                f"{', '.join(KINDS)}"
            )
            self.malformed.append(entry)
            return
        entry.kind, entry.name = kind, name
        self._add(entry)

    def _add(self, entry: ComponentEntry) -> None:
        key = (entry.kind, entry.name)
        existing = self._entries.get(key)
        if existing is None:
            self._entries[key] = entry
        elif (existing.distribution, existing.target) != (entry.distribution, entry.target):
            existing.duplicates.append(entry)

    def register(self, component: type[Component], name: str, provider: str = "<local>") -> None:
        """Add a component class directly (notebooks, tests); same rules as an entry point."""
        entry = ComponentEntry(
            kind=component.kind,
            name=name,
            target=f"{component.__module__}:{component.__qualname__}",
            distribution=provider,
            version="",
            component=component,
        )
        self._check_component(entry, component)
        self._add(entry)

    # ------------------------------------------------------------------ lookup
    def entries(self, kind: str | None = None) -> list[ComponentEntry]:
        """Every discovered component (not loaded), sorted by kind then name."""
        found = [e for e in self._entries.values() if kind is None or e.kind == kind]
        return sorted(found, key=lambda e: (KINDS.index(e.kind), e.name))

    def names(self, kind: str) -> list[str]:
        return [e.name for e in self.entries(kind)]

    def get(self, kind: str, name: str) -> type[Component]:
        """Return the component class, importing its module if needed.

        Raises UnknownComponentError (with the known names and the closest match),
        DuplicateComponentError (naming both providers) or PluginLoadError.
        """
        if kind not in KINDS:
            raise UserError(f"unknown component kind {kind!r}; expected one of {', '.join(KINDS)}")
        entry = self._entries.get((kind, name))
        if entry is None:
            raise UnknownComponentError(unknown_name_message(kind, name, self.names(kind)))
        if entry.duplicates:
            providers = "; ".join(e.describe() for e in [entry, *entry.duplicates])
            raise DuplicateComponentError(
                f"{kind} {name!r} is provided twice: {providers}. Uninstall one of them."
            )
        self.load(entry)
        if entry.error is not None:
            raise PluginLoadError(f"cannot load {entry.describe()}: {entry.error}")
        assert entry.component is not None
        return entry.component

    def describe(self, kind: str, name: str) -> str:
        """``kind 'name' (module:Class, from distribution version)``, for messages."""
        entry = self._entries.get((kind, name))
        return entry.describe() if entry is not None else f"{kind} {name!r}"

    def load(self, entry: ComponentEntry) -> None:
        """Import an entry's component, recording (not raising) any failure in ``entry.error``."""
        if entry.component is not None or entry.error is not None or entry.entry_point is None:
            return
        try:
            obj: Any = entry.entry_point.load()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: a broken plugin must not take
            # the others (or the command) down
            what = "called sys.exit" if isinstance(exc, SystemExit) else type(exc).__name__
            entry.error = f"importing it raised {what}: {exc}"
            return
        try:
            self._check_component(entry, obj)
        except PluginLoadError as exc:
            entry.error = str(exc)
            return
        entry.component = obj

    def load_all(self, kind: str | None = None) -> list[ComponentEntry]:
        """Load every component (for listings); failures are recorded per entry."""
        entries = self.entries(kind)
        for entry in entries:
            self.load(entry)
        return entries

    @staticmethod
    def _check_component(entry: ComponentEntry, obj: Any) -> None:
        if not (isinstance(obj, type) and issubclass(obj, Component)):
            message = f"{entry.target} is not an alignzoo Component subclass"
            if callable(obj) and not isinstance(obj, type):
                module, _, function = entry.target.partition(":")
                message += (
                    f"; it is a function. A reward function needs no entry point: name it "
                    f"with the python labeler (labeler: {{name: python, params: {{function: "
                    f"'{module}:{function}'}}}}), or register a Labeler subclass"
                    if entry.kind == "labeler"
                    else "; it is a function: register a class (alignzoo new plugin writes one)"
                )
            raise PluginLoadError(message)
        component: type[Component] = obj
        if component.kind != entry.kind:
            raise PluginLoadError(
                f"{entry.target} is a {component.kind or 'component without kind'}, "
                f"but is registered as {entry.kind} {entry.name!r}"
            )
        params = getattr(component, "Params", None)
        if not (isinstance(params, type) and issubclass(params, BaseModel)):
            raise PluginLoadError(
                f"{entry.target}.Params must be a pydantic BaseModel subclass, got {params!r}"
            )


def unknown_name_message(kind: str, name: str, known: Sequence[str]) -> str:
    """'unknown algorithm 'grp'; did you mean 'grpo'? known: dpo, grpo, ...'"""
    message = f"unknown {kind} {name!r}"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    if close:
        message += f"; did you mean {close[0]!r}?"
    message += f" Known {kind}s: {', '.join(known) if known else '(none installed)'}"
    return message


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    """The process-wide registry of installed components (discovered once)."""
    return Registry()


def build_plugin_manager(components: Iterable[Component]) -> pluggy.PluginManager:
    """A fresh PluginManager holding exactly ``components`` (one run's arm).

    Hook implementations whose names match no hookspec are an error, so a typo in a plugin's
    method name is caught when the run is assembled, not silently ignored. With
    ``ALIGNZOO_TRACE_HOOKS=1`` every hook call is printed (see :func:`trace_hook_calls`).
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    if os.environ.get(TRACE_ENV, "") not in ("", "0"):
        trace_hook_calls(pm)
    try:
        for component in components:
            # register() rejects an implementation whose arguments the hookspec lacks
            # (``def compute_loss(self, batch, output)``): a plugin bug, reported like a typo.
            pm.register(
                component, name=f"{component.kind}:{type(component).__qualname__}:{id(component)}"
            )
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        message = str(exc)
        if "'score'" in message and "unknown hook" in message:
            message += (
                "; Labeler.score is a plain method called by the default score_batch hook: "
                "remove its @hookimpl"
            )
        raise PluginLoadError(message) from None
    return pm


def trace_hook_calls(
    pm: pluggy.PluginManager, write: Callable[[str], Any] | None = None
) -> Callable[[], None]:
    """Print every hook call of ``pm`` with the components it reached and its duration.

    One line per call to ``write`` (default: standard error), e.g.
    ``[alignzoo hook] compute_loss -> EntropyBonus, GRPO: 3.1 ms`` (a wrapper is entered first). This is pluggy's hook-call
    monitoring; what ``ALIGNZOO_TRACE_HOOKS=1`` turns on. Returns the function that stops it.
    """
    emit = write if write is not None else (lambda line: print(line, file=sys.stderr, flush=True))
    started: list[float] = []

    def before(hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        started.append(time.perf_counter())

    def after(
        outcome: pluggy.Result[Any], hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        elapsed = (time.perf_counter() - started.pop()) * 1e3 if started else 0.0
        names = ", ".join(type(i.plugin).__qualname__ for i in reversed(impls)) or "nobody"
        failed = " (raised)" if outcome.exception is not None else ""
        emit(f"[alignzoo hook] {hook_name} -> {names}: {elapsed:.1f} ms{failed}")

    return pm.add_hookcall_monitoring(before, after)
