"""What a labeling pass reports: per sample its outcome and who valued it, the ledger that must
balance (generated = valued + fallback-valued + dropped), the ``label/*`` and
``labeler/<name>/*`` metrics, the pass's slowest calls, and their Prometheus endpoint.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from alignzoo.labeling.callers import Slot
from alignzoo.labeling.interface import Outcome, Score


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
        (the judge's rate-limit waits, the http labeler's failed POSTs by kind; the keys it
        declares counters, :func:`~alignzoo.labeling.callers.stats_counters`, as this pass's
        increase, from a worker process too; the others as they are); the latency of its calls (p50/p95/max) under
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
            out[f"{prefix}/breaker"] = BREAKER_STATES[slot.breaker.state]
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
            for key, value in slot.stats.items():  # the labeler's own (rate-limit waits)
                out[f"{prefix}/{key}"] = float(value)  # counters: this pass's increase
        return out


STATE_KEY = "labeling_drift"
"""The key of the drift state in ``run.state``: per labeler name the running mean of its
per-pass mean values (replaced whole after each pass, so a checkpoint copies a consistent one;
a resumed run reports the drift an uninterrupted one would)."""

BREAKER_STATES = {"closed": 0.0, "half-open": 1.0, "open": 2.0}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)  # fmt: skip
"""Seconds: a rule answers in milliseconds, a judge or a remote reward model in seconds."""
VALUE_BUCKETS = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0,
                 2.0, 5.0, 10.0)  # fmt: skip
"""Label values (the labeler's own, before normalisation): fine on [0, 1], where rules and
judges score, coarse beyond, where reward-model logits lie."""


class MetricsExporter:
    """The label path on a Prometheus endpoint (``labeling.metrics_port``) while a run is live:
    one registry and one HTTP server per run (``http://127.0.0.1:<port>/metrics``).

    Every series is labelled ``run`` (``<experiment>/<arm>/seed-<n>``) and ``arm``; a
    labeler's also ``labeler`` (its name in the chain). Counters add up over the run's
    labeling passes (training and evaluation passes through the arm's chain alike):

    - ``alignzoo_labeling_passes_total``, ``alignzoo_labeling_generated_total`` (responses
      labeled), ``alignzoo_labeling_valued_total{labeler, role="head"|"fallback"}`` (kept
      samples by who valued them), ``alignzoo_labeling_dropped_total{outcome}``: the ledger,
      generated = valued + dropped;
    - ``alignzoo_labeler_calls_total``, ``alignzoo_labeler_retries_total``,
      ``alignzoo_labeler_failed_calls_total`` (calls that failed whole: what the breaker
      counts), ``alignzoo_labeler_breaker_trips_total``,
      ``alignzoo_labeler_outcomes_total{outcome}`` (every answer, retries included, by
      outcome: value, abstain, timeout, error, parse_failure, rejected),
      ``alignzoo_labeler_stored_total`` (reused from the label store),
      ``alignzoo_labeler_deduplicated_total`` (identical requests sent once),
      ``alignzoo_labeler_skipped_total`` (samples passed on while its breaker was open);
    - ``alignzoo_labeler_stat_total{stat}``: the labeler's own ``stats()`` counters (the keys
      it declares in ``stats_counters``, see :func:`~alignzoo.labeling.callers.stats_counters`).

    Histograms: ``alignzoo_labeler_call_seconds`` (each call's latency, observed as it ends)
    and ``alignzoo_labeler_value`` (each value it gave, before normalisation; its buckets reach
    below 0, so by the exposition format it has no ``_sum``: the mean is a gauge). Gauges:
    ``alignzoo_labeler_value_mean`` (the latest pass's), ``alignzoo_labeler_breaker_state``
    (0 closed, 1 half-open, 2 open),
    ``alignzoo_labeler_in_flight`` (calls running now), ``alignzoo_labeler_drift`` (the
    latest pass's mean value minus the running mean of its earlier passes),
    ``alignzoo_labeler_stat_value{stat}`` (its other ``stats()``),
    ``alignzoo_labeling_shadow{labeler, stat}`` (a shadow labeler's agreement: n, valued_frac,
    disagree, pearson, spearman), ``alignzoo_labeling_last_pass_timestamp_seconds``, and
    ``alignzoo_labeling{metric}``: the latest pass's step metrics by their metrics.jsonl name,
    for a quick look (dashboards use the typed metrics).

    A labeler swapped out of the chain has its series removed (:meth:`forget`); a new
    labeler's counters start from zero, as ``rate()`` expects of a reset.
    """

    def __init__(self, port: int, host: str = "127.0.0.1", run: str = "", arm: str = "") -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            start_http_server,
        )

        self.run, self.arm = run, arm
        self.registry = r = CollectorRegistry()
        per_run, per_labeler = ["run", "arm"], ["run", "arm", "labeler"]

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: list[str]) -> Any:
            return Gauge(name, doc, labels, registry=r)

        self.passes = counter("alignzoo_labeling_passes", "Labeling passes", per_run)
        self.generated = counter("alignzoo_labeling_generated", "Responses labeled", per_run)
        self.valued = counter(
            "alignzoo_labeling_valued",
            "Kept samples by the labeler that valued them (head or fallback)",
            [*per_labeler, "role"],
        )
        self.dropped = counter(
            "alignzoo_labeling_dropped", "Samples dropped, by outcome", [*per_run, "outcome"]
        )
        self.last_pass = gauge(
            "alignzoo_labeling_last_pass_timestamp_seconds", "When the latest pass ended", per_run
        )
        self.calls = counter("alignzoo_labeler_calls", "Labeler calls", per_labeler)
        self.retries = counter("alignzoo_labeler_retries", "Retry rounds", per_labeler)
        self.failed_calls = counter(
            "alignzoo_labeler_failed_calls",
            "Calls that failed whole (timeout or error)",
            per_labeler,
        )
        self.trips = counter(
            "alignzoo_labeler_breaker_trips", "Times the circuit breaker opened", per_labeler
        )
        self.outcomes = counter(
            "alignzoo_labeler_outcomes",
            "Answers by outcome (every try)",
            [*per_labeler, "outcome"],
        )
        self.stored = counter(
            "alignzoo_labeler_stored", "Labels reused from the label store", per_labeler
        )
        self.deduplicated = counter(
            "alignzoo_labeler_deduplicated", "Identical requests sent once", per_labeler
        )
        self.skipped = counter(
            "alignzoo_labeler_skipped", "Samples passed on while the breaker was open", per_labeler
        )
        self.stat_total = counter(
            "alignzoo_labeler_stat", "The labeler's own stats() counters", [*per_labeler, "stat"]
        )
        self.latency = Histogram(
            "alignzoo_labeler_call_seconds",
            "Latency of one labeler call",
            per_labeler,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.values = Histogram(
            "alignzoo_labeler_value",
            "Values the labeler gave (before normalisation)",
            per_labeler,
            buckets=VALUE_BUCKETS,
            registry=r,
        )
        self.breaker = gauge(
            "alignzoo_labeler_breaker_state", "0 closed, 1 half-open, 2 open", per_labeler
        )
        self.in_flight = gauge("alignzoo_labeler_in_flight", "Calls running now", per_labeler)
        self.value_mean = gauge(
            "alignzoo_labeler_value_mean", "The latest pass's mean value", per_labeler
        )
        self.drift = gauge(
            "alignzoo_labeler_drift",
            "The latest pass's mean value minus the running mean of the earlier passes",
            per_labeler,
        )
        self.stat_value = gauge(
            "alignzoo_labeler_stat_value", "The labeler's other stats()", [*per_labeler, "stat"]
        )
        self.shadow = gauge(
            "alignzoo_labeling_shadow",
            "A shadow labeler's agreement with the chain",
            [*per_labeler, "stat"],
        )
        self.latest = gauge(
            "alignzoo_labeling", "The latest labeling pass's step metrics", ["metric"]
        )
        self.lock = threading.Lock()
        self.series: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}  # labeler -> children
        self.latest_names: set[str] = set()
        self.breakers: dict[str, tuple[int, int]] = {}  # labeler -> (id of breaker, trips)
        self.server, self.thread = start_http_server(port, addr=host, registry=r)
        self.port = int(self.server.server_port)

    # ------------------------------------------------------------------ children
    def _of(self, metric: Any, labeler: str, *extra: str) -> Any:
        """The child of ``metric`` for ``labeler`` (kept track of, for :meth:`forget`)."""
        values = (self.run, self.arm, labeler, *extra)
        with self.lock:
            self.series.setdefault(labeler, set()).add((metric, values))
        return metric.labels(*values)

    def call_started(self, labeler: str) -> None:
        self._of(self.in_flight, labeler).inc()

    def call_ended(self, labeler: str, seconds: float) -> None:
        self._of(self.in_flight, labeler).dec()
        self._of(self.latency, labeler).observe(seconds)

    def forget(self, labeler: str) -> None:
        """Remove every series of ``labeler`` (swapped out of the chain)."""
        with self.lock:
            children = self.series.pop(labeler, set())
            self.breakers.pop(labeler, None)
            gone = [n for n in self.latest_names if _names_labeler(n, labeler)]
        for metric, values in children:
            with contextlib.suppress(KeyError):
                metric.remove(*values)
        for name in gone:
            with contextlib.suppress(KeyError):
                self.latest.remove(name)
            self.latest_names.discard(name)

    def forget_shadow(self) -> None:
        self.shadow.clear()

    # ------------------------------------------------------------------ a pass
    def record(self, slots: Sequence[Slot], report: LabelReport | None = None) -> None:
        """Add a pass's tallies to the counters and set the gauges (``report`` None: the pass
        failed the run; what its labelers did still counts)."""
        from alignzoo.labeling.callers import slot_stats

        for slot in slots:
            name = slot.name
            self._of(self.calls, name).inc(slot.calls)
            self._of(self.retries, name).inc(slot.retries)
            self._of(self.failed_calls, name).inc(slot.failed_calls)
            for outcome in Outcome:  # every outcome's series exists: rates of 0, not gaps
                self._of(self.outcomes, name, outcome.value).inc(slot.outcomes[outcome.value])
            self._of(self.stored, name).inc(slot.outcomes["stored"])
            self._of(self.deduplicated, name).inc(slot.outcomes["deduplicated"])
            self._of(self.skipped, name).inc(slot.outcomes["skipped_open"])
            seen, trips = self.breakers.get(name, (id(slot.breaker), 0))
            if seen != id(slot.breaker):  # a new breaker (a new labeler of that name)
                trips = 0
            self._of(self.trips, name).inc(max(0, slot.breaker.trips - trips))
            self.breakers[name] = (id(slot.breaker), slot.breaker.trips)
            self._of(self.breaker, name).set(BREAKER_STATES[slot.breaker.state])
            self._of(self.in_flight, name)  # the series exists before the first call
            self._of(self.latency, name)
            histogram = self._of(self.values, name)
            for value in slot.values:
                histogram.observe(value)
            if slot.values:
                self._of(self.value_mean, name).set(sum(slot.values) / len(slot.values))
            if slot.drift is not None:
                self._of(self.drift, name).set(slot.drift)
            counters = slot_stats(slot)[1]
            for key, value in slot.stats.items():
                if key in counters:
                    self._of(self.stat_total, name, key).inc(max(0.0, value))
                else:
                    self._of(self.stat_value, name, key).set(value)
        if report is None:
            return
        run = (self.run, self.arm)
        head = slots[0].name if slots else None
        self.passes.labels(*run).inc()
        self.generated.labels(*run).inc(len(report.outcomes))
        kept = Counter(report.valued_by[i] for i in report.keep)
        for slot in slots:
            role = "head" if slot.name == head else "fallback"
            self._of(self.valued, slot.name, role).inc(kept.get(slot.name, 0))
        for outcome in [*(o.value for o in Outcome if o != Outcome.VALUE), "group"]:
            self.dropped.labels(*run, outcome).inc(report.dropped.get(outcome, 0))
        self.last_pass.labels(*run).set_to_current_time()
        self.shadow.clear()
        for key, value in report.shadow.items():
            _, shadow, stat = key.split("/", 2)  # shadow/<name>/<stat>
            self.shadow.labels(*run, shadow, stat).set(value)
        snapshot = report.snapshot if report.snapshot is not None else report.metrics()
        with self.lock:
            stale = self.latest_names - set(snapshot)
            self.latest_names = set(snapshot)
        for name in stale:
            with contextlib.suppress(KeyError):
                self.latest.remove(name)
        for name, value in snapshot.items():
            self.latest.labels(name).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _names_labeler(metric: str, labeler: str) -> bool:
    """Whether a step metric's name is ``labeler``'s (``labeler/<name>/...`` and the like)."""
    return any(
        metric.startswith(f"{prefix}/{labeler}/")
        for prefix in ("labeler", "timing/labeler", "label", "shadow")
    )


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
