"""What a labeling pass reports: per sample its outcome and who valued it, the ledger that must
balance (generated = valued + fallback-valued + dropped), the ``label/*`` and
``labeler/<name>/*`` metrics, the pass's slowest calls, and their Prometheus endpoint.
"""

from __future__ import annotations

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
