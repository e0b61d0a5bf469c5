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

In a training pass each labeler's values are then normalised and clipped as
``labeling.normalize`` says (:mod:`~alignzoo.labeling.normalize`; the labeler's value stays in
``Score.info["raw"]``, ``label/<labeler>/norm_mean`` and ``norm_std`` give the running state);
the running state is the stage's :meth:`LabelingStage.state_dict`, mirrored into ``run.state``
once the stage is attached to the run (:meth:`LabelingStage.attach`), so checkpoints keep it.
So is each labeler's drift state (:meth:`LabelingStage.drift_state_dict`: the running mean of
its per-pass mean values), so a resumed run reports the drift an uninterrupted one would.

With ``labeling.metrics_port`` the stage serves the run's label path on a Prometheus endpoint
(:class:`~alignzoo.labeling.report.MetricsExporter`) at 127.0.0.1, port ``metrics_port`` plus
the run's index in its experiment (:func:`run_index`), from :meth:`LabelingStage.attach` on.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from alignzoo import distributed
from alignzoo.errors import RunError, UserError
from alignzoo.labeling.callers import (
    FAILURES,
    Breaker,
    CallResult,
    InlineCaller,
    ProcessCaller,
    Slot,
    slot_stats,
)
from alignzoo.labeling.interface import LabelRequest, Outcome, Score, reward_table
from alignzoo.labeling.normalize import STATE_KEY as NORM_STATE_KEY
from alignzoo.labeling.normalize import RunningStats, resolve, transform
from alignzoo.labeling.report import SLOWEST, LabelReport, MetricsExporter, slowest_calls
from alignzoo.labeling.report import STATE_KEY as DRIFT_STATE_KEY
from alignzoo.labeling.store import LabelStore, labeler_identity, request_key

if TYPE_CHECKING:
    from alignzoo.batch import RolloutBatch
    from alignzoo.config.schema import LabelingConfig
    from alignzoo.labeling.callers import Hooks


def run_index(context: Any) -> int:
    """The run's position among its experiment's runs, as the runner plans them: arms in the
    experiment's order, each with its seeds in order (``arm position * len(seeds) + seed
    position``); 0 when the context does not say. ``labeling.metrics_port`` plus this is the
    run's Prometheus port."""
    spec = getattr(context, "spec", None)
    arms = list(getattr(spec, "arms", None) or [])
    seeds = list(getattr(spec, "seeds", None) or [])
    arm, seed = getattr(context, "arm", None), getattr(context, "seed", None)
    if arm in arms and seed in seeds:
        return arms.index(arm) * len(seeds) + seeds.index(seed)
    return 0


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
        self.exporter: MetricsExporter | None = None  # started by attach, or the first pass
        self.sleep, self.clock = sleep, clock
        self.rng = random.Random(seed)
        self.lock = threading.RLock()  # one pass at a time; a swap waits for the pass in flight
        self.norm_stats: dict[str, RunningStats] = {}  # labeler name -> running mean and std
        self.drift_means: dict[str, float] = {}  # labeler name -> running mean of pass means
        self.context: Any = None  # the run whose run.state mirrors norm_stats (attach)

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
        self,
        requests: list[LabelRequest],
        groups: Sequence[int] | None = None,
        normalize: bool = False,
        evaluation: bool = False,
    ) -> LabelReport:
        """Label every request through the chain; see :class:`LabelReport`. Thread-safe: one
        pass runs at a time (with ``labeling.overlap`` a pass runs beside the main thread).
        ``normalize``: a training pass, whose values are normalised as ``labeling.normalize``
        says (and update its running state); otherwise the values are the labelers' own.
        ``evaluation``: a pass over evaluation prompts, which reports each labeler's drift and
        leaves its running mean alone (see :meth:`_drift`)."""
        with self.lock:
            return self._label(requests, groups, normalize, evaluation)

    # ------------------------------------------------------------------ normalisation
    def state_dict(self) -> dict[str, Any]:
        """The normalisation state (plain data): per labeler name its count, mean and M2."""
        with self.lock:
            return {name: stats.state_dict() for name, stats in sorted(self.norm_stats.items())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.norm_stats = {
                name: RunningStats.from_state(row) for name, row in (state or {}).items()
            }

    def attach(self, context: Any) -> None:
        """Keep the normalisation and drift state in ``context.state`` (saved with every
        checkpoint) and, when it already holds them (a resumed run), continue from them; with
        ``labeling.metrics_port`` serve the run's metrics (:meth:`_serve`). Idempotent: after
        each pass the stage writes its state there, so attaching again changes nothing."""
        with self.lock:
            self.context = context
            saved = context.state.get(NORM_STATE_KEY)
            if saved is not None:
                self.load_state_dict(saved)
            drift = context.state.get(DRIFT_STATE_KEY)
            if drift is not None:
                self.load_drift_state_dict(drift)
            if self.exporter is None and self.cfg.metrics_port is not None:
                self._serve(
                    str(getattr(context, "name", "")),
                    str(getattr(context, "arm", "")),
                    run_index(context),
                )

    def _serve(self, run: str = "", arm: str = "", index: int = 0) -> None:
        """Serve the label path's metrics on 127.0.0.1, port ``labeling.metrics_port`` plus
        the run's index in its experiment (:func:`run_index`), so the runs of an experiment
        (``--jobs`` worker processes, Ray tasks) each serve their own. Under data parallelism
        rank 0 serves (its share of the samples)."""
        assert self.cfg.metrics_port is not None
        if "torch" in sys.modules and not distributed.is_main():  # no torch: no process group
            return
        port = self.cfg.metrics_port + index
        try:
            self.exporter = MetricsExporter(port, run=run, arm=arm)
        except (OSError, OverflowError) as exc:
            raise UserError(
                f"labeling.metrics_port: cannot serve the labeling metrics of run {run or '-'} "
                f"on 127.0.0.1:{port} (metrics_port {self.cfg.metrics_port} + run index "
                f"{index}): {exc}; pick a base port with a free range above it"
            ) from None

    def _normalize(
        self, scores: list[Score], outcomes: list[Outcome], valued_by: list[str | None]
    ) -> dict[str, float]:
        """Normalise each labeler's values of this pass in place; returns ``label/*`` metrics."""
        metrics: dict[str, float] = {}
        for slot in self.slots:
            component = getattr(slot.call, "component", None) or getattr(slot.call, "cls", None)
            cfg = resolve(self.cfg.normalize, component)
            if cfg.mode == "none" and cfg.clip is None:
                continue
            mine = [
                i
                for i in range(len(scores))
                if outcomes[i] == Outcome.VALUE and valued_by[i] == slot.name
            ]
            running = cfg.mode == "running"
            stats = self.norm_stats.setdefault(slot.name, RunningStats()) if running else None
            local = [float(scores[i].value) for i in mine]
            if stats is not None:
                # Data parallel: the running state is updated with every rank's values, in
                # rank order (the one-process pass's order), so all ranks whiten alike.
                stats.update(distributed.all_concat(local), cfg.momentum)
            new = transform(cfg, local, stats or RunningStats(), update=False)
            for i, value in zip(mine, new, strict=True):
                old = scores[i]
                info = {**old.info, "raw": old.info.get("raw", float(old.value))}
                scores[i] = replace(old, value=value, info=info)  # its steps stay as given
            if stats is not None:
                metrics[f"label/{slot.name}/norm_mean"] = stats.mean
                metrics[f"label/{slot.name}/norm_std"] = stats.std
        if self.context is not None:  # a new dict each pass: a checkpoint copies a whole one
            self.context.state[NORM_STATE_KEY] = {
                name: stats.state_dict() for name, stats in sorted(self.norm_stats.items())
            }
        return metrics

    def _label(
        self,
        requests: list[LabelRequest],
        groups: Sequence[int] | None,
        normalize: bool = False,
        evaluation: bool = False,
    ) -> LabelReport:
        for slot in self.slots:
            slot.latencies = []
            slot.calls = slot.retries = slot.failed_calls = 0
            slot.outcomes = Counter()
            slot.values = []
            slot.slowest = []
            slot.in_flight_max = slot.queued_max = 0
            slot.stats = {}
        if self.exporter is None and self.cfg.metrics_port is not None:
            self._serve()  # a stage no run attached (relabel): the base port, no run labels
        before = {slot.name: slot_stats(slot)[0] for slot in self.slots}
        try:
            report, norm_metrics = self._pass(requests, groups, normalize)
        except BaseException:
            with contextlib.suppress(Exception):  # never hides why the pass failed
                self._pass_stats(before)
                if self.exporter is not None:  # what the labelers did still counts
                    self.exporter.record(self.slots)
            raise
        self._pass_stats(before)
        self._drift(update=not evaluation)
        report.snapshot = {**report.metrics(), **norm_metrics}
        report.slowest = slowest_calls(self.slots)
        if self.exporter is not None:
            self.exporter.record(self.slots, report)
        return report

    def _pass_stats(self, before: dict[str, dict[str, float]]) -> None:
        """Each labeler's ``stats()`` for this pass: its counters' increase since the pass
        began, its other keys as they are now."""
        for slot in self.slots:
            now, counters = slot_stats(slot)
            start = before.get(slot.name, {})
            stats = {}
            for key, value in now.items():
                if key in counters:
                    grown = value - start.get(key, 0.0)
                    stats[key] = grown if grown >= 0 else value  # the labeler reset it
                else:
                    stats[key] = value
            slot.stats = stats

    # ------------------------------------------------------------------ drift
    def _drift(self, update: bool = True) -> None:
        """Each labeler's drift: this pass's mean value minus the running mean of its earlier
        training passes (an exponential moving average, 0.9 / 0.1); the running means are the
        stage's :meth:`drift_state_dict`, kept in ``run.state`` once attached (checkpointed).
        ``update`` False (an evaluation pass, whose prompts are not the training ones): the
        drift is reported and the running means are left alone, so a run's training drift is
        the same whether or not its evaluation uses this stage (an asynchronous arm's producers
        label the training passes alone)."""
        for slot in self.slots:  # drift: once per pass, against the passes before
            slot.drift = None
            if slot.values:
                mean = sum(slot.values) / len(slot.values)
                running = self.drift_means.get(slot.name)
                if running is not None:
                    slot.drift = mean - running
                    if update:
                        self.drift_means[slot.name] = 0.9 * running + 0.1 * mean
                elif update:
                    self.drift_means[slot.name] = mean
        self._publish_drift()

    def _publish_drift(self) -> None:
        if self.context is not None:  # a new dict each pass: a checkpoint copies a whole one
            self.context.state[DRIFT_STATE_KEY] = dict(sorted(self.drift_means.items()))

    def drift_state_dict(self) -> dict[str, float]:
        """The drift state (plain data): per labeler name the running mean of its per-pass
        mean values."""
        with self.lock:
            return dict(sorted(self.drift_means.items()))

    def load_drift_state_dict(self, state: dict[str, Any] | None) -> None:
        with self.lock:
            self.drift_means = {str(k): float(v) for k, v in (state or {}).items()}

    def _pass(
        self, requests: list[LabelRequest], groups: Sequence[int] | None, normalize: bool = False
    ) -> tuple[LabelReport, dict[str, float]]:
        """One pass through the chain: the report and the normalisation metrics."""
        n = len(requests)
        scores: list[Score] = [Score(math.nan, False, {}, Outcome.ERROR) for _ in range(n)]
        outcomes: list[Outcome] = [Outcome.ERROR] * n
        valued_by: list[str | None] = [None] * n
        final: dict[int, str] = {}  # sample -> drop_sample | drop_group | fail
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
        given = {i: float(s.value) for i, s in enumerate(scores) if outcomes[i] == Outcome.VALUE}
        norm_metrics = self._normalize(scores, outcomes, valued_by) if normalize else {}
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
            report.shadow = self._shadow_agreement(requests, report, given)
        return report, norm_metrics

    def _shadow_agreement(
        self,
        requests: list[LabelRequest],
        report: LabelReport,
        given: dict[int, float] | None = None,
    ) -> dict[str, float]:
        """Score the kept samples with the shadow labeler (never trained on) and compare
        (with the values the chain gave, ``given``, before normalisation)."""
        assert self.shadow is not None
        kept = [i for i in report.keep if report.outcomes[i] == Outcome.VALUE]
        if not kept:
            return {}
        result = self.shadow.call([requests[i] for i in kept], self.cfg.timeout_s)
        given = given or {}
        pairs = [
            (given.get(i, float(report.scores[i].value)), float(s.value))
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
            exporter = self.exporter
            if exporter is not None:
                exporter.call_started(slot.name)
            seconds = 0.0
            try:
                begin = time.perf_counter()
                try:
                    result = caller(chunks[index], self.cfg.timeout_s)
                finally:
                    seconds = time.perf_counter() - begin
                    if exporter is not None:
                        exporter.call_ended(slot.name, seconds)
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
            failed = bool(result.scores) and all(s.outcome in FAILURES for s in result.scores)
            slot.failed_calls += failed
            slot.breaker.record(failed)
            scores += result.scores
            if result.retry_after is not None:
                retry_after = max(retry_after or 0.0, result.retry_after)
        return CallResult(scores, retry_after)

    def replace_head(self, slot: Slot) -> None:
        """Label with ``slot`` from the next pass on (the chain's fallbacks stay); waits for a
        pass in flight.

        A new labeler has a scale of its own: the running normalisation state of the head's
        name starts over (a resumed run loads the state it had at its checkpoint after the
        swap it restores, :meth:`attach`). So does its drift, and the old labeler's series
        leave the Prometheus endpoint."""
        with self.lock:
            old = self.slots[0]
            self.slots[0] = slot
            old.call.close()
            for pool in old.pool[1:]:
                pool.close()
            self.norm_stats.pop(old.name, None)
            self.norm_stats.pop(slot.name, None)
            self.drift_means.pop(old.name, None)
            self.drift_means.pop(slot.name, None)
            self._publish_drift()
            if self.exporter is not None:
                self.exporter.forget(old.name)
                if self.shadow is None:  # a promoted shadow: its agreement series go too
                    self.exporter.forget_shadow()

    def set_shadow(self, slot: Slot | None) -> None:
        """Score alongside the chain without training on it (None: stop); waits for a pass in
        flight."""
        with self.lock:
            if self.shadow is not None and self.shadow is not slot:
                self.shadow.call.close()
            self.shadow = slot
            if self.exporter is not None:
                self.exporter.forget_shadow()

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


def label_requests(batch: RolloutBatch, step: int | None = None) -> list[LabelRequest]:
    """One request per sample: prompt text, response text, the dataset's extra columns, the
    response's sampled token ids and ``step``."""
    extras = batch.extras or [{} for _ in range(batch.size)]
    lengths = batch.response_mask.sum(dim=1).long().tolist()
    ids = [row[:n] for row, n in zip(batch.response_ids.tolist(), lengths, strict=True)]
    return [
        LabelRequest(prompt=p, response=r, extra=dict(e), completion_ids=i, step=step)
        for p, r, e, i in zip(batch.prompts, batch.responses, extras, ids, strict=True)
    ]


def label(
    hooks: Hooks,
    batch: RolloutBatch,
    stage: LabelingStage | None = None,
    normalize: bool = True,
    step: int | None = None,
    tokenizer: Any = None,
) -> LabelReport:
    """Fill ``batch.scores``, ``batch.score_valid``, ``batch.label_info`` and, when a labeler
    reports several rewards (``Score.info["rewards"]``), ``batch.reward_components`` with
    ``batch.reward_names`` (:func:`~alignzoo.labeling.interface.reward_table`) (in place) through
    ``stage`` (the run's labeling stage; without one, a plain single-labeler stage over
    ``hooks``, :func:`default_stage`), and return the report. Samples without a value get score 0 and
    ``info["outcome"]``; the report's ``keep`` says which samples may be trained on.
    ``normalize``: a training pass (``labeling.normalize`` applies); evaluation passes False,
    so it scores raw values and leaves the running state alone. ``step``: the training step
    the samples are for, given to labelers with each request. ``tokenizer``: the policy's;
    with it the labelers' step scores are placed on tokens, ``batch.dense_rewards`` and
    ``batch.dense_mask`` (:func:`alignzoo.labeling.dense.fill`; both None when no labeler
    gave steps)."""
    import torch  # here: importing the stage (a worker process, relabel) needs no torch

    if stage is None:
        stage = default_stage(hooks)
    groups = batch.group_ids.tolist() if batch.group_ids is not None else None
    report = stage.label(
        label_requests(batch, step), groups, normalize=normalize, evaluation=not normalize
    )
    values = [float(s.value) if s.outcome == Outcome.VALUE else 0.0 for s in report.scores]
    batch.scores = torch.tensor(values, dtype=torch.float32)
    batch.score_valid = torch.tensor(
        [bool(s.valid) and s.outcome == Outcome.VALUE for s in report.scores], dtype=torch.bool
    )
    batch.label_info = [
        {**s.info, "outcome": s.outcome.value} if s.outcome != Outcome.VALUE else dict(s.info)
        for s in report.scores
    ]
    names, rows = reward_table(report.scores)  # a labeler's several rewards, apart
    batch.reward_names = names
    batch.reward_components = (
        torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(names)) if names else None
    )
    if tokenizer is not None:
        from alignzoo.labeling.dense import fill

        fill(batch, report.scores, tokenizer)
    return report


def default_stage(hooks: Hooks) -> LabelingStage:
    """A one-labeler stage with the default policies over the run's own hooks."""
    from alignzoo.config.schema import LabelingConfig

    return LabelingStage.build(LabelingConfig(), [("labeler", None, hooks)])
