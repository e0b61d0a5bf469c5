"""The label stage: every response of a step gets a typed outcome from a chain of labelers.

An arm's labeler is the head of a chain (``labeling.fallbacks`` are tried in order after it).
For each call the stage:

1. skips a labeler whose circuit breaker is open (its samples move on down the chain);
2. calls it on the samples still without a value: inline, or in a worker process of its own
   (``labeling.isolation: process``, implied by ``timeout_s``) that is killed and replaced when
   a call runs past ``timeout_s``: a timed-out call is ended, never abandoned;
3. turns what came back into one :class:`~alignzoo.types.Outcome` per sample: a value, the
   labeler's own abstain / parse failure, ``rejected`` (NaN, inf, wrong count or type),
   ``error`` (an exception, :class:`~alignzoo.errors.LabelerUnavailable`, a dead worker) or
   ``timeout``;
4. applies the arm's policy per outcome (``labeling.on``): retry with exponential backoff and
   jitter (waiting a labeler's ``retry_after`` when it gave one; no retry starts after the
   step's ``deadline_s``), fall back to the next labeler, drop the sample, drop its group, or
   fail the run.

The result is a :class:`LabelReport`: per sample the outcome and which labeler valued it, the
samples to keep, and a ledger that must balance (generated = valued + fallback-valued +
dropped, by outcome); :meth:`LabelReport.metrics` puts it into the step's metrics under
``label/*``.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.engine.labelstore import LabelStore, labeler_identity, request_key
from alignzoo.errors import LabelerTimeout, LabelerUnavailable, RunError, UserError
from alignzoo.types import LabelRequest, Outcome, Score

if TYPE_CHECKING:
    from alignzoo.config.schema import BreakerConfig, LabelingConfig
    from alignzoo.engine.hooks import Hooks

WORKER_START_S = 120.0
"""How long a labeler worker process may take to start (not part of a call's timeout)."""
FAILURES = (Outcome.TIMEOUT, Outcome.ERROR)
"""Outcomes that count against a labeler's circuit breaker (the call itself failed)."""


def label_requests(batch: RolloutBatch) -> list[LabelRequest]:
    """One request per sample: prompt text, response text and the dataset's extra columns."""
    extras = batch.extras or [{} for _ in range(batch.size)]
    return [
        LabelRequest(prompt=p, response=r, extra=dict(e))
        for p, r, e in zip(batch.prompts, batch.responses, extras, strict=True)
    ]


class StandaloneRun:
    """What a labeler's ``on_run_start`` gets outside a training run (a labeler server, a
    worker process, ``alignzoo relabel``): every role on ``device``, no folder, no console."""

    def __init__(self, name: str = "labeler", device: str = "cpu") -> None:
        self.name, self._device = name, device
        self.out_dir = None
        self.console = None
        self.state: dict[str, Any] = {}
        self.step = 0

    def device(self, role: str) -> str:
        return self._device


def start_labeler(pm: Any, run: Any = None) -> None:
    """Call the labeler's ``on_run_start`` (a reward model loads its weights there)."""
    pm.hook.on_run_start(run=run if run is not None else StandaloneRun())


# --------------------------------------------------------------------------- one labeler call


@dataclass
class CallResult:
    """What one call of one labeler gave: a Score or an outcome per request."""

    scores: list[Score]
    retry_after: float | None = None


def _failed(n: int, outcome: Outcome, reason: str, retry_after: float | None = None) -> CallResult:
    return CallResult(
        [Score(math.nan, False, {"reason": reason}, outcome) for _ in range(n)], retry_after
    )


def check_scores(scores: Any, n: int) -> list[Score] | str:
    """One Score per request: what the labeler returned where usable, a ``rejected`` Score
    (with the reason) for an item that is not a Score or whose value is not a finite number;
    or the reason the whole answer is rejected (not a list, the wrong count)."""
    if not isinstance(scores, (list, tuple)):
        return f"returned {type(scores).__name__}, not a list of Score"
    if len(scores) != n:
        return f"returned {len(scores)} scores for {n} responses"
    out = []
    for i, s in enumerate(scores):
        problem = None
        if not isinstance(s, Score):
            problem = f"returned {type(s).__name__} for response {i}, not a Score"
        elif s.outcome == Outcome.VALUE:
            try:
                value = float(s.value)
            except (TypeError, ValueError):
                problem = f"returned Score(value={s.value!r}) for response {i}; expected a number"
            else:
                if not math.isfinite(value):
                    problem = f"returned a non-finite score ({value}) for response {i}"
        if problem is None:
            out.append(s)
        else:
            out.append(
                Score(math.nan, False, {"reason": f"the labeler {problem}"}, Outcome.REJECTED)
            )
    return out


def _interpret(scores: Any, n: int) -> CallResult:
    checked = check_scores(scores, n)
    if isinstance(checked, str):
        return _failed(n, Outcome.REJECTED, f"the labeler {checked}")
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
            return _failed(len(requests), Outcome.TIMEOUT, str(exc), exc.retry_after)
        except LabelerUnavailable as exc:
            return _failed(len(requests), Outcome.ERROR, str(exc), exc.retry_after)
        except (KeyboardInterrupt, SystemExit, UserError):
            raise  # a problem the user must fix is not retried away
        except Exception as exc:
            return _failed(
                len(requests), Outcome.ERROR, f"the labeler failed: {type(exc).__name__}: {exc}"
            )
        return _interpret(scores, len(requests))

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
                return _failed(len(requests), Outcome.ERROR, problem)
        assert self.conn is not None
        try:
            self.conn.send(requests)
            ready = self.conn.poll(timeout)
            reply = self.conn.recv() if ready else None
        except (EOFError, OSError, BrokenPipeError) as exc:
            self._kill()
            return _failed(len(requests), Outcome.ERROR, f"the labeler's worker died ({exc})")
        if reply is None:
            self._kill()  # the call is ended, not abandoned
            return _failed(len(requests), Outcome.TIMEOUT, f"no answer within {timeout} s")
        kind, *rest = reply
        if kind == "ok":
            return _interpret(rest[0], len(requests))
        outcome = Outcome.ERROR
        return _failed(len(requests), outcome, str(rest[0]), rest[1])

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


@dataclass
class LabelReport:
    """One labeling pass: per sample its outcome and who valued it; what to keep; the ledger."""

    scores: list[Score]
    outcomes: list[Outcome]
    valued_by: list[str | None]
    keep: list[int]
    dropped: Counter[str] = field(default_factory=Counter)  # by outcome
    slots: list[Slot] = field(default_factory=list)
    shadow: dict[str, float] = field(default_factory=dict)  # agreement of a shadow labeler
    snapshot: dict[str, float] | None = None  # metrics() as the pass ended (set by the stage)
    slowest: list[dict[str, Any]] = field(default_factory=list)  # the pass's slowest calls

    def ledger(self) -> dict[str, int]:
        """generated, valued (by the head), fallback-valued, dropped: they must balance."""
        head = self.slots[0].name if self.slots else None
        valued = sum(1 for v in self.valued_by if v is not None and v == head)
        fallback = sum(1 for v in self.valued_by if v is not None and v != head)
        return {
            "generated": len(self.outcomes),
            "valued": valued,
            "fallback_valued": fallback,
            "dropped": sum(self.dropped.values()),
        }

    def metrics(self) -> dict[str, float]:
        """``label/*``: the ledger and drops by outcome (the same in a resumed run as in an
        uninterrupted one). ``labeler/<name>/*``: how the labels were obtained, per labeler:
        calls, retries, counts by outcome, ``stored`` (reused from the label store),
        ``deduplicated`` (identical requests sent once), breaker state (0 closed, 1 half-open,
        2 open), ``in_flight_max`` and ``queued_max`` (calls at once, chunks waiting), the
        values it gave (``value_p10/p50/p90``, ``value_mean``, and ``drift``: this pass's mean
        minus the running mean of its earlier passes), and whatever its ``stats()`` reports
        (the judge's rate-limit waits); the latency of its calls (p50/p95/max) under
        ``timing/labeler/<name>/``. These depend on what the process saw before (a resumed run
        finds its labels stored), so resume comparisons leave them out.

        Read after the pass, this is the snapshot the stage took when the pass ended (a later
        pass, running ahead with ``labeling.overlap``, does not change it)."""
        if self.snapshot is not None:
            return dict(self.snapshot)
        ledger = self.ledger()
        out = {f"label/{k}": float(v) for k, v in ledger.items()}
        for outcome, n in sorted(self.dropped.items()):
            out[f"label/dropped/{outcome}"] = float(n)
        out.update(self.shadow)
        for slot in self.slots:
            prefix = f"labeler/{slot.name}"  # how labels were obtained: calls, the store, ...
            out[f"{prefix}/calls"] = float(slot.calls)
            out[f"{prefix}/retries"] = float(slot.retries)
            for outcome, n in sorted(slot.outcomes.items()):
                out[f"{prefix}/{outcome}"] = float(n)
            if slot.latencies:
                ordered = sorted(slot.latencies)
                timing = f"timing/labeler/{slot.name}"  # wall-clock: volatile, like timing/*
                out[f"{timing}/p50"] = ordered[len(ordered) // 2]
                out[f"{timing}/p95"] = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
                out[f"{timing}/max"] = ordered[-1]
            states = {"closed": 0.0, "half-open": 1.0, "open": 2.0}
            out[f"{prefix}/breaker"] = states[slot.breaker.state]
            out[f"{prefix}/in_flight_max"] = float(slot.in_flight_max)
            out[f"{prefix}/queued_max"] = float(max(0, slot.queued_max))
            if slot.values:
                ordered = sorted(slot.values)
                for q in (10, 50, 90):  # the distribution of the values it gave
                    out[f"{prefix}/value_p{q}"] = ordered[
                        min(len(ordered) - 1, len(ordered) * q // 100)
                    ]
                out[f"{prefix}/value_mean"] = sum(ordered) / len(ordered)
                if slot.drift is not None:
                    out[f"{prefix}/drift"] = slot.drift
            stats = getattr(getattr(slot.call, "component", None), "stats", None)
            if callable(stats):
                for key, value in stats().items():  # the labeler's own counters (rate limits)
                    out[f"{prefix}/{key}"] = float(value)
        return out


class MetricsExporter:
    """The label path's metrics of the latest pass on a Prometheus endpoint (127.0.0.1)."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.gauge = Gauge(
            "alignzoo_labeling",
            "Label path metrics of the latest labeling pass",
            ["metric"],
            registry=self.registry,
        )
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def update(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.gauge.labels(name).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class LabelingStage:
    """An arm's labeler chain with its policies (see the module docstring)."""

    def __init__(
        self,
        cfg: LabelingConfig,
        slots: Sequence[Slot],
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        store: LabelStore | None = None,
    ) -> None:
        self.cfg = cfg
        self.slots = list(slots)
        self.store = store
        self.shadow: Slot | None = None
        self.exporter: MetricsExporter | None = None
        if cfg.metrics_port is not None:
            self.exporter = MetricsExporter(cfg.metrics_port)
        self.sleep, self.clock = sleep, clock
        self.rng = random.Random(seed)
        self.lock = threading.RLock()  # one pass at a time; a swap waits for the pass in flight

    @classmethod
    def build(
        cls,
        cfg: LabelingConfig,
        labelers: Sequence[tuple[str, Any, Hooks]],
        seed: int = 0,
        store: LabelStore | None = None,
    ) -> LabelingStage:
        """A stage over (name, component, hooks of that component alone) labelers; with a
        ``store``, labels are looked up and persisted there."""
        process = cfg.isolation == "process" or cfg.timeout_s is not None
        slots = []
        for name, component, hooks in labelers:
            caller = ProcessCaller(component) if process else InlineCaller(hooks, component)
            slot = Slot(
                name,
                caller,
                Breaker(cfg.breaker),
                identity=labeler_identity(component) if component is not None else None,
            )
            if process and cfg.concurrency > 1:
                slot.pool = [caller] + [
                    ProcessCaller(component) for _ in range(cfg.concurrency - 1)
                ]
            slots.append(slot)
        return cls(cfg, slots, seed=seed, store=store)

    def close(self) -> None:
        for slot in self.slots:
            slot.call.close()
            for caller in slot.pool:
                caller.close()
        if self.shadow is not None:
            self.shadow.call.close()
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        wait = min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2**attempt)
        wait *= 0.5 + self.rng.random()  # jitter: 50% to 150%
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.cfg.backoff_max_s * 4))
        return wait

    def _policy(self, outcome: Outcome) -> str:
        return str(getattr(self.cfg.on, outcome.value))

    def label(
        self, requests: list[LabelRequest], groups: Sequence[int] | None = None
    ) -> LabelReport:
        """Label every request through the chain; see :class:`LabelReport`. Thread-safe: one
        pass runs at a time (with ``labeling.overlap`` a pass runs beside the main thread)."""
        with self.lock:
            return self._label(requests, groups)

    def _label(self, requests: list[LabelRequest], groups: Sequence[int] | None) -> LabelReport:
        n = len(requests)
        scores: list[Score] = [Score(math.nan, False, {}, Outcome.ERROR) for _ in range(n)]
        outcomes: list[Outcome] = [Outcome.ERROR] * n
        valued_by: list[str | None] = [None] * n
        final: dict[int, str] = {}  # sample -> drop_sample | drop_group | fail
        for slot in self.slots:
            slot.latencies = []
            slot.calls = slot.retries = 0
            slot.outcomes = Counter()
            slot.values = []
            slot.slowest = []
            slot.in_flight_max = slot.queued_max = 0
        started = self.clock()
        pending = list(range(n))
        for slot in self.slots:
            if not pending:
                break
            pending = self._through(
                slot, requests, pending, scores, outcomes, valued_by, final, started
            )
        for i in pending:  # no labeler of the chain gave a value
            final[i] = self.cfg.on.exhausted
        report = LabelReport(scores, outcomes, valued_by, [], slots=self.slots)
        fail = [i for i, what in final.items() if what == "fail"]
        if fail:
            i = fail[0]
            raise RunError(
                f"labeling: response {i} has outcome {outcomes[i].value} "
                f"({scores[i].info.get('reason', '')}) and the arm's policy is 'fail'"
            )
        drop_groups = {
            groups[i] for i, what in final.items() if what == "drop_group" and groups is not None
        }
        for i in range(n):
            if i in final:
                report.dropped[outcomes[i].value] += 1
            elif groups is not None and groups[i] in drop_groups:
                report.dropped["group"] += 1  # valued, but its group is left out
                valued_by[i] = None
            else:
                report.keep.append(i)
        broken = (Outcome.ERROR, Outcome.TIMEOUT, Outcome.REJECTED)
        if n and not report.keep and all(o in broken for o in outcomes):
            raise RunError(
                f"labeling: no labeler of the chain ({', '.join(s.name for s in self.slots)}) "
                f"gave a value for any of the {n} responses; first: {outcomes[0].value}: "
                f"{scores[0].info.get('reason', '')}"
            )
        ledger = report.ledger()
        if ledger["generated"] != ledger["valued"] + ledger["fallback_valued"] + ledger["dropped"]:
            raise RunError(f"labeling: the ledger does not balance: {ledger}")  # a bug here
        if self.shadow is not None:
            report.shadow = self._shadow_agreement(requests, report)
        for slot in self.slots:  # drift: once per pass, against the passes before
            slot.drift = None
            if slot.values:
                mean = sum(slot.values) / len(slot.values)
                if slot.running_mean is not None:
                    slot.drift = mean - slot.running_mean
                    slot.running_mean = 0.9 * slot.running_mean + 0.1 * mean
                else:
                    slot.running_mean = mean
        report.snapshot = report.metrics()
        report.slowest = slowest_calls(self.slots)
        if self.exporter is not None:
            self.exporter.update(report.snapshot)
        return report

    def _shadow_agreement(
        self, requests: list[LabelRequest], report: LabelReport
    ) -> dict[str, float]:
        """Score the kept samples with the shadow labeler (never trained on) and compare."""
        assert self.shadow is not None
        kept = [i for i in report.keep if report.outcomes[i] == Outcome.VALUE]
        if not kept:
            return {}
        result = self.shadow.call([requests[i] for i in kept], self.cfg.timeout_s)
        pairs = [
            (float(report.scores[i].value), float(s.value))
            for i, s in zip(kept, result.scores, strict=True)
            if s.outcome == Outcome.VALUE
        ]
        name = f"shadow/{self.shadow.name}"
        out = {f"{name}/n": float(len(pairs)), f"{name}/valued_frac": len(pairs) / len(kept)}
        if pairs:
            out[f"{name}/disagree"] = sum(abs(a - b) > 1e-6 for a, b in pairs) / len(pairs)
            a, b = [p[0] for p in pairs], [p[1] for p in pairs]
            if len(pairs) >= 3 and len(set(a)) > 1 and len(set(b)) > 1:
                from scipy import stats

                out[f"{name}/pearson"] = float(stats.pearsonr(a, b).statistic)
                out[f"{name}/spearman"] = float(stats.spearmanr(a, b).statistic)
        return out

    def _call(
        self, slot: Slot, requests: list[LabelRequest], keys: Sequence[str] | None = None
    ) -> CallResult:
        """One labeler's answer to ``requests``: in chunks of ``labeling.batch_size``, up to
        ``labeling.concurrency`` of them at once (each worker process, or the inline labeler
        from several threads), each chunk a call of its own for latency and the breaker. With
        ``keys`` (the requests' store keys) each chunk's verdicts are stored as soon as it
        returns, so a kill loses at most the calls in flight."""
        size = self.cfg.batch_size or max(1, len(requests))
        chunks = [requests[i : i + size] for i in range(0, len(requests), size)] or [[]]
        store = self.store if keys is not None and slot.identity else None
        import queue

        free: queue.Queue[Any] = queue.Queue()
        for caller in slot.pool or [slot.call]:
            free.put(caller)  # a worker process answers one call at a time
        shared = not slot.pool  # the inline labeler is called from several threads

        in_flight = [0]
        lock = threading.Lock()
        slot.queued_max = max(slot.queued_max, len(chunks) - max(1, self.cfg.concurrency))

        def one(index: int) -> tuple[CallResult, float]:
            caller = slot.call if shared else free.get()
            with lock:
                in_flight[0] += 1
                slot.in_flight_max = max(slot.in_flight_max, in_flight[0])
            try:
                begin = time.perf_counter()
                result = caller(chunks[index], self.cfg.timeout_s)
                seconds = time.perf_counter() - begin
                if store is not None and keys is not None:  # store is None without keys
                    at = index * size
                    chunk_keys = keys[at : at + len(chunks[index])]
                    verdicts = zip(chunk_keys, chunks[index], result.scores, strict=True)
                    store.put(slot.identity, verdicts, seconds)
                return result, seconds
            finally:
                with lock:
                    in_flight[0] -= 1
                if not shared:
                    free.put(caller)

        if len(chunks) > 1 and self.cfg.concurrency > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=min(self.cfg.concurrency, len(chunks))) as pool:
                answers = list(pool.map(one, range(len(chunks))))
        else:
            answers = [one(i) for i in range(len(chunks))]
        scores: list[Score] = []
        retry_after = None
        for index, (result, seconds) in enumerate(answers):
            slot.latencies.append(seconds)
            if chunks[index]:
                slot.slowest.append((seconds, len(chunks[index]), chunks[index][0]))
                slot.slowest = sorted(slot.slowest, key=lambda c: -c[0])[:SLOWEST]
            slot.calls += 1
            slot.breaker.record(
                bool(result.scores) and all(s.outcome in FAILURES for s in result.scores)
            )
            scores += result.scores
            if result.retry_after is not None:
                retry_after = max(retry_after or 0.0, result.retry_after)
        return CallResult(scores, retry_after)

    def replace_head(self, slot: Slot) -> None:
        """Label with ``slot`` from the next pass on (the chain's fallbacks stay); waits for a
        pass in flight."""
        with self.lock:
            old = self.slots[0]
            self.slots[0] = slot
            old.call.close()

    def set_shadow(self, slot: Slot | None) -> None:
        """Score alongside the chain without training on it (None: stop); waits for a pass in
        flight."""
        with self.lock:
            if self.shadow is not None and self.shadow is not slot:
                self.shadow.call.close()
            self.shadow = slot

    def _through(
        self,
        slot: Slot,
        requests: list[LabelRequest],
        pending: list[int],
        scores: list[Score],
        outcomes: list[Outcome],
        valued_by: list[str | None],
        final: dict[int, str],
        started: float,
    ) -> list[int]:
        """Label ``pending`` with one labeler; return the samples that move on down the chain.

        Stored labels of this labeler are reused, and identical requests are sent once.
        """
        moving_on: list[int] = []
        keys = {i: request_key(requests[i]) for i in pending}

        def settle(i: int, score: Score, again: list[int]) -> None:
            scores[i], outcomes[i] = score, score.outcome
            if score.outcome == Outcome.VALUE:
                valued_by[i] = slot.name
                slot.values.append(float(score.value))
                return
            policy = self._policy(score.outcome)
            if policy == "retry":
                again.append(i)
            elif policy == "fallback":
                moving_on.append(i)
            else:
                final[i] = policy

        todo = list(pending)
        if self.store is not None and slot.identity:
            stored = self.store.lookup(slot.identity, [keys[i] for i in todo])
            unused: list[int] = []
            for i in todo:
                if keys[i] in stored:
                    settle(i, stored[keys[i]], unused)  # an abstain is not retried
                    slot.outcomes["stored"] += 1
            moving_on += unused
            todo = [i for i in todo if keys[i] not in stored]
        attempt = 0
        while todo:
            if not slot.breaker.allow():
                for i in todo:
                    scores[i] = Score(
                        math.nan, False, {"reason": f"{slot.name}: breaker open"}, Outcome.ERROR
                    )
                    outcomes[i] = Outcome.ERROR
                slot.outcomes["skipped_open"] += len(todo)
                moving_on += todo
                break
            first: dict[str, int] = {}  # identical requests are sent once
            for i in todo:
                first.setdefault(keys[i], i)
            sent = list(first.values())
            slot.outcomes["deduplicated"] += len(todo) - len(sent)
            result = self._call(slot, [requests[i] for i in sent], [keys[i] for i in sent])
            by_key = {keys[i]: score for i, score in zip(sent, result.scores, strict=True)}
            again: list[int] = []
            for i in todo:
                score = by_key[keys[i]]
                slot.outcomes[score.outcome.value] += 1
                settle(i, score, again)
            out_of_time = self.cfg.deadline_s is not None and (
                self.clock() - started >= self.cfg.deadline_s
            )
            if again and attempt < self.cfg.retries and not out_of_time:
                wait = self._backoff(attempt, result.retry_after)
                if self.cfg.deadline_s is not None:
                    wait = min(wait, max(0.0, self.cfg.deadline_s - (self.clock() - started)))
                self.sleep(wait)
                attempt += 1
                slot.retries += 1
                todo = again
                continue
            moving_on += again  # retries spent: on down the chain
            break
        return sorted(moving_on)


# --------------------------------------------------------------------------- the engine's entry


SLOWEST = 3
"""Calls kept per pass in :attr:`LabelReport.slowest` (and ``labels_slowest.jsonl``)."""


def slowest_calls(slots: Sequence[Slot], chars: int = 200) -> list[dict[str, Any]]:
    """The pass's :data:`SLOWEST` slowest labeler calls over the chain, slowest first: which
    labeler, seconds, requests in the call, and the first request's prompt and response (cut to
    ``chars``), so a slow input can be found."""
    calls = [(seconds, n, first, slot.name) for slot in slots for seconds, n, first in slot.slowest]
    calls.sort(key=lambda c: -c[0])
    return [
        {
            "labeler": name,
            "seconds": round(seconds, 6),
            "requests": n,
            "prompt": first.prompt[:chars],
            "response": first.response[:chars],
        }
        for seconds, n, first, name in calls[:SLOWEST]
    ]


def label(hooks: Hooks, batch: RolloutBatch, stage: LabelingStage | None = None) -> LabelReport:
    """Fill ``batch.scores``, ``batch.score_valid`` and ``batch.label_info`` (in place) through
    ``stage``, by default the arm's labeling stage (``hooks.labeling``; a plain single-labeler
    stage when unset), and return the report. Samples without a value get score 0 and
    ``info["outcome"]``; the report's ``keep`` says which samples may be trained on."""
    if stage is None:
        stage = getattr(hooks, "labeling", None)
    if stage is None:
        stage = default_stage(hooks)
    groups = batch.group_ids.tolist() if batch.group_ids is not None else None
    report = stage.label(label_requests(batch), groups)
    values = [float(s.value) if s.outcome == Outcome.VALUE else 0.0 for s in report.scores]
    batch.scores = torch.tensor(values, dtype=torch.float32)
    batch.score_valid = torch.tensor(
        [bool(s.valid) and s.outcome == Outcome.VALUE for s in report.scores], dtype=torch.bool
    )
    batch.label_info = [
        {**s.info, "outcome": s.outcome.value} if s.outcome != Outcome.VALUE else dict(s.info)
        for s in report.scores
    ]
    return report


def default_stage(hooks: Hooks) -> LabelingStage:
    """A one-labeler stage with the default policies over the run's own hooks."""
    from alignzoo.config.schema import LabelingConfig

    stage = LabelingStage.build(LabelingConfig(), [("labeler", None, hooks)])
    hooks.labeling = stage
    return stage
