"""Executors: where the arm x seed runs of an experiment train.

The runner hands every executor the same :class:`RunJob`: the experiment file, the resolved
spec, one arm, one seed, the run folder and the resources the run asks for. A job is data,
never live components: wherever it runs (this process, a spawned worker, a Ray task on another
node) the arm's components are built there, from the file, by the registry of that machine.

- :class:`LocalExecutor`: in this process, one run after the other, or (``jobs > 1``) that
  many spawned worker processes, each with ``cpu_count // jobs`` BLAS/torch threads. A worker
  killed by the OS fails its own run only.
- :class:`RayExecutor` (the ``ray`` extra): every run a Ray task with the job's CPU and GPU
  request (``num_gpus`` from the device mapper's placement), on the cluster at ``address`` or
  a local Ray started for the experiment. A task whose worker dies is retried (``retries``
  times; the retry resumes from the run's last checkpoint), then reported failed like a
  killed local worker. The output folder must be on a filesystem every node sees. A run with
  rollout producers (``training.async``) gets a placement group: its own bundle and one per
  producer, which it starts there as Ray actors, so that a busy cluster never holds a run
  waiting for its producers' CPUs.

Every executor reports each run's :class:`~alignzoo.experiment.arm.RunResult` through
``done(result)`` as it ends; the runner writes the report from the run folders alone, so the
report does not depend on the executor.

A run that starts trains with the threads it is given here; a resumed run trains with the
count its first attempt had, which its checkpoints record (:mod:`alignzoo.engine.threads`), in a
worker or in this process alike.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from alignzoo.engine.threads import limit_threads
from alignzoo.errors import UserError
from alignzoo.experiment.arm import (
    RunFn,
    RunResult,
    error_text,
    execute_run,
    record_failure,
    run_engine,
)
from alignzoo.runfolder import RunStatus, seed_folder

if TYPE_CHECKING:
    from alignzoo.config.loader import LoadedExperiment
    from alignzoo.config.schema import ExperimentSpec

Done = Callable[[RunResult], None]
Started = Callable[[str, int], None]


@dataclass(frozen=True)
class RunJob:
    """One arm x seed run as an executor receives it: plain data, picklable anywhere.

    ``source`` is the experiment file and ``spec`` the resolved experiment (with its command-line
    overrides, and the arms and seeds of a resumed folder); ``resume`` continues the run from
    its checkpoint; ``threads`` caps BLAS/torch threads in a worker (a resumed run then trains
    with the count its checkpoint records); ``resources`` is what the run asks a scheduler for
    (``{"cpus": 1.0, "gpus": 0.0}``).
    """

    source: str
    spec: ExperimentSpec
    arm: str
    seed: int
    run_dir: Path
    resume: bool
    threads: int
    resources: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.arm}/{seed_folder(self.seed)}"

    def load(self) -> LoadedExperiment:
        """The experiment with this arm's components, built here from the file."""
        from alignzoo.config.loader import load_experiment

        loaded = load_experiment(self.source, arms=[self.arm], overrides=self.spec.overrides)
        loaded.spec = self.spec
        return loaded


class Executor(Protocol):
    """Runs jobs and reports each result as it ends."""

    def run(
        self,
        loaded: LoadedExperiment,
        jobs: Sequence[RunJob],
        fn: RunFn,
        started: Started,
        done: Done,
    ) -> None:
        """Run every job; call ``started(arm, seed)`` when one starts, ``done(result)`` when it ends."""
        ...


def _loaded_for(job: RunJob, fn: RunFn) -> LoadedExperiment:
    """What the run function receives in a worker: the components built from the file; a
    replacement ``fn`` (a test double of the engine) gets the spec alone."""

    if fn is run_engine:
        return job.load()
    from alignzoo.config.loader import LoadedExperiment

    return LoadedExperiment(spec=job.spec, source=job.source, components={})


def run_job(job: RunJob, fn: RunFn) -> RunResult:
    """Run one job in this (worker) process; any failure becomes a failed result."""

    try:
        loaded = _loaded_for(job, fn)
    except Exception as exc:  # the file changed, a plugin is missing on this node, ...
        error = f"could not load {job.source} for {job.name}: {error_text(exc)}"
        record_failure(job.run_dir, error)
        return RunResult(job.arm, job.seed, job.run_dir, RunStatus.FAILED, error)
    return execute_run(fn, loaded, job.arm, job.seed, job.run_dir, job.resume, None)


# --------------------------------------------------------------------------- local


class LocalExecutor:
    """This machine: in this process (``jobs == 1``) or ``jobs`` spawned worker processes."""

    def __init__(self, jobs: int = 1, console: Any = None) -> None:
        self.jobs = jobs
        self.console = console

    def run(
        self,
        loaded: LoadedExperiment,
        jobs: Sequence[RunJob],
        fn: RunFn,
        started: Started,
        done: Done,
    ) -> None:

        if self.jobs == 1 or len(jobs) <= 1:
            for job in jobs:
                started(job.arm, job.seed)
                done(
                    execute_run(
                        fn, loaded, job.arm, job.seed, job.run_dir, job.resume, self.console
                    )
                )
            return
        self._processes(jobs, fn, started, done)

    def _processes(self, jobs: Sequence[RunJob], fn: RunFn, started: Started, done: Done) -> None:
        """At most ``self.jobs`` runs at a time, each in its own spawned process.

        One process per run (not a pool): a worker killed by the OS fails only its own run,
        and the others go on.
        """
        ctx = multiprocessing.get_context("spawn")
        waiting = list(jobs)
        running: dict[tuple[str, int], tuple[RunJob, Any, Connection]] = {}
        try:
            while waiting or running:
                while waiting and len(running) < self.jobs:
                    job = waiting.pop(0)
                    receive, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(
                        target=_process_main,
                        args=(job, fn, send),
                        name=f"alignzoo {job.arm} seed-{job.seed}",
                    )
                    proc.start()
                    send.close()  # the child holds the only writer: its exit means EOF here
                    running[(job.arm, job.seed)] = (job, proc, receive)
                    started(job.arm, job.seed)
                handles = [h for _, p, r in running.values() for h in (r, p.sentinel)]
                wait_for(handles, timeout=1.0)
                for key, (job, proc, receive) in list(running.items()):
                    if proc.is_alive() and not receive.poll():
                        continue
                    del running[key]
                    done(_collect(job, proc, receive))
        except KeyboardInterrupt:
            for _, proc, _ in running.values():
                proc.terminate()
            raise


def _process_main(job: RunJob, fn: RunFn, conn: Connection) -> None:
    """Body of one run's worker process: run it and send the result back to the parent."""

    limit_threads(job.threads)
    try:
        result = run_job(job, fn)
    except BaseException as exc:  # tell the parent why, instead of dying silently
        error = f"worker process failed: {error_text(exc)}"
        result = RunResult(job.arm, job.seed, job.run_dir, RunStatus.FAILED, error)
    conn.send(result)
    conn.close()


def _collect(job: RunJob, proc: Any, receive: Connection) -> RunResult:
    """The result a finished worker sent, or a failure naming how the process died."""

    try:
        result: RunResult = receive.recv()
    except (EOFError, OSError):  # the process ended without a word: killed, out of memory, ...
        proc.join()
        error = f"worker process died (exit code {proc.exitcode}) before the run finished"
        record_failure(job.run_dir, error)
        result = RunResult(job.arm, job.seed, job.run_dir, RunStatus.FAILED, error)
    proc.join()
    receive.close()
    return result


# --------------------------------------------------------------------------- ray


def import_ray() -> Any:
    """The ray module, or a UserError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(
            "--executor ray needs Ray: pip install 'alignzoo[ray]' (or pip install ray)"
        ) from None
    return ray


def _ray_task(job: RunJob, fn: RunFn) -> RunResult:
    """A run as a Ray task. A retried task (its first worker died) resumes from the run's
    checkpoint: whatever the first attempt wrote is there."""
    limit_threads(job.threads)
    again = job.resume or (job.run_dir.is_dir() and any(job.run_dir.iterdir()))
    if again != job.resume:
        job = RunJob(**{**job.__dict__, "resume": True})
    return run_job(job, fn)


class RayExecutor:
    """Every run a Ray task with the job's resources, on a cluster or a local Ray instance.

    ``address`` is a running cluster's (``ray start --head`` prints it; "auto" finds the one on
    this machine); None starts a local Ray for the experiment (and stops it afterwards) unless
    one is already running in this process. ``retries`` is how many times a task whose worker
    died (killed, out of memory, a lost node) is run again before its run is reported failed.
    """

    def __init__(self, address: str | None = None, retries: int = 1, console: Any = None) -> None:
        if retries < 0:
            raise UserError(f"--retries must be at least 0, got {retries}")
        self.address = address
        self.retries = retries
        self.console = console

    def run(
        self,
        loaded: LoadedExperiment,
        jobs: Sequence[RunJob],
        fn: RunFn,
        started: Started,
        done: Done,
    ) -> None:

        ray = import_ray()
        ours = not ray.is_initialized()
        if ours:
            _init_ray(ray, self.address)
        task = ray.remote(_ray_task)
        if self.console is not None:
            self.console.print(ray_plan(jobs, ray.cluster_resources()), highlight=False)
        pending: dict[Any, RunJob] = {}
        groups: dict[Any, Any] = {}  # a run with producers: its placement group
        try:
            for job in jobs:
                cpus, gpus = job.resources.get("cpus", job.threads), job.resources.get("gpus", 0.0)
                options: dict[str, Any] = {
                    "num_cpus": cpus,
                    "num_gpus": gpus,
                    "max_retries": self.retries,
                    "retry_exceptions": False,  # a failing run is a result, not a crash
                    "name": f"alignzoo {job.arm} seed-{job.seed}",
                }
                bundles = producer_bundles(job)
                group = None
                if bundles:  # the run and its producers reserved together: none waits for CPUs
                    from ray.util.placement_group import placement_group
                    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                    own = {"CPU": float(cpus)}
                    if gpus:
                        own["GPU"] = float(gpus)
                    group = placement_group([own, *bundles], strategy="PACK")
                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=0
                    )
                ref = task.options(**options).remote(job, fn)
                pending[ref] = job
                if group is not None:
                    groups[ref] = group
                started(job.arm, job.seed)
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    job = pending.pop(ref)
                    if ref in groups:
                        ray.util.remove_placement_group(groups.pop(ref))
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayError as exc:
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                        error = (
                            f"ray task died ({type(exc).__name__}) after {self.retries + 1} "
                            f"attempt(s) before the run finished: {first}"
                        )
                        record_failure(job.run_dir, error)
                        result = RunResult(job.arm, job.seed, job.run_dir, RunStatus.FAILED, error)
                    done(result)
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            for group in groups.values():
                with contextlib.suppress(Exception):  # Ray already gone
                    ray.util.remove_placement_group(group)
            if ours:
                ray.shutdown()


def producer_bundles(job: RunJob) -> list[dict[str, float]]:
    """The CPUs a run's rollout producers take as Ray actors (``training.async``): one bundle
    per producer, of its thread count; none for an arm without producers."""
    arm = job.spec.arms.get(job.arm)
    settings = arm.training.async_ if arm is not None else None
    if settings is None:
        return []
    threads = float(settings.producer_threads or job.threads)
    return [{"CPU": threads} for _ in range(settings.producers)]


def ray_plan(jobs: Sequence[RunJob], cluster: dict[str, float]) -> str:
    """One line: how many runs, what each asks for (its rollout producers' CPUs included:
    :func:`producer_bundles`), what the cluster has, how many fit at once (by CPUs and
    GPUs)."""
    if not jobs:
        return "ray: no run to schedule"

    def asks(job: RunJob) -> float:
        own = float(job.resources.get("cpus", job.threads))
        return own + sum(b["CPU"] for b in producer_bundles(job))

    cpus = max(asks(job) for job in jobs)
    gpus = max(job.resources.get("gpus", 0.0) for job in jobs)
    have_cpus, have_gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    fits = [int(have_cpus // cpus)] if cpus else []
    if gpus:
        fits.append(int(have_gpus // gpus))
    at_once = min([len(jobs), *fits])
    return (
        f"ray: {len(jobs)} runs, each asking {cpus:g} CPU(s) and {gpus:g} GPU(s); the cluster has "
        f"{have_cpus:g} CPUs and {have_gpus:g} GPUs: up to {at_once} at a time"
        + ("" if at_once else " (none fits: add nodes, or ask less per run with a larger --jobs)")
    )


def _init_ray(ray: Any, address: str | None) -> None:
    """Connect to ``address`` or start a local instance whose workers import what we import."""
    try:
        if address is not None:
            ray.init(address=address, log_to_driver=False)
            return
        paths = [p for p in sys.path if p]  # this checkout, plugin folders added at run time
        env = {"PYTHONPATH": os.pathsep.join(paths)}
        ray.init(
            address="local",  # a new instance, even where another Ray runs on this machine
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": env},
            num_cpus=os.cpu_count() or 1,
        )
    except ConnectionError as exc:
        raise UserError(f"--address {address}: cannot connect to a Ray cluster ({exc})") from None
