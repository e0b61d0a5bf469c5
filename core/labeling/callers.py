"""Calling one labeler: in this process or in a worker process of its own that is killed and
replaced when a call runs past its timeout, and the circuit breaker that stops calling a
labeler that keeps failing. Every call ends in one :class:`~alignzoo.labeling.interface.Score`
per request (:func:`interpret` checks what came back).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from alignzoo.errors import LabelerTimeout, LabelerUnavailable, UserError
from alignzoo.labeling.interface import LabelRequest, Outcome, Score, check_scores, start_labeler

if TYPE_CHECKING:
    from alignzoo.config.schema import BreakerConfig
    from alignzoo.engine.hooks import Hooks

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


def interpret(scores: Any, n: int) -> CallResult:
    checked = check_scores(scores, n)
    if isinstance(checked, str):
        return failed_call(n, Outcome.REJECTED, f"the labeler {checked}")
    return CallResult(checked)


class InlineCaller:
    """Calls a labeler in this process (no timeout can end a synchronous call here)."""

    def __init__(self, hooks: Hooks, component: Any = None) -> None:
        self.hooks = hooks
        self.component = component

    def __call__(self, requests: list[LabelRequest], timeout: float | None) -> CallResult:
        try:
            scores = self.hooks.pm.hook.score_batch(requests=requests)
        except LabelerTimeout as exc:
            return failed_call(len(requests), Outcome.TIMEOUT, str(exc), exc.retry_after)
        except LabelerUnavailable as exc:
            return failed_call(len(requests), Outcome.ERROR, str(exc), exc.retry_after)
        except (KeyboardInterrupt, SystemExit, UserError):
            raise  # a problem the user must fix is not retried away
        except Exception as exc:
            return failed_call(
                len(requests), Outcome.ERROR, f"the labeler failed: {type(exc).__name__}: {exc}"
            )
        return interpret(scores, len(requests))

    def close(self) -> None:
        """Let the labeler release what it holds (connections, pools): its ``close()``."""
        close = getattr(self.component, "close", None)
        if callable(close):
            close()


def _worker_main(conn: Any, cls: Any, params: dict[str, Any]) -> None:
    """A labeler worker process: build the labeler, say it is ready, then answer calls until
    told to stop."""
    from alignzoo.registry import build_plugin_manager

    try:
        pm = build_plugin_manager([cls(cls.Params.model_validate(params))])
        start_labeler(pm)
    except Exception as exc:
        conn.send(("error", f"the labeler did not start: {type(exc).__name__}: {exc}", None))
        return
    conn.send(("ready",))
    while True:
        try:
            requests = conn.recv()
        except EOFError:
            return
        if requests is None:
            return
        try:
            conn.send(("ok", pm.hook.score_batch(requests=requests)))
        except LabelerUnavailable as exc:
            conn.send(("unavailable", str(exc), exc.retry_after))
        except Exception as exc:
            conn.send(("error", f"the labeler failed: {type(exc).__name__}: {exc}", None))


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
        return None if reply[0] == "ready" else str(reply[1])

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
            return interpret(rest[0], len(requests))
        outcome = Outcome.ERROR
        return failed_call(len(requests), outcome, str(rest[0]), rest[1])

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
    running_mean: float | None = None  # of its per-pass mean values, for drift
    drift: float | None = None  # this pass's mean minus the running mean before it
    latencies: list[float] = field(default_factory=list)
    slowest: list[tuple[float, int, LabelRequest]] = field(default_factory=list)  # (s, n, first)
    calls: int = 0
    retries: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
