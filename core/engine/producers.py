"""Rollout producers apart from the trainer (``training.async``).

Two parties with one contract, a sample and its provenance::

    trainer:   draws step t's prompts in order ──► task queue
               publishes its weights after every M steps (name, tensor, version) ──► producers
               waits for step t's batch ──► behaviour, advantages, update (as without async)
    producer:  task t ──► waits for weights of step >= t - 1 - K ──► sample, label
               (generation, labeling and episodes, with its own backend and labelers)
               ──► the batch and the version that sampled it ──► result queue

**Staleness.** The batch of step t trains on the weights left by step t - 1; a producer starts
it only with weights of step t - 1 - K or later (K = ``max_staleness``), so every sample is at
most K steps old. The trainer hands out tasks at most K steps ahead of the step it trains:
producers that run ahead wait for work (they pace); nothing is dropped. K = 0 is lock-step:
each batch is sampled by the weights that train on it, and the run is the synchronous run
(the same prompts and seeds in the same order; a producer samples with the trainer's thread
count).

**Data parallel.** Under torchrun rank 0 alone runs the producers, for the whole global batch,
and hands each rank its share of the prompts (what it would have sampled itself): the labeling
and the collection's metrics see every sample once, as in one process.

**Order.** Batches are trained in step order whichever producer finishes first, so that a run
is reproducible: step t always trains on step t's prompts.

**Failures.** A producer whose sampling or labeling raises reports the error and the run fails
with it (as a failure in one process would); a producer that dies (killed) is started again
and its task handed out again: no batch is trained twice, and one in flight is sampled anew.
A producer whose trainer dies exits on its own (it looks for its parent while it waits).

**Partial rollouts** (``partial_rollouts: true``). While it samples a batch, a producer takes
weights the trainer sends in the meantime at the rollout's safe points (before a decode step of
the hf backend, before an episode's turn; :mod:`alignzoo.rollout.partial`) and goes on with
them: the batch's tokens then come from several versions, each recorded in ``token_versions``
with the log-prob it was drawn with. Staleness is counted per token.

Metrics: ``rollout/staleness`` (mean over the sampled tokens) and ``rollout/staleness_max`` in
steps, ``rollout/staleness_hist/<k>`` (the share of tokens k steps old, k = 0 .. K),
``async/queue_depth`` (batches waiting when the step began), ``async/trainer_wait_s`` (the
trainer idle, waiting for its batch), ``async/producer_wait_s`` (the producer idle before it
started the batch: waiting for work or weights), ``async/producer_paced_s`` (of that, waiting
for weights fresh enough), ``async/restarts`` (producers started again), and the ledger's
``async/samples_*``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.collect import Collector
from alignzoo.engine.modes import Collected, StepSource
from alignzoo.errors import RunError
from alignzoo.labeling import LabelReport

if TYPE_CHECKING:
    from alignzoo.config.schema import AsyncConfig, ExperimentSpec

POLL_S = 0.5
"""How often a waiting party looks whether the other is still alive."""

PACED_S = 0.01
"""A batch whose producer waited longer than this for fresh enough weights counts as paced."""

START_TIMEOUT_S = 600.0
"""How long the trainer waits for a producer's first word (loading its models)."""


@dataclass(frozen=True)
class ProducerJob:
    """What a producer process needs to build its side of the arm: plain, picklable data."""

    source: str  # the experiment file
    spec: ExperimentSpec  # the resolved experiment (its command-line overrides applied)
    arm: str
    seed: int
    out_dir: Path
    policy: str  # the folder of the trainer's starting policy (a warm start already built)
    threads: int
    index: int


@dataclass
class Task:
    """Step ``step``'s prompts, to be sampled with weights of step ``min_weights`` or later."""

    step: int
    rows: list[dict[str, Any]]
    seeds: list[int]
    min_weights: int


@dataclass
class Weights:
    """The trainer's weights after ``step`` steps (``version`` optimizer steps)."""

    step: int
    version: int
    tensors: dict[str, torch.Tensor]


@dataclass
class Produced:
    """What a producer sends back: a started task, a finished batch, or an error."""

    producer: int
    step: int | None = None
    kind: str = "batch"  # ready, batch, error
    batch: RolloutBatch | None = None
    samples: int = 0
    tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    slowest: list[dict[str, Any]] = field(default_factory=list)
    weights_step: int = 0  # the step of the weights the batch started with
    version_steps: dict[int, int] = field(default_factory=dict)  # policy version -> its step
    waited_s: float = 0.0  # idle before the batch: waiting for work or for weights
    paced_s: float = 0.0  # of which waiting for weights fresh enough for the staleness bound
    error: str | None = None


# --------------------------------------------------------------------------- producer side


class _ProducerSide:
    """A producer's share of the arm: its own policy copy, backend, labelers and episodes."""

    def __init__(self, job: ProducerJob) -> None:
        from alignzoo.config.loader import load_experiment
        from alignzoo.devices import available_devices
        from alignzoo.engine import models as model_loading
        from alignzoo.engine.modes import select_mode
        from alignzoo.engine.parts import (
            fresh_components,
            labeling_stage,
            run_hooks,
            seed_everything,
            start_fallbacks,
        )
        from alignzoo.types import RunContext

        loaded = load_experiment(job.source, arms=[job.arm], overrides=job.spec.overrides)
        loaded.spec = spec = job.spec
        arm_spec = spec.arms[job.arm]
        components = fresh_components(loaded, job.arm)
        self.hooks = hooks = run_hooks(components, arm_spec.algorithm.name)
        self.labeling = labeling_stage(arm_spec, components, hooks, job.seed, job.out_dir)
        self.mode = select_mode(hooks.algorithm_requirements(), online=True)
        self.cfg = arm_spec.training
        placements = hooks.place_roles(["actor", "rollout", "labeler"], available_devices())
        devices = {role: placement.device for role, placement in placements.items()}
        seed_everything(job.seed)
        models = model_loading.load_models(
            job.policy, arm_spec.model, devices, False, False, job.seed
        )
        models.placements = placements
        self.models = models
        self.context = RunContext(
            experiment=spec.name,
            arm=job.arm,
            seed=job.seed,
            out_dir=job.out_dir,
            spec=spec,
            arm_spec=arm_spec,
        )
        self.context.models = models
        self.episodes = None
        if arm_spec.environment is not None:
            from alignzoo.rollout.agents import episode_runner

            self.episodes = episode_runner(
                arm_spec.episodes,
                components.get("environment"),
                models.tokenizer,
                getattr(models.actor, "config", None),
            )
        hooks.on_run_start(self.context)
        start_fallbacks(self.labeling, self.context)
        self.weights: Weights | None = None
        self.version_steps: dict[int, int] = {}  # every version loaded -> the step it ended
        settings = self.cfg.async_
        self.partial = settings is not None and settings.partial_rollouts
        seed_everything(job.seed)

    def load(self, weights: Weights) -> None:
        """Take the trainer's weights into this producer's policy and its backend."""
        from alignzoo.weights import PolicyWeights

        actor = self.models.actor
        with torch.no_grad():
            own = dict(actor.named_parameters())
            own.update(actor.named_buffers())
            for name, tensor in weights.tensors.items():
                own[name].copy_(tensor)
        self.weights = Weights(weights.step, weights.version, {})
        self.version_steps[weights.version] = weights.step
        self.hooks.sync_weights(PolicyWeights(actor, weights.version))

    def steps_of(self, batch: RolloutBatch) -> dict[int, int]:
        """The step each policy version in ``batch.token_versions`` ended (what the trainer
        needs to count the batch's staleness per token)."""
        if batch.token_versions is None:
            return {}
        present = torch.unique(batch.token_versions).tolist()
        return {v: self.version_steps[v] for v in present if v in self.version_steps}

    def newest(self, arriving: Any) -> int:
        """Take the newest of the weights waiting in ``arriving`` (the others are skipped);
        the version in force."""
        latest = None
        with contextlib.suppress(queue.Empty):
            while True:
                latest = arriving.get_nowait()
        if latest is not None:
            self.load(latest)
        assert self.weights is not None
        return self.weights.version

    def produce(self, task: Task, arriving: Any = None) -> Collected:
        """Sample and label ``task``; with partial rollouts, taking the weights that arrive on
        ``arriving`` while it samples."""
        from alignzoo.rollout import partial

        assert self.weights is not None
        feeding = contextlib.nullcontext()
        if self.partial and arriving is not None:
            feeding = partial.feeding(lambda: self.newest(arriving))
        source = StepSource(
            self.hooks,
            self.models.tokenizer,
            self.cfg,
            task.seeds,
            task.step,
            self.weights.version,
            self.labeling,
            self.episodes,
        )
        with feeding:
            return self.mode.collect(task.rows, source)

    def close(self) -> None:
        from alignzoo.runfolder import RunStatus

        with contextlib.ExitStack() as stack:
            stack.callback(self.hooks.on_run_end, self.context, RunStatus.FINISHED)
            stack.callback(self.labeling.close)


def _parent_gone(parent: int) -> bool:
    return os.getppid() != parent


def produce(job: ProducerJob, tasks: Any, weights: Any, results: Any, stop: Any) -> None:
    """A producer process: sample and label the tasks it takes, with fresh enough weights,
    until it is told to stop (``stop`` set, or a None task) or its trainer is gone."""
    parent = os.getppid()
    torch.set_num_threads(job.threads)
    try:
        side = _ProducerSide(job)
    except Exception as exc:  # the trainer reports it and fails the run
        results.put(Produced(job.index, kind="error", error=_describe(exc)))
        return
    results.put(Produced(job.index, kind="ready"))
    try:
        idle = time.perf_counter()  # since the last batch went out (or the start)
        while True:
            try:
                task = tasks.get(timeout=POLL_S)
            except queue.Empty:
                if stop.is_set() or _parent_gone(parent):
                    return
                continue
            if task is None:
                return
            taken = time.perf_counter()
            while side.weights is None or side.weights.step < task.min_weights:
                try:  # paced: the staleness bound holds the task until fresher weights come
                    side.load(weights.get(timeout=POLL_S))
                except queue.Empty:
                    if stop.is_set() or _parent_gone(parent):
                        return
            side.newest(weights)  # newer weights already sent: use them
            now = time.perf_counter()
            waited, paced = now - idle, now - taken
            assert side.weights is not None
            started = side.weights.step
            try:
                collected = side.produce(task, weights)
            except Exception as exc:
                results.put(Produced(job.index, task.step, kind="error", error=_describe(exc)))
                return
            report = collected.report
            results.put(
                Produced(
                    job.index,
                    task.step,
                    batch=collected.batch.to("cpu"),
                    samples=collected.samples,
                    tokens=collected.tokens,
                    metrics=collected.metrics,
                    slowest=list(report.slowest) if report is not None else [],
                    weights_step=started,
                    version_steps=side.steps_of(collected.batch),
                    waited_s=waited,
                    paced_s=paced,
                )
            )
            idle = time.perf_counter()
    finally:
        if stop.is_set() and hasattr(results, "cancel_join_thread"):
            results.cancel_join_thread()  # the trainer reads no more: do not wait to hand over
        side.close()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"


# --------------------------------------------------------------------------- trainer side


class _Handle:
    """What the trainer keeps of one producer, wherever it runs: its job, whether it said it is
    ready, the tasks given to it and not delivered, and its queues (tasks, weights, results:
    per producer, so that a producer killed in the middle of a queue operation leaves no other
    producer's queue broken)."""

    tasks: Any
    weights: Any
    results: Any

    def __init__(self, job: ProducerJob) -> None:
        self.job = job
        self.ready = False
        self.outstanding: dict[int, Task] = {}

    def give(self, task: Task) -> None:
        self.outstanding[task.step] = task
        self.tasks.put(task)

    def alive(self) -> bool:
        raise NotImplementedError

    def stop(self, timeout: float) -> None:
        raise NotImplementedError


class _Producer(_Handle):
    """A producer as a local process (spawned), with multiprocessing queues."""

    def __init__(self, ctx: Any, job: ProducerJob) -> None:
        super().__init__(job)
        self.tasks, self.weights, self.results = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.stopping = ctx.Event()
        self.process = ctx.Process(
            target=produce,
            args=(job, self.tasks, self.weights, self.results, self.stopping),
            name=f"alignzoo-producer-{job.index}",
        )
        self.process.start()

    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def stop(self, timeout: float) -> None:
        """Ask it to stop (a None task), wait ``timeout`` seconds, then kill it."""
        self.stopping.set()  # a producer waiting for weights stops at once
        if self.process.is_alive() and timeout > 0:
            self.tasks.put(None)
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        for q in (self.tasks, self.weights, self.results):
            q.cancel_join_thread()
            q.close()


class _RayFlag:
    """A stop flag an actor on another node can read: set once anything is in its queue."""

    def __init__(self, flag: Any) -> None:
        self.flag = flag

    def set(self) -> None:
        self.flag.put(True)

    def is_set(self) -> bool:
        return not self.flag.empty()


class _ProducerActor:
    """A producer as a Ray actor: :func:`produce`, the queues Ray queues."""

    def run(self, job: ProducerJob, tasks: Any, weights: Any, results: Any, stop: Any) -> None:
        produce(job, tasks, weights, results, stop)


class _RayProducer(_Handle):
    """A producer as a Ray actor (a run under ``--executor ray``): the same three queues and
    stop flag, as Ray queues. In the run's placement group (bundle ``1 + index``, which
    :class:`~alignzoo.experiment.executors.RayExecutor` reserves beside the run's own) when it
    has one, else wherever Ray finds ``threads`` CPUs."""

    def __init__(self, job: ProducerJob) -> None:
        import ray
        from ray.util.queue import Queue

        super().__init__(job)
        free = {"num_cpus": 0}  # the queues hold no CPU of the run's
        self.tasks, self.weights, self.results = (Queue(actor_options=free) for _ in range(3))
        self.stopping = _RayFlag(Queue(actor_options=free))
        options: dict[str, Any] = {"num_cpus": job.threads}
        group = ray.util.get_current_placement_group()
        if group is not None and job.index + 1 < len(group.bundle_specs):
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = group.bundle_specs[job.index + 1]
            options["num_cpus"] = bundle.get("CPU", 0)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=job.index + 1
            )
        actor_class: Any = ray.remote(_ProducerActor)
        self.actor = actor_class.options(**options).remote()
        self.done = self.actor.run.remote(
            job, self.tasks, self.weights, self.results, self.stopping
        )

    def alive(self) -> bool:
        import ray

        finished, _ = ray.wait([self.done], timeout=0)
        return not finished

    def stop(self, timeout: float) -> None:
        import ray

        self.stopping.set()
        if self.alive() and timeout > 0:
            self.tasks.put(None)
            ray.wait([self.done], timeout=timeout)
        if self.alive():
            ray.kill(self.actor)
        for q in (self.tasks, self.weights, self.results, self.stopping.flag):
            with contextlib.suppress(Exception):  # a queue whose actor is already gone
                q.shutdown(force=True)


def _under_ray() -> bool:
    """Whether this run is a Ray task (``--executor ray``): its producers are then Ray actors."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return bool(ray.get_runtime_context().worker.mode == ray.WORKER_MODE)


class AsyncCollector(Collector):
    """The trainer's side of ``training.async``: hands out the steps' prompts, publishes the
    weights, and returns each step's batch as its producer delivers it."""

    def __init__(self, *args: Any, job: ProducerJob, settings: AsyncConfig) -> None:
        super().__init__(*args)
        self.job = job
        self.settings = settings
        self.producers: list[_Handle] = []
        self.on_ray = False  # producers as Ray actors (the run is a Ray task)
        self.tasks_out: dict[int, Task] = {}  # handed out, not yet trained on
        self.arrived: dict[int, Produced] = {}
        self.next_step: int | None = None  # the next step whose prompts are drawn
        self.published: Weights | None = None  # the last weights sent
        self.restarts = 0
        self.ledger = Ledger()

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        import torch.multiprocessing as mp

        self._ctx = mp.get_context("spawn")
        self.on_ray = _under_ray()
        for index in range(self.settings.producers):
            self.producers.append(self._new(replace(self.job, index=index)))

    def _new(self, job: ProducerJob) -> _Handle:
        return _RayProducer(job) if self.on_ray else _Producer(self._ctx, job)

    def _restart(self, index: int) -> None:
        """Producer ``index`` died: start it again, give it the last weights and its tasks."""
        dead = self.producers[index]
        dead.stop(timeout=0)
        fresh = self._new(dead.job)
        self.producers[index] = fresh
        self.restarts += 1
        if self.published is not None:
            fresh.weights.put(self.published)
        for step in sorted(dead.outstanding):  # sampled anew: none was delivered
            task = dead.outstanding[step]
            self.ledger.lost_in_flight += len(task.rows) * self.cfg.samples_per_prompt
            fresh.give(task)

    def close(self) -> None:
        """Stop every producer (each finishes the batch in hand, within 30 s, or is killed)."""
        for producer in self.producers:
            producer.stop(timeout=30)
        self.producers = []

    # ------------------------------------------------------------------ weights and tasks
    def _publish(self, step: int) -> None:
        """Send the weights left by ``step`` steps to every producer (every M steps)."""
        last = self.published
        if last is not None and (step <= last.step or step % self.settings.weights_every):
            return
        actor = self.learner.models.actor
        tensors = {n: t.detach().to("cpu", copy=True) for n, t in actor.named_parameters()}
        tensors.update({n: t.detach().to("cpu", copy=True) for n, t in actor.named_buffers()})
        self.published = Weights(step, self.learner.version, tensors)
        for producer in self.producers:
            producer.weights.put(self.published)

    def _give(self, task: Task) -> None:
        """To the producer with the fewest tasks in hand (the first among equals)."""
        min(self.producers, key=lambda p: len(p.outstanding)).give(task)

    def _hand_out(self, upto: int) -> None:
        """Draw the prompts of every step up to ``upto`` not yet drawn, in order."""
        assert self.next_step is not None
        lag = self.settings.max_staleness
        while self.next_step <= upto:
            rows, seeds = self.sampler.next_seeded(self.cfg.prompts_per_step)
            task = Task(self.next_step, rows, seeds, min_weights=self.next_step - 1 - lag)
            self.tasks_out[task.step] = task
            self._give(task)
            self.next_step += 1

    # ------------------------------------------------------------------ the step's batch
    def collect(self, step: int | None = None) -> Collected:
        """Step ``step``'s batch. Under data parallelism rank 0 alone runs the producers, which
        sample and label the whole global batch (as one process would); each rank receives its
        share of the prompts, as :func:`~alignzoo.distributed.shard` would have given them."""
        if step is None:
            raise RunError("training.async produces the batches of training steps only")
        if distributed.active():
            whole = self._produce(step) if distributed.is_main() else None
            shares = None if whole is None else _shares(whole, self.cfg.prompts_per_step)
            collected = distributed.scatter_object(shares)
            collected.batch = collected.batch.to(self.learner.models.device("actor"))
        else:
            collected = self._produce(step)
        collected.metrics.update(self.behaviour.at_collection(collected.batch))
        return collected

    def _produce(self, step: int) -> Collected:
        """The producers' batch of step ``step`` (the whole of it), with the async metrics."""
        if not self.producers:
            self._start()
            for task in sorted(self.tasks_out.values(), key=lambda t: t.step):
                self._give(task)  # restored from a checkpoint: handed out again
            if self.next_step is None:
                self.next_step = step
        self._publish(step - 1)
        depth = sum(1 for s in self.arrived if s >= step)
        self._hand_out(step + self.settings.max_staleness)
        start = time.perf_counter()
        produced = self._wait_for(step)
        waited = time.perf_counter() - start
        del self.tasks_out[step]
        batch = produced.batch
        assert batch is not None
        m = dict(produced.metrics)
        m.update(staleness_metrics(batch, produced, step, self.settings.max_staleness))
        m.update(
            {
                "async/queue_depth": float(depth),
                "async/trainer_wait_s": waited,
                "async/producer_wait_s": produced.waited_s,
                "async/producer_paced_s": produced.paced_s,
                "async/restarts": float(self.restarts),
            }
        )
        self.ledger.trained += produced.samples
        if produced.paced_s > PACED_S:
            self.ledger.paced += produced.samples
        m.update(self.ledger.metrics(queued=sum(p.samples for p in self.arrived.values())))
        device = "cpu" if distributed.active() else self.learner.models.device("actor")
        report = LabelReport([], [], [], [], slowest=produced.slowest)
        return Collected(batch.to(device), produced.samples, produced.tokens, m, report)

    def _wait_for(self, step: int) -> Produced:
        since = time.perf_counter()
        while step not in self.arrived:
            for index, message in self._messages():
                self._receive(index, message)
            for index, producer in enumerate(self.producers):
                if not producer.alive() and producer.results.empty():
                    self._restart(index)
            started = any(p.ready for p in self.producers)
            if not started and time.perf_counter() - since > START_TIMEOUT_S:
                raise RunError(
                    f"training.async: no producer started within {START_TIMEOUT_S:.0f} s"
                )
        return self.arrived.pop(step)

    def _messages(self) -> list[tuple[int, Produced]]:
        """What the producers sent, waiting up to POLL_S for the first (index, message)."""
        out: list[tuple[int, Produced]] = []
        if self.on_ray:  # Ray queues: looked at in turn until one has something
            deadline = time.perf_counter() + POLL_S
            while not out and time.perf_counter() < deadline:
                for index, producer in enumerate(self.producers):
                    with contextlib.suppress(queue.Empty):
                        out.append((index, producer.results.get_nowait()))
                if not out:
                    time.sleep(0.01)
            return out
        from multiprocessing.connection import wait

        readers = {p.results._reader: i for i, p in enumerate(self.producers)}  # type: ignore[union-attr]
        for reader in wait(list(readers), timeout=POLL_S):
            index = readers[reader]
            try:
                out.append((index, self.producers[index].results.get(timeout=POLL_S)))
            except (queue.Empty, EOFError, OSError):
                continue  # a producer that died mid-message: found by its caller
        return out

    def _receive(self, index: int, message: Produced) -> None:
        producer = self.producers[index]
        if message.kind == "ready":
            producer.ready = True
        elif message.kind == "error":
            where = f" (step {message.step})" if message.step is not None else ""
            raise RunError(f"training.async: producer {index}{where} failed: {message.error}")
        elif message.kind == "batch":
            assert message.step is not None
            producer.outstanding.pop(message.step, None)
            self.ledger.delivered += message.samples
            if message.step in self.tasks_out and message.step not in self.arrived:
                self.arrived[message.step] = message
            else:  # a step delivered twice (its producer died after delivering): not trained
                self.ledger.discarded += message.samples

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The steps handed out and not yet trained on (their prompts and seeds): a resumed
        run hands them out again, so no prompt is skipped and none is trained twice."""
        return {
            "tasks": [
                {"step": t.step, "rows": t.rows, "seeds": t.seeds, "min_weights": t.min_weights}
                for t in sorted(self.tasks_out.values(), key=lambda t: t.step)
            ],
            "next_step": self.next_step,
            # The batches delivered and not yet trained are not kept: a resume samples them
            # anew, so the checkpoint counts them lost.
            "ledger": self.ledger.resumed(queued=sum(p.samples for p in self.arrived.values())),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tasks_out = {t["step"]: Task(**t) for t in state.get("tasks", [])}
        self.arrived = {}
        self.next_step = state.get("next_step")
        self.ledger = Ledger(**state.get("ledger", {}))


def _shares(whole: Collected, prompts: int) -> list[Collected]:
    """Each rank's share of a step's whole batch: the samples of its contiguous share of the
    ``prompts`` prompts (group ids counted from 0 again), as each rank samples them without
    async. Rank 0's share carries the step's metrics, counts and labeling report; the others
    carry none (the step's reduction then sums and averages over rank 0's alone)."""
    world = distributed.world_size()
    per = prompts // world
    batch = whole.batch
    out = []
    for rank in range(world):
        first = rank * per
        rows = [i for i, g in enumerate(batch.group_ids.tolist()) if first <= g < first + per]
        share = batch.select(rows)
        share.group_ids = share.group_ids - first
        if rank == 0:
            out.append(Collected(share, whole.samples, whole.tokens, whole.metrics, whole.report))
        else:
            out.append(Collected(share, 0, 0, {}, None))
    return out


def staleness_metrics(
    batch: RolloutBatch, produced: Produced, step: int, max_staleness: int
) -> dict[str, float]:
    """Step ``step``'s staleness over its sampled response tokens: each token's age in steps
    (the weights of step ``step - 1`` train on it) from its policy version, mean, max and the
    histogram ``rollout/staleness_hist/<k>`` for k = 0 .. ``max_staleness``."""
    lag = torch.full((1,), float(step - 1 - produced.weights_step))  # every token, if unrecorded
    versions = batch.token_versions
    if versions is not None and produced.version_steps:
        sampled = versions[(versions >= 0) & batch.response_mask.bool().to(versions.device)]
        if sampled.numel():
            distinct, index = torch.unique(sampled.cpu(), return_inverse=True)
            known = produced.version_steps
            steps = [known.get(v, produced.weights_step) for v in distinct.tolist()]
            lag = (step - 1) - torch.tensor(steps, dtype=torch.float64)[index]
    m = {
        canonical.ROLLOUT_STALENESS: float(lag.mean()),
        canonical.ROLLOUT_STALENESS_MAX: float(lag.max()),
    }
    for k in range(max_staleness + 1):
        m[f"{canonical.ROLLOUT_STALENESS_HIST}{k}"] = float((lag == k).double().mean())
    return m


@dataclass
class Ledger:
    """Every sample the producers made, in responses, over the run (checkpointed):

    - ``delivered``: handed to the trainer by a producer;
    - ``trained``: given to a training step;
    - ``discarded``: delivered for a step that had its batch already (a producer that died
      after delivering, whose step was sampled again): never trained twice;
    - ``lost_in_flight``: being sampled by a producer that died (sampled again, never delivered);
    - ``lost_queued``: delivered but not yet trained at the checkpoint a resume started from
      (sampled again after the resume);
    - ``paced``: trained, from a batch whose producer had to wait for weights fresh enough for
      the staleness bound before it started (admission control; none is dropped for it).

    They balance: delivered = trained + queued + discarded + lost_queued, queued being the
    batches delivered and waiting for their step."""

    delivered: int = 0
    trained: int = 0
    discarded: int = 0
    lost_in_flight: int = 0
    lost_queued: int = 0
    paced: int = 0

    def metrics(self, queued: int) -> dict[str, float]:
        return {
            "async/samples_paced": float(self.paced),
            "async/samples_delivered": float(self.delivered),
            "async/samples_trained": float(self.trained),
            "async/samples_queued": float(queued),
            "async/samples_discarded": float(self.discarded),
            "async/samples_lost": float(self.lost_in_flight + self.lost_queued),
        }

    def resumed(self, queued: int) -> dict[str, int]:
        """The ledger as a resume from now finds it: what waits in the queue is lost."""
        state = dict(vars(self))
        state["lost_queued"] += queued
        return state
