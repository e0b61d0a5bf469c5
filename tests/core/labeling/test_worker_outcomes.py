"""The same outcome in process and in a worker: a timeout inside the labeler is ``timeout``
(and the arm's ``on.timeout`` applies) wherever the labeler runs, and a labeler's own
``stats()`` reach the step metrics from a worker too, its declared counters as per-step
deltas."""

from __future__ import annotations

from typing import Any

import pytest

from alignzoo import Labeler, LabelRequest
from alignzoo.config.schema import LabelingConfig
from alignzoo.engine.hooks import Hooks
from alignzoo.errors import UserError
from alignzoo.labeling.callers import ProcessCaller
from alignzoo.labeling.orchestrator import LabelingStage
from alignzoo.plugins.labelers.http import HTTPLabeler
from alignzoo.registry import build_plugin_manager
from alignzoo.types import Outcome

from ._labelers import RAISES, Constant, Counting, Raising, _raise, score_server

ISOLATION = ["inline", "process"]


def build(*labelers: Labeler, names: tuple[str, ...] = (), **cfg: Any) -> LabelingStage:
    names = names or tuple(f"l{i}" for i in range(len(labelers)))
    chain = [(n, c, Hooks(build_plugin_manager([c]))) for n, c in zip(names, labelers, strict=True)]
    cfg.setdefault("store", None)
    cfg.setdefault("breaker", {"window": 100, "min_calls": 100})
    return LabelingStage.build(LabelingConfig(**cfg), chain)


def requests(responses: list[str]) -> list[LabelRequest]:
    return [LabelRequest(prompt=f"p{i}", response=r) for i, r in enumerate(responses)]


@pytest.mark.parametrize("kind", sorted(RAISES))
def test_what_counts_as_a_timeout(kind: str) -> None:
    from alignzoo.labeling.callers import outcome_of

    try:
        _raise(kind)
    except Exception as exc:
        outcome, _, _ = outcome_of(exc)
    assert outcome == (Outcome.TIMEOUT if RAISES[kind] else Outcome.ERROR)


@pytest.mark.parametrize("isolation", ISOLATION)
def test_a_timeout_inside_the_labeler_is_a_timeout_in_process_and_in_a_worker(
    isolation: str,
) -> None:
    kinds = sorted(RAISES)
    labeling = build(
        Raising(),
        Constant(),
        isolation=isolation,
        batch_size=1,
        retries=0,
        on={"timeout": "drop_sample", "error": "fallback"},
    )
    if isolation == "process":
        assert isinstance(labeling.slots[0].call, ProcessCaller)
    try:
        reqs = requests(["a", *[f"raise:{k}" for k in kinds], "bb"])
        for _ in range(2):
            report = labeling.label(reqs)
            for i, kind in enumerate(kinds, start=1):
                if RAISES[kind]:  # on.timeout applies: dropped, not handed to the fallback
                    assert report.outcomes[i] == Outcome.TIMEOUT, kind
                    assert i not in report.keep
                else:  # on.error: the fallback values it
                    assert report.valued_by[i] == "l1", kind
            metrics = report.metrics()
            timeouts = sum(RAISES.values())
            assert metrics["labeler/l0/timeout"] == timeouts
            assert metrics["labeler/l0/error"] == len(kinds) - timeouts
            assert metrics["label/dropped/timeout"] == timeouts
            # the labeler's own stats: its counter per pass (not a running total), its gauge
            assert metrics["labeler/l0/raised"] == len(kinds)
            assert metrics["labeler/l0/last_batch"] == 1
        if isolation == "process":
            assert labeling.slots[0].call.started == 1  # an exception never costs the worker
    finally:
        labeling.close()


@pytest.mark.parametrize("isolation", ISOLATION)
def test_a_user_error_inside_the_labeler_stops_the_run_in_process_and_in_a_worker(
    isolation: str,
) -> None:
    labeling = build(Raising(), isolation=isolation, retries=0)
    try:
        with pytest.raises(UserError, match="the token is wrong"):
            labeling.label(requests(["raise:user_error"]))
    finally:
        labeling.close()


@pytest.mark.parametrize("isolation", ISOLATION)
def test_the_http_labelers_read_timeout_and_its_counters_in_process_and_in_a_worker(
    isolation: str,
) -> None:
    with score_server(slow_s=2.0) as url:
        http = HTTPLabeler(HTTPLabeler.Params(url=url, timeout_s=0.3, batch_size=1))
        labeling = build(
            http,
            Constant(),
            names=("http", "constant"),
            isolation=isolation,
            batch_size=1,
            retries=0,
            on={"timeout": "drop_sample", "error": "fallback"},
        )
        try:
            for _ in range(2):
                report = labeling.label(requests(["ok", "slow", "fail", "okay"]))
                assert report.outcomes[1] == Outcome.TIMEOUT and 1 not in report.keep
                assert report.valued_by == ["http", None, "constant", "http"]
                metrics = report.metrics()
                assert metrics["labeler/http/timeout"] == 1
                assert metrics["labeler/http/error"] == 1
                # its stats() (failed POSTs by kind) are counters: this pass's, from a worker too
                assert metrics["labeler/http/timeouts"] == 1
                assert metrics["labeler/http/server_errors"] == 1
                assert metrics["labeler/http/connect_errors"] == 0
        finally:
            labeling.close()


def test_a_workers_counters_survive_its_replacement() -> None:
    labeling = build(Counting(), isolation="process")
    caller = labeling.slots[0].call
    try:
        first = labeling.label(requests(["a", "bb", "ccc"])).metrics()
        assert first["labeler/l0/scored"] == 3 and first["labeler/l0/calls_so_far"] == 1
        caller._kill()  # as a timeout does: the next call starts a fresh worker
        second = labeling.label(requests(["a", "bb"])).metrics()
        assert caller.started == 2
        assert second["labeler/l0/scored"] == 2  # not -1, not 0: the new worker counts from 0
        assert second["labeler/l0/calls_so_far"] == 1  # a plain value: the worker's own
        assert caller.stats()["scored"] == 5  # the caller's running total over its workers
    finally:
        labeling.close()
