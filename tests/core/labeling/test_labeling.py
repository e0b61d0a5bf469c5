"""The label stage: typed outcomes, policies, retries with backoff, the fallback chain, the
circuit breaker, timeouts that end the work, and a ledger that balances."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pytest

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.config.schema import LabelingConfig
from alignzoo.engine.hooks import Hooks
from alignzoo.errors import LabelerUnavailable, RunError, UserError
from alignzoo.labeling.callers import Breaker, ProcessCaller
from alignzoo.labeling.orchestrator import LabelingStage, label
from alignzoo.registry import build_plugin_manager
from alignzoo.types import Outcome

from ..tiny_world import build_world, sampled
from ._labelers import Crashing, Sleepy


class Clock:
    """A fake clock and sleep: time passes only when the stage sleeps (or a test says so)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Scripted(Labeler):
    """Answers each call with the next entry of a script (an exception, or a function of the
    requests); records every call's responses."""

    def __init__(self, script, params=None) -> None:
        super().__init__(params)
        self.script = list(script)
        self.calls: list[list[str]] = []

    @hookimpl
    def score_batch(self, requests):
        self.calls.append([r.response for r in requests])
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, BaseException):
            raise step
        return step(requests)


def value(requests):
    return [Score(float(len(r.response))) for r in requests]


def stage(*labelers, clock=None, **cfg) -> LabelingStage:
    chain = [(f"l{i}", c, Hooks(build_plugin_manager([c]))) for i, c in enumerate(labelers)]
    built = LabelingStage.build(LabelingConfig(**cfg), chain)
    if clock is not None:
        built.sleep, built.clock = clock.sleep, clock
        for slot in built.slots:
            slot.breaker.clock = clock
    return built


def requests(n: int) -> list[LabelRequest]:
    return [LabelRequest(prompt=f"p{i // 2}", response="x" * (i + 1)) for i in range(n)]


def balanced(report) -> None:
    ledger = report.ledger()
    assert ledger["generated"] == ledger["valued"] + ledger["fallback_valued"] + ledger["dropped"]


def test_values_pass_through_and_the_ledger_balances() -> None:
    report = stage(Scripted([value])).label(requests(6), [0, 0, 1, 1, 2, 2])
    assert [s.value for s in report.scores] == [1, 2, 3, 4, 5, 6]
    assert report.keep == list(range(6)) and report.ledger()["valued"] == 6
    metrics = report.metrics()
    assert metrics["label/generated"] == 6 and metrics["labeler/l0/value"] == 6
    assert "timing/labeler/l0/p50" in metrics


def test_transient_errors_are_retried_with_growing_jittered_backoff() -> None:
    clock = Clock()
    down = LabelerUnavailable("503")
    head = Scripted([down, down, value])
    report = stage(head, clock=clock, retries=3, backoff_s=1.0).label(requests(4))
    assert len(head.calls) == 3 and report.keep == [0, 1, 2, 3]
    assert 0.5 <= clock.sleeps[0] <= 1.5 and 1.0 <= clock.sleeps[1] <= 3.0  # 1 s, then 2 s
    assert report.metrics()["labeler/l0/retries"] == 2


def test_retry_after_is_waited() -> None:
    clock = Clock()
    head = Scripted([LabelerUnavailable("429", retry_after=7.0), value])
    stage(head, clock=clock, backoff_s=0.1).label(requests(2))
    assert clock.sleeps == [7.0]


def test_no_retry_starts_after_the_deadline() -> None:
    clock = Clock()
    head = Scripted([LabelerUnavailable("down")])
    labeling = stage(head, Scripted([value]), clock=clock, retries=10, backoff_s=4.0,
                     deadline_s=5.0)  # fmt: skip
    report = labeling.label(requests(3))
    assert clock.now <= 5.0 + 1e-9 and 2 <= len(head.calls) <= 3  # not 11 tries
    assert report.valued_by == ["l1", "l1", "l1"]  # then on down the chain


def test_the_chain_falls_back_per_sample_and_counts_who_valued_what() -> None:
    def half(requests):  # abstains on odd-length responses, NaN on length 4
        out = []
        for r in requests:
            n = len(r.response)
            out.append(Score(math.nan) if n == 4 else Score.abstain("odd") if n % 2 else Score(n))
        return out

    head, rule = Scripted([half]), Scripted([value])
    report = stage(head, rule).label(requests(6))
    assert report.keep == list(range(6))
    assert report.valued_by == ["l1", "l0", "l1", "l1", "l1", "l0"]
    assert rule.calls == [["x", "xxx", "xxxx", "xxxxx"]]  # only what the head did not value
    assert report.ledger() == {"generated": 6, "valued": 2, "fallback_valued": 4, "dropped": 0}
    metrics = report.metrics()
    assert metrics["labeler/l0/abstain"] == 3 and metrics["labeler/l0/rejected"] == 1


def test_exhausted_samples_are_dropped_or_their_groups_or_fail_the_run() -> None:
    def abstain_first(requests):
        return [Score.abstain() if r.response == "x" else Score(1.0) for r in requests]

    groups = [0, 0, 1, 1]
    dropped = stage(Scripted([abstain_first])).label(requests(4), groups)
    assert dropped.keep == [1, 2, 3] and dict(dropped.dropped) == {"abstain": 1}
    balanced(dropped)
    whole = stage(Scripted([abstain_first]), on={"exhausted": "drop_group"}).label(
        requests(4), groups
    )
    assert whole.keep == [2, 3] and dict(whole.dropped) == {"abstain": 1, "group": 1}
    assert whole.valued_by[1] is None  # valued, but dropped with its group
    balanced(whole)
    with pytest.raises(RunError, match="policy is 'fail'"):
        stage(Scripted([abstain_first]), on={"abstain": "fail"}).label(requests(4), groups)


def test_a_chain_that_values_nothing_fails_the_step_naming_why() -> None:
    with pytest.raises(RunError, match="the labeler failed: KeyError"):
        stage(Scripted([KeyError("x")]), retries=0).label(requests(3))


def test_the_breaker_trips_skips_the_labeler_and_recovers_after_a_probe() -> None:
    clock = Clock()
    head = Scripted([LabelerUnavailable("down")] * 4 + [value])
    rule = Scripted([value])
    labeling = stage(
        head, rule, clock=clock, retries=0,
        breaker={"window": 4, "min_calls": 4, "error_rate": 0.5, "cooldown_s": 60},
    )  # fmt: skip
    for _ in range(4):
        report = labeling.label(requests(2))
        assert report.valued_by == ["l1", "l1"]  # the chain carries on
    breaker = labeling.slots[0].breaker
    assert breaker.state == "open" and breaker.trips == 1
    calls = len(head.calls)
    report = labeling.label(requests(2))
    assert len(head.calls) == calls  # skipped while open
    assert report.metrics()["labeler/l0/breaker"] == 2.0
    clock.now += 61  # cooldown over: one probe, which succeeds
    report = labeling.label(requests(2))
    assert report.valued_by == ["l0", "l0"] and breaker.state == "closed"


def test_breaker_half_open_probe_failure_opens_again() -> None:
    clock = Clock()
    cfg = LabelingConfig(breaker={"window": 2, "min_calls": 2, "cooldown_s": 10}).breaker
    breaker = Breaker(cfg, clock)
    breaker.record(True)
    breaker.record(True)
    assert not breaker.allow()
    clock.now = 10
    assert breaker.allow() and breaker.state == "half-open"
    breaker.record(True)
    assert breaker.state == "open" and breaker.trips == 2 and not breaker.allow()


def test_random_faults_at_30_percent_always_reconcile() -> None:
    rng = random.Random(0)
    faults = [
        lambda reqs: [Score(1.0)] * (len(reqs) + 1),  # wrong count
        lambda reqs: [Score(math.inf) for _ in reqs],
        lambda reqs: [Score.parse_failure("judge said 'great'") for _ in reqs],
        lambda reqs: [Score.abstain() for _ in reqs],
    ]

    class Flaky(Labeler):
        @hookimpl
        def score_batch(self, requests):
            if rng.random() < 0.3:
                fault = rng.randrange(6)
                if fault == 4:
                    raise LabelerUnavailable("503", retry_after=0.0)
                if fault == 5:
                    raise ConnectionResetError("reset by peer")
                return faults[fault](requests)
            return [Score(float(len(r.response))) for r in requests]

    clock = Clock()
    labeling = stage(Flaky(), Scripted([value]), clock=clock, backoff_s=0.01)
    for _ in range(200):
        report = labeling.label(requests(8), [0, 0, 1, 1, 2, 2, 3, 3])
        balanced(report)
        for i in report.keep:
            assert report.outcomes[i] == Outcome.VALUE and report.valued_by[i] is not None
            assert report.scores[i].value == len(requests(8)[i].response)


def test_a_hung_call_is_ended_by_killing_its_worker(tmp_path: Path) -> None:
    flag, log = tmp_path / "hang", tmp_path / "calls.log"
    flag.touch()
    labeler = Sleepy(Sleepy.Params(flag=str(flag), log=str(log)))
    labeling = stage(labeler, timeout_s=3.0, retries=0, on={"timeout": "drop_sample"})
    caller = labeling.slots[0].call
    assert isinstance(caller, ProcessCaller)
    try:
        with pytest.raises(RunError, match="timeout"):
            labeling.label(requests(2))  # nothing valued: every sample timed out
        first = caller.started
        assert caller.process is None  # killed and reaped, not abandoned
        flag.unlink()
        report = labeling.label(requests(2))
        assert [s.value for s in report.scores] == [1.0, 2.0]
        assert caller.started == first + 1  # a fresh worker
        pids = {line.split()[0] for line in log.read_text().splitlines()}
        assert len(pids) == 1
    finally:
        labeling.close()
    assert caller.process is None


def test_a_worker_that_dies_is_an_error_and_is_replaced() -> None:
    # Every labeler of the chain runs in a worker of its own: the fallback too.
    labeling = stage(Crashing(), Sleepy(), isolation="process", retries=1, backoff_s=0)
    try:
        report = labeling.label(requests(2))
        assert report.valued_by == ["l1", "l1"]
        assert report.metrics()["labeler/l0/error"] == 2 * 2  # the first try and one retry
        assert labeling.slots[0].call.started == 2
        assert [s.value for s in report.scores] == [1.0, 2.0]
    finally:
        labeling.close()


class FlakyArithmetic(Labeler):
    """The arithmetic rule behind a flaky service: 30% of calls fail in one of six ways."""

    marks_correct = None

    def __init__(self, params=None) -> None:
        super().__init__(params)
        from alignzoo.plugins.labelers.arithmetic import ArithmeticLabeler

        self.rule = ArithmeticLabeler()
        self.rng = random.Random(1)

    @hookimpl
    def score_batch(self, requests):
        if self.rng.random() < 0.3:
            fault = self.rng.randrange(5)
            if fault == 0:
                raise LabelerUnavailable("429", retry_after=0.0)
            if fault == 1:
                raise ConnectionRefusedError("refused")
            if fault == 2:
                return [Score(math.nan) for _ in requests]
            if fault == 3:
                return [Score(0.0)] * (len(requests) - 1)
            return [Score.parse_failure("unreadable") for _ in requests]
        return [self.rule.score(r) for r in requests]


def test_a_run_with_a_flaky_labeler_and_a_fallback_completes_and_reconciles(
    write_experiment, tmp_path
) -> None:
    from importlib import metadata

    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.loop import run_one
    from alignzoo.registry import ENTRY_POINT_GROUP, Registry

    from ..engine.conftest import read_jsonl, tiny_experiment

    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(FlakyArithmetic, "flaky")
    spec = tiny_experiment(
        budget={"steps": 8},
        arms={
            "grpo": {
                "algorithm": "grpo",
                "labeler": "flaky",
                "labeling": {"fallbacks": ["arithmetic"], "retries": 1, "backoff_s": 0.0},
            }
        },
    )
    loaded = load_experiment(write_experiment(spec), registry=registry)
    summary = run_one(loaded, "grpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 8
    for row in rows:
        assert row["label/generated"] == 16
        assert row["label/generated"] == (
            row["label/valued"] + row["label/fallback_valued"] + row["label/dropped"]
        )
    assert sum(r["label/fallback_valued"] for r in rows) > 0  # the chain carried on
    assert sum(r.get("labeler/flaky/retries", 0) for r in rows) > 0
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "eval.jsonl")] == [0, 2, 4, 6, 8]


def test_the_store_reuses_labels_and_identical_requests_are_sent_once(tmp_path) -> None:
    from alignzoo.labeling.store import LabelStore, labeler_identity, stored_requests

    head = Scripted([value])
    chain = [("l0", head, Hooks(build_plugin_manager([head])))]
    reqs = requests(4) + requests(2)  # the last two repeat the first two
    labeling = LabelingStage.build(LabelingConfig(), chain, store=LabelStore(tmp_path / "l.sqlite"))
    report = labeling.label(reqs)
    assert head.calls == [["x", "xx", "xxx", "xxxx"]]  # duplicates sent once
    assert [s.value for s in report.scores] == [1, 2, 3, 4, 1, 2]
    assert report.metrics()["labeler/l0/deduplicated"] == 2
    again = labeling.label(reqs)  # a resumed run replaying the step
    assert len(head.calls) == 1 and [s.value for s in again.scores] == [1, 2, 3, 4, 1, 2]
    assert again.metrics()["labeler/l0/stored"] == 6
    labeling.close()
    stored = stored_requests(tmp_path / "l.sqlite")
    assert len(stored) == 4 and all(labeler_identity(head) in s for _, _, s in stored)


def test_the_store_keeps_verdicts_not_failures_and_keys_by_params(tmp_path) -> None:
    from alignzoo.labeling.store import LabelStore, labeler_identity, request_key
    from alignzoo.plugins.labelers.rules import FormatLabeler

    store = LabelStore(tmp_path / "l.sqlite")
    reqs = requests(3)
    verdicts = [
        Score(1.0, info={"a": 1}),
        Score.abstain("no key"),
        Score(math.nan, False, {}, Outcome.TIMEOUT),
    ]
    assert (
        store.put("lab", [(request_key(r), r, s) for r, s in zip(reqs, verdicts, strict=True)], 0.1)
        == 2
    )
    found = store.lookup("lab", [request_key(r) for r in reqs])
    assert found[request_key(reqs[0])].info == {"a": 1}
    assert found[request_key(reqs[1])].outcome == Outcome.ABSTAIN
    assert request_key(reqs[2]) not in found  # a timeout is not a verdict
    assert store.lookup("other", [request_key(reqs[0])]) == {}
    a = labeler_identity(FormatLabeler())
    assert a != labeler_identity(FormatLabeler(FormatLabeler.Params(ok=2.0)))
    assert a == labeler_identity(FormatLabeler())
    store.close()


def test_a_calls_labels_are_stored_in_one_transaction(tmp_path) -> None:
    """All of a call's verdicts or none: a row that cannot be written (here a value SQLite
    refuses to bind) takes the rows before it back out with it."""
    import sqlite3

    from alignzoo.labeling.store import LabelStore, request_key

    store = LabelStore(tmp_path / "l.sqlite")
    reqs = requests(3)
    keys = [request_key(r) for r in reqs]
    bad = LabelRequest(prompt="x", response=object(), extra={})  # type: ignore[arg-type]
    items = [(keys[0], reqs[0], Score(1.0)), (keys[1], reqs[1], Score(0.0)), ("k", bad, Score(1.0))]
    with pytest.raises(sqlite3.Error):
        store.put("lab", items, 0.1)
    assert store.lookup("lab", keys) == {}
    assert store.put("lab", items[:2], 0.1) == 2  # the connection is usable afterwards
    assert set(store.lookup("lab", keys)) == set(keys[:2])
    store.close()


def test_a_failed_commit_leaves_the_label_store_usable(tmp_path) -> None:
    import sqlite3

    from alignzoo.labeling.store import LabelStore, request_key

    class CommitFailsOnce:
        """The store's connection, whose first COMMIT fails (a full disk, say)."""

        def __init__(self, db: sqlite3.Connection) -> None:
            self.db, self.failed = db, False

        def execute(self, sql: str, *args):
            if sql == "COMMIT" and not self.failed:
                self.failed = True
                raise sqlite3.OperationalError("database or disk is full")
            return self.db.execute(sql, *args)

        def __getattr__(self, name: str):
            return getattr(self.db, name)

    store = LabelStore(tmp_path / "l.sqlite")
    real = store.db
    store.db = CommitFailsOnce(real)  # type: ignore[assignment]
    reqs = requests(2)
    items = [(request_key(r), r, Score(1.0)) for r in reqs]
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.put("lab", items, 0.1)
    assert not real.in_transaction  # rolled back, not left open
    assert store.lookup("lab", [k for k, _, _ in items]) == {}
    assert store.put("lab", items, 0.1) == 2
    assert len(store.lookup("lab", [k for k, _, _ in items])) == 2
    store.db = real
    store.close()


def test_chunks_run_concurrently_and_keep_their_order() -> None:
    import threading

    active, peak = [0], [0]
    lock = threading.Lock()

    def slow(requests):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return value(requests)

    head = Scripted([slow])
    labeling = stage(head, batch_size=2, concurrency=4)
    report = labeling.label(requests(8))
    assert [s.value for s in report.scores] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sorted(len(c) for c in head.calls) == [2, 2, 2, 2] and peak[0] > 1
    assert report.metrics()["labeler/l0/calls"] == 4


def test_a_pool_of_worker_processes(tmp_path) -> None:
    log = tmp_path / "calls.log"
    labeling = stage(Sleepy(Sleepy.Params(log=str(log))), isolation="process", batch_size=1,
                     concurrency=2)  # fmt: skip
    try:
        report = labeling.label(requests(4))
        assert [s.value for s in report.scores] == [1.0, 2.0, 3.0, 4.0]
        assert len({line.split()[0] for line in log.read_text().splitlines()}) == 2
    finally:
        labeling.close()


def test_the_label_path_is_exported_to_prometheus_while_live() -> None:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    labeling = stage(Scripted([value]), metrics_port=port)
    try:
        labeling.label(requests(6))
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'alignzoo_labeling{metric="label/valued"} 6.0' in text
        assert 'metric="labeler/l0/calls"' in text
    finally:
        labeling.close()


def test_the_values_each_labeler_gives_and_their_drift_are_reported() -> None:
    shift = [0.0]

    def shifting(requests):
        return [Score(float(len(r.response)) + shift[0]) for r in requests]

    labeling = stage(Scripted([shifting]), batch_size=3, concurrency=2)
    first = labeling.label(requests(10)).metrics()
    assert first["labeler/l0/value_p50"] == 6.0 and first["labeler/l0/value_mean"] == 5.5
    assert "labeler/l0/drift" not in first and first["labeler/l0/queued_max"] == 2
    assert 1 <= first["labeler/l0/in_flight_max"] <= 2
    shift[0] = 1.0
    second = labeling.label(requests(10)).metrics()
    assert second["labeler/l0/drift"] == pytest.approx(1.0)
    report = labeling.label(requests(10))
    assert report.metrics() == report.metrics()  # reading the metrics twice changes nothing
    assert report.metrics()["labeler/l0/drift"] == pytest.approx(0.9)  # 6.5 vs 5.5*0.9+6.5*0.1
    assert labeling.label(requests(0)).metrics()["label/generated"] == 0  # an empty pass


CURRICULUM = """
import json, os


def reward_curr(completions, trainer_state, **kwargs):
    with open(os.environ["STEPS_SEEN"], "a") as log:
        log.write(json.dumps(trainer_state.global_step) + "\\n")
    return [trainer_state.global_step / 10 for _ in completions]  # as TRL's examples do
"""


def test_a_reward_function_gets_the_step_in_evaluation_too(tmp_path, write_experiment, monkeypatch):
    """TRL always passes trainer_state with an integer global_step: a curriculum reward that
    divides it trains and evaluates (evaluation gets the step evaluated, 0 before training)."""
    from alignzoo.config.loader import load_experiment
    from alignzoo.experiment.runner import run_experiment

    (tmp_path / "curr.py").write_text(CURRICULUM)
    monkeypatch.setenv("STEPS_SEEN", str(tmp_path / "steps.jsonl"))
    monkeypatch.chdir(tmp_path)
    labeler = {"name": "python", "params": {"function": "curr.py:reward_curr"}}
    path = write_experiment(budget={"steps": 2}, arms={"grpo": {"labeler": labeler}})
    result = run_experiment(load_experiment(path), out_dir=tmp_path / "out")
    assert not result.failed, [r.error for r in result.runs]
    seen = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert None not in seen and {0, 1, 2} <= set(seen), seen


@pytest.fixture(scope="module")
def world() -> tuple[object, object]:
    return build_world()


def test_a_crashing_or_wrong_labeler_fails_with_a_named_error(world) -> None:
    model, tokenizer = world
    batch = sampled(model, tokenizer)

    def hooks(fn):
        class FnLabeler(Labeler):
            @hookimpl
            def score_batch(self, requests):
                return fn(requests)

        return Hooks(build_plugin_manager([FnLabeler()]))

    with pytest.raises(RunError, match="the labeler failed: KeyError"):
        label(hooks(lambda requests: {}["x"]), batch)
    with pytest.raises(RunError, match="Score\\(value='high'\\) for response 0"):
        label(hooks(lambda requests: [Score("high") for _ in requests]), batch)  # type: ignore[arg-type]
    with pytest.raises(RunError, match=r"non-finite score \(nan\) for response 0"):
        label(hooks(lambda requests: [Score(float("nan")) for _ in requests]), batch)
    with pytest.raises(UserError, match="fix me"):  # a user error keeps its own message
        label(hooks(lambda requests: (_ for _ in ()).throw(UserError("fix me"))), batch)
