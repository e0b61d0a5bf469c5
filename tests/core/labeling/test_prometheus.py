"""The label path on Prometheus while a run is live (``labeling.metrics_port``): counters for
totals, histograms for call latency and label values, gauges for breaker state and calls in
flight, labelled by run, arm and labeler; a swapped-out labeler's series removed; one port per
run (base + the run's index), so runs in worker processes do not collide; and the dashboard
and alert rules under deploy/ query only metrics a real labeling pass exports."""

from __future__ import annotations

import json
import multiprocessing
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.config.schema import LabelingConfig
from alignzoo.engine.hooks import Hooks
from alignzoo.errors import UserError
from alignzoo.labeling.callers import Breaker, InlineCaller, Slot
from alignzoo.labeling.orchestrator import LabelingStage
from alignzoo.registry import build_plugin_manager

from ._labelers import Constant, Counting, Raising, free_port, run_context, serve_one_run

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "alignzoo-labeling.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"


def build(*labelers: Labeler, **cfg: Any) -> LabelingStage:
    chain = [(f"l{i}", c, Hooks(build_plugin_manager([c]))) for i, c in enumerate(labelers)]
    cfg.setdefault("store", None)
    return LabelingStage.build(LabelingConfig(**cfg), chain)


def scrape(port: int) -> tuple[dict[str, str], list[Any]]:
    """The endpoint's metric families' types (by family name) and all its samples."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    types: dict[str, str] = {}
    samples: list[Any] = []
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        samples += family.samples
    return types, samples


def value(samples: list[Any], name: str, **labels: str) -> float | None:
    """The sum of the samples called ``name`` whose labels include ``labels`` (None: none)."""
    found = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(found) if found else None


def requests(responses: list[str]) -> list[LabelRequest]:
    return [LabelRequest(prompt=f"p{i}", response=r) for i, r in enumerate(responses)]


RESPONSES = ["a", "bb", "raise:timeout_error", "raise:runtime_error", "ccc", "dddd"]


def test_counters_histograms_and_gauges_labelled_by_run_arm_and_labeler() -> None:
    base = free_port(4)
    labeling = build(
        Raising(),
        Constant(),
        metrics_port=base,
        batch_size=1,
        retries=1,
        backoff_s=0,
        on={"timeout": "drop_sample", "error": "retry"},
        breaker={"window": 100, "min_calls": 100},
    )
    # run 3 of 4 (arms a, b x seeds 0, 1; arm-major): it serves base + 3
    labeling.attach(run_context("b", 1, arms=("a", "b"), seeds=(0, 1)))
    try:
        for _ in range(2):
            labeling.label(requests(RESPONSES))
        types, samples = scrape(base + 3)
    finally:
        labeling.close()
    run = {"run": "exp/b/seed-1", "arm": "b"}
    head = {**run, "labeler": "l0"}

    assert types["alignzoo_labeler_calls"] == "counter"
    assert types["alignzoo_labeler_outcomes"] == "counter"
    assert types["alignzoo_labeler_retries"] == "counter"
    assert types["alignzoo_labeling_dropped"] == "counter"
    assert types["alignzoo_labeler_call_seconds"] == "histogram"
    assert types["alignzoo_labeler_value"] == "histogram"
    assert types["alignzoo_labeler_breaker_state"] == "gauge"
    assert types["alignzoo_labeler_in_flight"] == "gauge"

    # Per pass: 6 calls (batch_size 1) + 1 retry of the runtime error; 4 values, 1 timeout
    # (dropped), 2 errors (the try and its retry; then the fallback values it). Counters add
    # the passes up, they are not the latest pass's numbers.
    assert value(samples, "alignzoo_labeler_calls_total", **head) == 2 * 7
    assert value(samples, "alignzoo_labeler_retries_total", **head) == 2 * 1
    assert value(samples, "alignzoo_labeler_outcomes_total", **head, outcome="value") == 2 * 4
    assert value(samples, "alignzoo_labeler_outcomes_total", **head, outcome="timeout") == 2
    assert value(samples, "alignzoo_labeler_outcomes_total", **head, outcome="error") == 2 * 2
    assert value(samples, "alignzoo_labeler_failed_calls_total", **head) == 2 * 3
    assert value(samples, "alignzoo_labeling_generated_total", **run) == 2 * 6
    assert value(samples, "alignzoo_labeling_dropped_total", **run, outcome="timeout") == 2
    assert value(samples, "alignzoo_labeling_valued_total", **head, role="head") == 2 * 4
    fallback = {**run, "labeler": "l1", "role": "fallback"}
    assert value(samples, "alignzoo_labeling_valued_total", **fallback) == 2
    assert value(samples, "alignzoo_labeling_passes_total", **run) == 2
    # histograms: one latency per call; one label value per value given (the labeler's own)
    assert value(samples, "alignzoo_labeler_call_seconds_count", **head) == 2 * 7
    assert value(samples, "alignzoo_labeler_value_count", **head) == 2 * 4
    assert value(samples, "alignzoo_labeler_value_mean", **head) == (1 + 2 + 3 + 4) / 4
    assert value(samples, "alignzoo_labeler_value_bucket", **head, le="+Inf") == 2 * 4
    # gauges
    assert value(samples, "alignzoo_labeler_breaker_state", **head) == 0.0
    assert value(samples, "alignzoo_labeler_in_flight", **head) == 0.0
    assert value(samples, "alignzoo_labeler_drift", **head) == pytest.approx(0.0)
    # the labeler's own stats(): its declared counter as a counter, the rest as gauges
    assert value(samples, "alignzoo_labeler_stat_total", **head, stat="raised") == 2 * 3
    assert value(samples, "alignzoo_labeler_stat_value", **head, stat="last_batch") == 1.0
    # every series of the endpoint carries the run's labels
    ours = [s for s in samples if s.name.startswith("alignzoo_labeler")]
    assert ours and all(s.labels["run"] == "exp/b/seed-1" and s.labels["arm"] == "b" for s in ours)


class Blocking(Labeler):
    """Scores 1.0 once released (in-process only)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    @hookimpl
    def score_batch(self, requests):
        self.entered.set()
        assert self.release.wait(10)
        return [Score(1.0) for _ in requests]


def test_calls_in_flight_are_a_live_gauge() -> None:
    port = free_port()
    blocking = Blocking()
    labeling = build(blocking, metrics_port=port)
    labeling.attach(run_context())
    worker = threading.Thread(target=labeling.label, args=(requests(["x", "y"]),))
    worker.start()
    try:
        assert blocking.entered.wait(10)
        _, during = scrape(port)
        assert value(during, "alignzoo_labeler_in_flight", labeler="l0") == 1.0
    finally:
        blocking.release.set()
        worker.join(10)
    try:
        _, after = scrape(port)
        assert value(after, "alignzoo_labeler_in_flight", labeler="l0") == 0.0
        assert value(after, "alignzoo_labeler_calls_total", labeler="l0") == 1
    finally:
        labeling.close()


def test_a_swapped_out_labelers_series_are_removed() -> None:
    port = free_port()
    labeling = build(Counting(), metrics_port=port)
    labeling.attach(run_context())
    try:
        labeling.label(requests(["a", "bb"]))
        shadow = Constant()
        labeling.set_shadow(
            Slot("judge", InlineCaller(Hooks(build_plugin_manager([shadow])), shadow), Breaker(labeling.cfg.breaker))
        )  # fmt: skip
        labeling.label(requests(["a", "bb", "ccc"]))
        _, before = scrape(port)
        assert value(before, "alignzoo_labeler_calls_total", labeler="l0") == 2
        assert value(before, "alignzoo_labeling_shadow", labeler="judge", stat="n") == 3
        assert value(before, "alignzoo_labeling", metric="labeler/l0/calls") == 1

        new = Constant()
        slot = Slot("new", InlineCaller(Hooks(build_plugin_manager([new])), new), Breaker(labeling.cfg.breaker))  # fmt: skip
        labeling.replace_head(slot)
        labeling.set_shadow(None)
        _, swapped = scrape(port)
        assert not [s for s in swapped if s.labels.get("labeler") in ("l0", "judge")]
        assert not [s for s in swapped if s.labels.get("metric", "").startswith("labeler/l0/")]

        labeling.label(requests(["a"]))
        _, later = scrape(port)
        assert value(later, "alignzoo_labeler_calls_total", labeler="new") == 1
        assert not [s for s in later if s.labels.get("labeler") in ("l0", "judge")]
        # the step metrics of the latest pass (one gauge, by metric name) are the new ones
        assert value(later, "alignzoo_labeling", metric="labeler/new/calls") == 1
        assert value(later, "alignzoo_labeling", metric="labeler/l0/calls") is None
    finally:
        labeling.close()


def test_each_run_serves_its_own_port_so_worker_processes_do_not_collide() -> None:
    base = free_port(4)
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=serve_one_run, args=(base, "b", 0, ready, stop), daemon=True)
    worker.start()
    here = build(Counting(), metrics_port=base)
    here.attach(run_context("a", 1, arms=("a", "b"), seeds=(0, 1)))  # run 1: base + 1
    try:
        here.label(requests(["a"]))
        assert ready.wait(60), "the worker run did not start"
        _, mine = scrape(base + 1)
        _, theirs = scrape(base + 2)  # arm b, seed 0: run 2
        assert {s.labels["run"] for s in mine if "run" in s.labels} == {"exp/a/seed-1"}
        assert {s.labels["run"] for s in theirs if "run" in s.labels} == {"exp/b/seed-0"}
        assert value(mine, "alignzoo_labeling_generated_total") == 1
        assert value(theirs, "alignzoo_labeling_generated_total") == 3
        with pytest.raises(UserError, match=str(base + 1)):  # the port is taken: said so
            build(Counting(), metrics_port=base).attach(
                run_context("a", 1, arms=("a", "b"), seeds=(0, 1))
            )
    finally:
        stop.set()
        here.close()
        worker.join(30)
        if worker.is_alive():
            worker.kill()


# --------------------------------------------------------------------------- deploy/


def _strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (ours all start with ``alignzoo_``)."""
    return set(re.findall(r"\b(alignzoo_[A-Za-z0-9_:]*)", _strip_strings(expr)))


def label_names(expr: str) -> set[str]:
    """The label names a PromQL expression matches on or aggregates by."""
    bare = _strip_strings(expr)
    names: set[str] = set()
    for inside in re.findall(r"\{([^}]*)\}", bare):
        names |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", inside))
    for inside in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", bare):  # fmt: skip
        names |= {n.strip() for n in inside.split(",") if n.strip()}
    return names


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = []
    for panel in board["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            exprs += [t["expr"] for t in inner.get("targets", []) if t.get("expr")]
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if isinstance(query, str) and "alignzoo_" in query:
            exprs.append(query)
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in rules["groups"] for rule in group["rules"]]


def test_the_dashboard_and_alerts_query_only_what_a_labeling_pass_exports() -> None:
    board_exprs = dashboard_queries()
    rules = alert_rules()
    assert len(board_exprs) >= 8
    for rule in rules:
        assert {"alert", "expr", "for", "labels", "annotations"} <= set(rule), rule
        assert rule["labels"].get("severity") in ("warning", "critical")
    by_name = {rule["alert"]: rule["expr"] for rule in rules}
    assert any(
        "histogram_quantile(0.95" in e and "call_seconds_bucket" in e for e in by_name.values()
    )
    assert any('outcome=~"error|timeout"' in e for e in by_name.values())
    assert any("alignzoo_labeler_drift" in e for e in by_name.values())

    # A real labeling pass that produces every series: values, timeouts, errors, retries, a
    # fallback, drops, the labeler's own stats, drift (two passes) and a shadow labeler.
    port = free_port()
    labeling = build(
        Raising(),
        Constant(),
        metrics_port=port,
        batch_size=2,
        retries=1,
        backoff_s=0,
        on={"timeout": "drop_sample"},
    )
    labeling.attach(run_context())
    shadow = Constant()
    labeling.set_shadow(
        Slot("shadow", InlineCaller(Hooks(build_plugin_manager([shadow])), shadow), Breaker(labeling.cfg.breaker))
    )  # fmt: skip
    try:
        for _ in range(2):
            labeling.label(requests(RESPONSES))
        _, samples = scrape(port)
    finally:
        labeling.close()
    exported = {s.name for s in samples}
    labels: dict[str, set[str]] = {}
    for s in samples:
        labels.setdefault(s.name, set()).update(s.labels)
    for expr in board_exprs + list(by_name.values()):
        names = metric_names(expr)
        assert names, f"no alignzoo metric in {expr!r}"
        missing = names - exported
        assert not missing, f"{expr!r} reads {sorted(missing)}, which the endpoint does not export"
        known = set().union(*(labels[n] for n in names)) | {"le"}
        assert label_names(expr) <= known, f"{expr!r}: labels {label_names(expr) - known}"
