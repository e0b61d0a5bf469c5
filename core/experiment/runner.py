"""The A/B runner: every arm x seed of an experiment under one budget, then the report.

Fairness is the engine's job given the same inputs, and the runner's job is to give every arm
exactly the same ones: the same seeds (passed unchanged to each arm, so each seed means the same
prompt order, initial weights and evaluation set in every arm), the same budget and evaluation
schedule (experiment-level sections of the spec).

Layout: ``<out>/experiment.yaml`` (the resolved spec), ``<out>/<arm>/seed-<n>/`` (one folder per
run, written by :func:`alignzoo.engine.loop.run_one`), ``<out>/report.md``, ``report.html``
and ``plots/``.

Resuming: with ``resume=True`` a run whose ``status.json`` says finished is skipped and any
other run continues from its checkpoint; without it, an existing non-empty folder is an error
(nothing already written is ever overwritten). A failing run is reported with its error and
the others go on; the result's ``failed`` is then True.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from alignzoo import distributed, provenance
from alignzoo.config.loader import LoadedExperiment
from alignzoo.config.schema import ExperimentSpec
from alignzoo.errors import RunError, UserError
from alignzoo.experiment.arm import (
    RunFn,
    RunResult,
    error_text,
    execute_run,
    run_engine,
)
from alignzoo.experiment.executors import Executor, LocalExecutor, RunJob
from alignzoo.experiment.progress import ProgressView, print_summary
from alignzoo.runfolder import RunFolder, RunStatus, write_atomic
from alignzoo.runfolder.runfiles import EXPERIMENT_FILE, read_status

# Spec sections that must match for a resumed experiment to stay a fair comparison.
_SHARED_SECTIONS = ("budget", "data", "evaluation", "model", "training")


@dataclass
class ExperimentResult:
    """What :func:`run_experiment` did: every run's result and where the report is."""

    out_dir: Path
    runs: list[RunResult] = field(default_factory=list)
    failed: bool = False
    report_paths: list[Path] = field(default_factory=list)


# --------------------------------------------------------------------------- folder


def experiment_dir(spec: ExperimentSpec, out_dir: Path | None) -> Path:
    """``out_dir`` or ``<spec.output_dir>/<spec.name>``."""
    return Path(out_dir) if out_dir is not None else Path(spec.output_dir) / spec.name


def _merge_with_existing(spec: ExperimentSpec, out: Path) -> ExperimentSpec:
    """On resume: keep the arms and seeds already in the folder, refuse an unfair mix."""
    path = out / EXPERIMENT_FILE
    if not path.exists():
        return spec
    try:
        old = ExperimentSpec.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except Exception as exc:
        raise UserError(f"{path}: cannot read the experiment being resumed ({exc})") from None
    differ = [
        s
        for s in _SHARED_SECTIONS
        if getattr(old, s).model_dump(mode="json") != getattr(spec, s).model_dump(mode="json")
    ]
    differ += [
        f"arms.{a}"
        for a in spec.arms
        if a in old.arms
        and old.arms[a].model_dump(mode="json") != spec.arms[a].model_dump(mode="json")
    ]
    if differ:
        raise UserError(
            f"cannot resume {out}: the experiment there differs from this one in "
            f"{', '.join(differ)}; runs with different settings would not be a fair "
            "comparison. Choose another folder with --out."
        )
    arms = dict(old.arms)
    arms.update({a: s for a, s in spec.arms.items() if a not in arms})
    seeds = list(old.seeds) + [s for s in spec.seeds if s not in old.seeds]
    return old.model_copy(update={"arms": arms, "seeds": seeds})


def _check_inside(spec: ExperimentSpec, out: Path) -> None:
    """Every run folder resolves (symlinks and '..' followed) to a place inside ``out``."""
    root = out.resolve()
    for arm in spec.arms:
        for seed in spec.seeds:
            folder = RunFolder.of(out, arm, seed).path
            run_dir = folder.resolve()
            if not run_dir.is_relative_to(root):
                raise UserError(
                    f"{folder} resolves to {run_dir}, outside the output "
                    f"folder {root} (a symbolic link?); nothing is written outside it"
                )


def prepare_folder(spec: ExperimentSpec, out: Path, resume: bool) -> None:
    """Check the experiment folder may be used and write ``experiment.yaml``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output path {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not resume:
        raise UserError(
            f"{out} already holds an experiment; pass --resume to continue it "
            "(finished runs are kept) or choose another folder with --out"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, no permission, ...
        raise UserError(f"cannot create the output folder {out}: {exc.strerror or exc}") from None
    _check_inside(spec, out)
    recorded = _merge_with_existing(spec, out) if resume else spec
    text = yaml.safe_dump(recorded.model_dump(mode="json"), sort_keys=False)
    write_atomic(out / EXPERIMENT_FILE, text)


def check_before_writing(loaded: LoadedExperiment) -> None:
    """What ``alignzoo validate`` checks beyond the file: the data every run will read, and
    each arm's precision on the device its actor would be placed on (ConfigError, exit 2)."""
    from alignzoo.engine.assemble import check_precision
    from alignzoo.engine.datacheck import check_data

    check_data(loaded)
    check_precision(loaded)


# --------------------------------------------------------------------------- one run


def _check_resumable(loaded: LoadedExperiment, out: Path, say: Callable[..., Any] | None) -> None:
    """Before anything is written: every unfinished run that has checkpoints has a usable
    one (else :class:`UserError`, naming each checkpoint and why, with the folder untouched)."""
    from alignzoo.engine.loop import moving_reference, needs_critic, resume_point

    for arm in loaded.spec.arms:
        for seed in loaded.spec.seeds:
            run = RunFolder.of(out, arm, seed)
            if not run.checkpoints.is_dir() or (
                read_status(run.path).get("status") == RunStatus.FINISHED
            ):
                continue
            point = resume_point(run.path, needs_critic(loaded, arm), moving_reference(loaded, arm))
            if point.unusable and say is not None:
                for folder, why in point.unusable:
                    say(
                        f"[yellow]{arm}/{run.path.name}[/yellow]: checkpoint {folder.name} is "
                        f"unusable ({why}); resuming from {point.folder.name if point.folder else '-'}",
                        highlight=False,
                    )


# --------------------------------------------------------------------------- experiment


def run_experiment(
    loaded: LoadedExperiment,
    out_dir: Path | None = None,
    resume: bool = False,
    jobs: int = 1,
    console: Any = None,
    run_fn: RunFn | None = None,
    executor: Executor | None = None,
) -> ExperimentResult:
    """Train every arm x seed of ``loaded`` and write the report.

    Each run is a :class:`~alignzoo.experiment.executors.RunJob` (experiment file, arm, seed,
    resources) handed to ``executor``: by default a
    :class:`~alignzoo.experiment.executors.LocalExecutor`, which runs them here one by one or,
    with ``jobs > 1``, in that many spawned worker processes; a
    :class:`~alignzoo.experiment.executors.RayExecutor` runs them as Ray tasks. Every job caps
    BLAS/torch threads at ``max(1, cpu_count // jobs)`` in a worker; a resumed run trains with
    the count its checkpoint records, in a worker or here (:mod:`alignzoo.engine.threads`), so its
    numbers do not depend on how many runs are left or on ``jobs``. ``run_fn`` replaces the
    engine's ``run_one`` (same signature; a module-level function when it runs in workers,
    where it receives the spec without components).
    """

    if jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {jobs}")
    if distributed.active():
        return _run_data_parallel(loaded, out_dir, resume, jobs, console, run_fn, executor)
    spec = loaded.spec
    out = experiment_dir(spec, out_dir)
    if run_fn is None:  # what `alignzoo validate` checks, once, before anything is written
        check_before_writing(loaded)
    if resume:
        _check_resumable(loaded, out, say=console.print if console is not None else None)
    prepare_folder(spec, out, resume)
    provenance.record(out, provenance.collect(loaded.source), resume)
    fn: RunFn = run_fn if run_fn is not None else run_engine
    say = console.print if console is not None else (lambda *a, **k: None)

    planned = [
        (arm, seed, RunFolder.of(out, arm, seed).path) for arm in spec.arms for seed in spec.seeds
    ]
    plan = _plan(spec, out, resume)
    results = {(arm, seed): kept for arm, seed, _, kept in plan if kept is not None}
    todo = [
        (arm, seed, RunFolder.of(out, arm, seed).path, again)
        for arm, seed, again, kept in plan
        if kept is None
    ]

    say(
        f"experiment [bold]{spec.name}[/bold]: {len(spec.arms)} arms x {len(spec.seeds)} seeds "
        f"into {out}" + (f" ({len(results)} finished runs kept)" if results else ""),
        highlight=False,
    )
    runner = executor if executor is not None else LocalExecutor(jobs, console)
    scheduled = not isinstance(runner, LocalExecutor)  # a scheduler reads the resources
    in_workers = scheduled or (jobs > 1 and len(todo) > 1)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    resources = {
        arm: run_resources(loaded, arm, threads, placed=scheduled and fn is run_engine)
        for arm in {arm for arm, _, _, _ in todo}
    }
    work = [
        RunJob(
            source=str(loaded.source),
            spec=spec,
            arm=arm,
            seed=seed,
            run_dir=run_dir,
            resume=again,
            threads=threads,
            resources=resources[arm],
        )
        for arm, seed, run_dir, again in todo
    ]
    view = ProgressView(console, spec, planned)
    view.announce_evals = in_workers  # the workers' own consoles are off

    def done(result: RunResult) -> None:
        results[(result.arm, result.seed)] = result
        view.done(result)
        _say_result(say, result)

    try:
        with view:
            for result in results.values():
                view.done(result)
            if in_workers:
                for job in work:
                    view.queue(job.arm, job.seed)
            runner.run(loaded, work, fn, view.start, done)
    except KeyboardInterrupt:
        say(f"[yellow]interrupted[/yellow]: rerun with --resume --out {out} to continue")
        raise

    ordered = [results[(arm, seed)] for arm, seed, _ in planned]
    return _report(out, ordered, say, console)


def _report(
    out: Path, ordered: list[RunResult], say: Callable[..., Any], console: Any
) -> ExperimentResult:
    """Write the report of the finished runs and say how the experiment ended."""
    from alignzoo.report.sections import write_report

    failed = any(r.status != RunStatus.FINISHED for r in ordered)
    report_paths: list[Path] = []
    try:
        report_paths = write_report(out)
    except Exception as exc:
        failed = True
        say(
            f"[red]could not write the report[/red]: {error_text(exc)}; the runs are on disk, "
            f"rerun `alignzoo report {out}`",
            highlight=False,
        )
    bad = [r.name for r in ordered if r.status != RunStatus.FINISHED]
    if bad:
        say(
            f"[red]{len(bad)} of {len(ordered)} runs failed[/red]: {', '.join(bad)} "
            "(errors above and in the report)",
            highlight=False,
        )
    if report_paths:
        if console is not None:
            print_summary(console, out)
        say(f"report: {' and '.join(str(p) for p in report_paths)}", highlight=False)
    return ExperimentResult(out_dir=out, runs=ordered, failed=failed, report_paths=report_paths)


def run_resources(
    loaded: LoadedExperiment, arm: str, threads: int, placed: bool
) -> dict[str, float]:
    """What one run of ``arm`` asks a scheduler for: ``threads`` CPUs and, when ``placed``, one
    GPU per distinct GPU its device mapper places a role on (tensor-parallel groups included),
    on this machine's devices."""
    resources = {"cpus": float(threads), "gpus": 0.0}
    if not placed:
        return resources
    from alignzoo.engine.assemble import placement_plan

    gpus = {
        device
        for placement in placement_plan(loaded, arm).values()
        for device in placement.devices()
        if device.startswith("cuda")
    }
    resources["gpus"] = float(len(gpus))
    return resources


def _run_data_parallel(
    loaded: LoadedExperiment,
    out_dir: Path | None,
    resume: bool,
    jobs: int,
    console: Any,
    run_fn: RunFn | None,
    executor: Executor | None,
) -> ExperimentResult:
    """Every arm x seed trained by all the processes of a torch.distributed group together,
    one run after the other (:mod:`alignzoo.distributed`). Rank 0 checks and writes the
    experiment folder and the report, and decides which runs to train or resume; the other
    ranks keep their scratch files in ``<out>/.ranks/rank-<r>/`` (removed at the end) and
    resume from rank 0's checkpoints.

    A run that fails on any rank stops the whole group (its ranks could no longer meet in the
    same collective calls): that rank raises :class:`RunError` and the launcher stops the
    others; ``--resume`` continues from the last checkpoint."""

    world = distributed.world_size()
    if jobs > 1 or (executor is not None and not isinstance(executor, LocalExecutor)):
        raise UserError(
            f"{world} processes already train each run together: leave --jobs and --executor unset"
        )
    spec = loaded.spec
    out = experiment_dir(spec, out_dir)
    main = distributed.is_main()
    fn: RunFn = run_fn if run_fn is not None else run_engine
    say = console.print if console is not None and main else (lambda *a, **k: None)
    problem: str | None = None
    plan: list[tuple[str, int, bool, RunResult | None]] = []
    if main:  # checked and prepared once; every rank then follows rank 0's plan
        try:
            if run_fn is None:
                check_before_writing(loaded)
            if resume:
                _check_resumable(loaded, out, say=say)
            prepare_folder(spec, out, resume)
            provenance.record(out, provenance.collect(loaded.source), resume)
            plan = _plan(spec, out, resume)
        except UserError as exc:
            problem = str(exc)
    problem, plan = distributed.broadcast_object((problem, plan))
    if problem is not None:
        raise UserError(problem)
    kept = sum(1 for *_, skipped in plan if skipped is not None)
    say(
        f"experiment [bold]{spec.name}[/bold]: {len(spec.arms)} arms x {len(spec.seeds)} seeds "
        f"into {out}, each run on {world} processes"
        + (f" ({kept} finished runs kept)" if kept else ""),
        highlight=False,
    )
    scratch = out / ".ranks" / f"rank-{distributed.rank()}"
    results = []
    for arm, seed, again, skipped in plan:
        if skipped is not None:
            results.append(skipped)
            continue
        shared_dir = RunFolder.of(out, arm, seed).path
        run_dir = shared_dir if main else RunFolder.of(scratch, arm, seed).path
        call = fn
        if again and fn is run_engine:  # rank 0's checkpoints, read by every rank
            agree_on_resume(loaded, arm, seed, shared_dir)
            if not main:
                call = functools.partial(run_engine, resume_from=shared_dir)
        result = execute_run(call, loaded, arm, seed, run_dir, again, console if main else None)
        if result.status != RunStatus.FINISHED:
            raise RunError(
                f"{result.name} failed on rank {distributed.rank()} of {world}: "
                f"{result.error}. The other processes stop with it; rerun with --resume "
                f"--out {out} to continue from the last checkpoint"
            )
        if main:
            _say_result(say, result)
        results.append(result)
        distributed.barrier()
    if not main:
        shutil.rmtree(scratch, ignore_errors=True)
    distributed.barrier()
    if not main:
        return ExperimentResult(out_dir=out, runs=results, failed=False)
    shutil.rmtree(out / ".ranks", ignore_errors=True)
    return _report(out, results, say, console)


def agree_on_resume(loaded: LoadedExperiment, arm: str, seed: int, run_dir: Path) -> None:
    """Every rank proves it would resume from the checkpoint rank 0 resumes from (the same
    name, the same files, sizes and hashes) before any rank loads it; otherwise every rank
    raises the same :class:`UserError` (exit 2), naming the folder, the ranks and their hosts
    that differ and what to do. Without it a node whose output folder is not shared resumes
    from what its own disk holds (or from nothing) and the run silently diverges."""
    import socket

    from alignzoo.engine.checkpoint import checkpoint_manifest
    from alignzoo.engine.loop import moving_reference, needs_critic, resume_point
    from alignzoo.engine.mirror import restore_from_mirror

    try:  # a folder without a checkpoint gets the mirror's newest first, on every rank
        restore_from_mirror(loaded, arm, seed, RunFolder(run_dir).checkpoints, lambda *_: None)
        point = resume_point(run_dir, needs_critic(loaded, arm), moving_reference(loaded, arm))
        seen: Any = checkpoint_manifest(point.folder) if point.folder is not None else None
    except UserError as exc:
        seen = f"no usable checkpoint ({exc})"
    views = distributed.all_gather_object((socket.gethostname(), seen))
    host0, first = views[0]
    differing = [(rank, host) for rank, (host, view) in enumerate(views) if view != first]
    if not differing:
        return

    def said(view: Any) -> str:
        if view is None:
            return "no checkpoint"
        if isinstance(view, str):
            return view
        return f"checkpoint {view['checkpoint']}"

    ranks = "; ".join(
        f"rank {rank} on {host} sees {said(views[rank][1])}"
        + _files_apart(first, views[rank][1], rank)
        for rank, host in differing
    )
    raise UserError(
        f"cannot resume {run_dir}: rank 0 on {host0} sees {said(first)}, but {ranks}: "
        "every rank must read the same checkpoint. Put "
        "the output folder (--out) on a filesystem every node shares, or mirror checkpoints "
        "to object storage (training.checkpoint_mirror), then run --resume again "
        "on every node (nothing of this run was loaded or changed)"
    )


def _files_apart(first: Any, other: Any, rank: int) -> str:
    """Where two views of one checkpoint name differ: each file missing on one side or with
    another size or SHA-256, as rank 0 and ``rank`` see it ("" when the names differ)."""
    if not isinstance(first, dict) or not isinstance(other, dict):
        return ""
    if first["checkpoint"] != other["checkpoint"]:
        return ""
    mine, theirs = first["files"], other["files"]

    def seen(view: Any) -> str:
        return "missing" if view is None else f"{view[0]} bytes, sha256 {view[1][:12]}"

    apart = [
        f"{name} (rank 0: {seen(mine.get(name))}; rank {rank}: {seen(theirs.get(name))})"
        for name in sorted(set(mine) | set(theirs))
        if mine.get(name) != theirs.get(name)
    ]
    return ", with other files: " + ", ".join(apart) if apart else ""


def _plan(
    spec: ExperimentSpec, out: Path, resume: bool
) -> list[tuple[str, int, bool, RunResult | None]]:
    """Per arm x seed: whether it resumes from its checkpoints, or (on a resume) the result of
    a run that finished already and is kept."""
    plan: list[tuple[str, int, bool, RunResult | None]] = []
    for arm in spec.arms:
        for seed in spec.seeds:
            run_dir = RunFolder.of(out, arm, seed).path
            status = read_status(run_dir)
            if resume and status.get("status") == RunStatus.FINISHED:
                kept = RunResult(
                    arm,
                    seed,
                    run_dir,
                    RunStatus.FINISHED,
                    skipped=True,
                    steps=status.get("step"),
                    wall_clock_s=status.get("wall_clock_s"),
                )
                plan.append((arm, seed, False, kept))
            else:
                has_state = run_dir.is_dir() and any(run_dir.iterdir())
                plan.append((arm, seed, resume and has_state, None))
    return plan


def _say_result(say: Callable[..., Any], result: RunResult) -> None:
    if result.status == RunStatus.FINISHED:
        say(f"[green]finished[/green] {result.name}", highlight=False)
    else:
        say(f"[red]failed[/red] {result.name}: {result.error}", highlight=False)
