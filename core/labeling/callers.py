"""Calling one labeler: in this process or in a worker process of its own that is killed and
replaced when a call runs past its timeout, and the circuit breaker that stops calling a
labeler that keeps failing. Every call ends in one :class:`~alignzoo.labeling.interface.Score`
per request (:func:`interpret` checks what came back).

Both callers give the same outcome for the same thing (:func:`outcome_of`): an exception that
is a timeout inside the labeler (:class:`~alignzoo.errors.LabelerTimeout`, ``TimeoutError``
and ``socket.timeout``, ``asyncio`` / ``concurrent.futures`` timeouts, ``httpx`` and
``requests`` timeouts, or any exception raised *from* one, e.g. a ``LabelerUnavailable``
raised from a read timeout) is ``timeout``; any other exception is ``error``; a
:class:`~alignzoo.errors.UserError` stops the run. A worker classifies the exception itself
and sends the outcome back, so the arm's ``on.timeout`` applies in a worker as in process.

A labeler's own counters (its ``stats()``, see :func:`stats_counters`) reach the stage from
either caller: :meth:`InlineCaller.stats` asks the labeler, a worker sends its ``stats()``
with every answer and :meth:`ProcessCaller.stats` keeps the running totals over the workers it
started (a replaced worker's counters start again from zero; its totals are kept).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import multiprocessing
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from alignzoo.errors import LabelerTimeout, LabelerUnavailable, UserError
from alignzoo.labeling.interface import LabelRequest, Outcome, Score, check_scores, start_labeler

if TYPE_CHECKING:
    import pluggy

    from alignzoo.config.schema import BreakerConfig


class Hooks(Protocol):
    """What labeling needs of a labeler's hooks: its plugin manager (the engine's
    :class:`alignzoo.engine.hooks.Hooks` is one; labeling imports nothing of the engine)."""

    pm: pluggy.PluginManager


WORKER_START_S = 120.0
"""How long a labeler worker process may take to start (not part of a call's timeout)."""
FAILURES = (Outcome.TIMEOUT, Outcome.ERROR)
"""Outcomes that count against a labeler's circuit breaker (the call itself failed)."""


@dataclass
class CallResult:
    """What one call of one labeler gave: a Score or an outcome per request."""

    scores: list[Score]
    retry_after: float | None = None


def failed_call(
    n: int, outcome: Outcome, reason: str, retry_after: float | None = None
) -> CallResult:
    return CallResult(
        [Score(math.nan, False, {"reason": reason}, outcome) for _ in range(n)], retry_after
    )


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from, ``raise ... from``) is a timeout
    inside the labeler: see the module docstring."""
    kinds: list[type] = [
        LabelerTimeout,
        TimeoutError,  # socket.timeout is TimeoutError (Python 3.10+)
        asyncio.TimeoutError,
        concurrent.futures.TimeoutError,
    ]
    httpx = sys.modules.get("httpx")  # only when the labeler uses it (then it is imported)
    if httpx is not None:
        kinds.append(httpx.TimeoutException)
    requests = sys.modules.get("requests.exceptions")
    if requests is not None:
        kinds.append(requests.Timeout)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, tuple(kinds)):
            return True
        current = current.__cause__
    return False


def outcome_of(exc: Exception) -> tuple[Outcome, str, float | None]:
    """The outcome, reason and ``retry_after`` of a call that raised ``exc``: ``timeout`` for a
    timeout inside the labeler (:func:`is_timeout`), else ``error``. The same in process and in
    a worker (which sends these back, not the exception)."""
    retry_after = exc.retry_after if isinstance(exc, LabelerUnavailable) else None
    if isinstance(exc, LabelerUnavailable):
        reason = str(exc)
    else:
        reason = f"the labeler failed: {type(exc).__name__}: {exc}"
    return (Outcome.TIMEOUT if is_timeout(exc) else Outcome.ERROR), reason, retry_after


def stats_counters(labeler: Any) -> frozenset[str]:
    """The keys of ``labeler.stats()`` that are counters: those it names in its
    ``stats_counters`` class attribute (running totals since it was built, never decreasing).
    The stage reports a counter per labeling pass (the increase over the pass: the step
    metric ``labeler/<name>/<key>``, and the Prometheus counter
    ``alignzoo_labeler_stat_total{stat=<key>}``); every other key is a plain value (a
    gauge: the latest value, e.g. a reward-model ensemble's ``rm_std``)."""
    return frozenset(getattr(labeler, "stats_counters", ()) or ())


def _stats_of(labeler: Any) -> dict[str, float]:
    """The labeler's ``stats()`` (numbers only), or nothing when it has none or they fail."""
    stats = getattr(labeler, "stats", None)
    if not callable(stats):
        return {}
    try:
        return {str(k): float(v) for k, v in (stats() or {}).items()}
    except Exception:  # a labeler's own counters never fail a call
        return {}


def interpret(scores: Any, requests: list[LabelRequest]) -> CallResult:
    checked = check_scores(scores, len(requests), [r.response for r in requests])
    if isinstance(checked, str):
        return failed_call(len(requests), Outcome.REJECTED, f"the labeler {checked}")
    return CallResult(checked)


class InlineCaller:
    """Calls a labeler in this process (no timeout can end a synchronous call here)."""

    def __init__(self, hooks: Hooks, component: Any = None) -> None:
        self.hooks = hooks
        self.component = component

    def __call__(self, requests: list[LabelRequest], timeout: float | None) -> CallResult:
        try:
            scores = self.hooks.pm.hook.score_batch(requests=requests)
        except (KeyboardInterrupt, SystemExit, UserError):
            raise  # a problem the user must fix is not retried away
        except Exception as exc:
            return failed_call(len(requests), *outcome_of(exc))
        return interpret(scores, requests)

    def stats(self) -> dict[str, float]:
        """The labeler's own ``stats()`` (running totals for its counters)."""
        return _stats_of(self.component)

    @property
    def counters(self) -> frozenset[str]:
        return stats_counters(self.component)

    def close(self) -> None:
        """Let the labeler release what it holds (connections, pools): its ``close()``."""
        close = getattr(self.component, "close", None)
        if callable(close):
            close()


def _worker_main(conn: Any, cls: Any, params: dict[str, Any]) -> None:
    """A labeler worker process: build the labeler, say it is ready (with its ``stats()``),
    then answer calls until told to stop. Every answer carries the labeler's ``stats()``; an
    exception is sent as its outcome (:func:`outcome_of`), never pickled."""
    from alignzoo.registry import build_plugin_manager

    try:
        labeler = cls(cls.Params.model_validate(params))
        pm = build_plugin_manager([labeler])
        start_labeler(pm)
    except Exception as exc:
        conn.send(("error", f"the labeler did not start: {type(exc).__name__}: {exc}", None))
        return
    conn.send(("ready", _stats_of(labeler)))
    while True:
        try:
            requests = conn.recv()
        except EOFError:
            return
        if requests is None:
            return
        try:
            scores = pm.hook.score_batch(requests=requests)
        except UserError as exc:
            conn.send(("user_error", str(exc), _stats_of(labeler)))
        except Exception as exc:
            outcome, reason, retry_after = outcome_of(exc)
            conn.send(("failed", outcome.value, reason, retry_after, _stats_of(labeler)))
        else:
            conn.send(("ok", scores, _stats_of(labeler)))


class ProcessCaller:
    """Calls a labeler in a worker process of its own, started on first use.

    A call that runs past its timeout is ended: the worker is killed (and reaped), and the
    next call starts a new one. A worker that dies gives ``error`` for its call. The time a
    worker takes to start (imports, building the labeler) does not count against the call's
    timeout; it has :data:`WORKER_START_S` of its own.
    """

    def __init__(self, component: Any) -> None:
        self.cls = type(component)
        self.params = component.params.model_dump(mode="json")
        self.process: Any = None
        self.conn: Any = None
        self.started = 0  # how many workers were started (the first, then replacements)
        self.counted: Counter[str] = Counter()  # the labeler's counters over every worker
        self.values: dict[str, float] = {}  # its other stats, as the latest answer gave them
        self.worker_stats: dict[str, float] = {}  # the current worker's last stats()
        self.answered = 0.0  # when a worker last sent stats (the newest of a pool wins)

    @property
    def counters(self) -> frozenset[str]:
        return stats_counters(self.cls)

    def stats(self) -> dict[str, float]:
        """The labeler's ``stats()`` as its workers reported them: counters as running totals
        over every worker this caller started (a new worker counts from its own start), other
        keys as the latest answer gave them."""
        return {**self.values, **{k: float(v) for k, v in self.counted.items()}}

    def _take_stats(self, stats: Any) -> None:
        if not isinstance(stats, dict):
            return
        counters = self.counters
        for key, value in stats.items():
            if key in counters:
                grown = value - self.worker_stats.get(key, 0.0)
                self.counted[key] += grown if grown >= 0 else value  # a reset: count afresh
            else:
                self.values[key] = value
        self.worker_stats = dict(stats)
        self.answered = time.monotonic()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(child, self.cls, self.params), daemon=True
        )
        self.process.start()
        child.close()
        self.conn = parent
        self.started += 1

    def _ready(self) -> str | None:
        """Wait for a new worker's ready message; the reason it is not ready, or None."""
        assert self.conn is not None
        try:
            if not self.conn.poll(WORKER_START_S):
                return f"the labeler's worker did not start within {WORKER_START_S:.0f} s"
            reply = self.conn.recv()
        except (EOFError, OSError) as exc:
            return f"the labeler's worker died while starting ({exc})"
        if reply[0] != "ready":
            return str(reply[1])
        # the new worker's counters start here: what it counts from now on is new
        self.worker_stats = dict(reply[1]) if len(reply) > 1 else {}
        for key, value in self.worker_stats.items():
            if key not in self.counters:
                self.values[key] = value
        return None

    def _kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join(timeout=5)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None

    def __call__(self, requests: list[LabelRequest], timeout: float | None) -> CallResult:
        if self.process is None or not self.process.is_alive():
            self._kill()
            self._start()
            problem = self._ready()
            if problem is not None:
                self._kill()
                return failed_call(len(requests), Outcome.ERROR, problem)
        assert self.conn is not None
        try:
            self.conn.send(requests)
            ready = self.conn.poll(timeout)
            reply = self.conn.recv() if ready else None
        except (EOFError, OSError, BrokenPipeError) as exc:
            self._kill()
            return failed_call(len(requests), Outcome.ERROR, f"the labeler's worker died ({exc})")
        if reply is None:
            self._kill()  # the call is ended, not abandoned
            return failed_call(len(requests), Outcome.TIMEOUT, f"no answer within {timeout} s")
        kind, *rest = reply
        if kind == "ok":
            self._take_stats(rest[1])
            return interpret(rest[0], requests)
        if kind == "user_error":  # as in process: a problem the user must fix stops the run
            self._take_stats(rest[1])
            raise UserError(str(rest[0]))
        if kind == "failed":
            outcome, reason, retry_after, stats = rest
            self._take_stats(stats)
            return failed_call(len(requests), Outcome(outcome), str(reason), retry_after)
        return failed_call(len(requests), Outcome.ERROR, str(rest[0]), rest[1])

    def close(self) -> None:
        if self.conn is not None and self.process is not None and self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout=2)
        self._kill()


# --------------------------------------------------------------------------- circuit breaker


class Breaker:
    """closed -> open (skip the labeler) -> half-open (one probe) -> closed or open again."""

    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.clock = cfg, clock
        self.calls: deque[bool] = deque(maxlen=cfg.window)  # True = the call failed
        self.state = "closed"
        self.opened_at = 0.0
        self.trips = 0

    def allow(self) -> bool:
        """Whether a call may go to the labeler now (an open breaker past its cooldown lets
        one probe through)."""
        if self.state == "open" and self.clock() - self.opened_at >= self.cfg.cooldown_s:
            self.state = "half-open"
        return self.state != "open"

    def record(self, failed: bool) -> None:
        if self.state == "half-open":
            if failed:
                self._open()
            else:
                self.state = "closed"
                self.calls.clear()
            return
        self.calls.append(failed)
        if (
            len(self.calls) >= self.cfg.min_calls
            and sum(self.calls) / len(self.calls) >= self.cfg.error_rate
        ):
            self._open()

    def _open(self) -> None:
        self.state = "open"
        self.opened_at = self.clock()
        self.trips += 1
        self.calls.clear()


# --------------------------------------------------------------------------- the chain


def slot_stats(slot: Slot) -> tuple[dict[str, float], frozenset[str]]:
    """The labeler's ``stats()`` over the slot's callers (a pool of workers: counters summed,
    other keys from the worker that answered last) and which keys are counters."""
    callers = slot.pool or [slot.call]
    stats = getattr(callers[0], "stats", None)
    if not callable(stats):
        return {}, frozenset()
    counters: frozenset[str] = getattr(callers[0], "counters", frozenset())
    if len(callers) == 1:
        return stats(), counters
    merged: dict[str, float] = {}
    for caller in sorted(callers, key=lambda c: getattr(c, "answered", 0.0)):
        for key, value in caller.stats().items():
            merged[key] = merged.get(key, 0.0) + value if key in counters else value
    return merged, counters


@dataclass
class Slot:
    """One labeler of an arm's chain."""

    name: str
    call: Any  # InlineCaller | ProcessCaller
    breaker: Breaker
    identity: str | None = None  # the label store's key for this labeler (None: not stored)
    pool: list[Any] = field(default_factory=list)  # more worker processes (concurrency > 1)
    values: list[float] = field(default_factory=list)  # the values it gave in this pass
    in_flight_max: int = 0
    queued_max: int = 0
    drift: float | None = None  # this pass's mean minus the running mean before it
    stats: dict[str, float] = field(default_factory=dict)  # its stats() for this pass
    failed_calls: int = 0  # calls of this pass that failed whole (what the breaker counts)
    latencies: list[float] = field(default_factory=list)
    slowest: list[tuple[float, int, LabelRequest]] = field(default_factory=list)  # (s, n, first)
    calls: int = 0
    retries: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
