"""One run of one arm with one seed: from a validated experiment to metrics, evaluations and
checkpoints, with exact resume. The entry point of the A/B runner is :func:`run_one`.

Failures: :func:`run_one` never raises for a failure of the run itself (a bad path, a plugin
crash, a NaN loss, ...): it writes ``status.json`` with ``"failed"`` and the error, the
traceback to ``error.log``, and returns ``RunSummary(status="failed", error=...)``. The last
checkpoint on disk is left as it was. Only ``KeyboardInterrupt`` propagates (status stays
``"running"``, so the run resumes later).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml
from rich.console import Console

from alignzoo import distributed, provenance
from alignzoo import metrics as canonical
from alignzoo.config.loader import LoadedExperiment
from alignzoo.config.schema import Budget
from alignzoo.engine.assemble import Run, assemble, labeler_hooks
from alignzoo.engine.checkpoint import (
    ResumePoint,
    TrainingState,
    checkpoint_name,
    complete_checkpoints,
    find_resume_point,
    gather_sharded,
    load_checkpoint,
    point_latest_at,
    recorded_threads,
    save_checkpoint,
    truncate_jsonl,
)
from alignzoo.engine.evaluate import evaluate
from alignzoo.engine.malloc import keep_freed_memory
from alignzoo.engine.mirror import restore_from_mirror
from alignzoo.engine.mirror import upload as mirror_upload
from alignzoo.engine.sinks import Sinks
from alignzoo.engine.step import peak_memory_mb, train_step
from alignzoo.engine.threads import current_threads, threads_set_to
from alignzoo.errors import UserError
from alignzoo.kernels import trace as decode_trace
from alignzoo.labeling import swap as labelswap
from alignzoo.runfolder import ATTEMPT_NOTE, CHECKPOINTS, RunFolder, RunStatus, write_atomic


class BetweenSteps(Protocol):
    """What runs before each training step besides the step (the iterated-RLHF rounds)."""

    def before_step(self, step: int) -> None: ...


RoundsFactory = Callable[[Any, Run, Callable[[str], None]], BetweenSteps]
"""(the arm's ``labeling.iterate``, the run, its log) -> the rounds: handed to :func:`run_one`."""


@dataclass
class RunSummary:
    """How a run ended."""

    status: RunStatus  # finished or failed
    error: str | None
    steps: int
    wall_clock_s: float
    tokens_per_s: float
    peak_memory_mb: float
    samples: int = 0


def resolved_config(loaded: LoadedExperiment, arm: str, seed: int) -> dict[str, Any]:
    """What config.yaml holds: experiment-level sections, the resolved arm and the seed."""
    spec = loaded.spec
    return {
        "experiment": spec.name,
        "arm": arm,
        "seed": seed,
        "source": loaded.source,
        "budget": spec.budget.model_dump(mode="json"),
        "data": spec.data.model_dump(mode="json"),
        "evaluation": spec.evaluation.model_dump(mode="json"),
        "logging": spec.logging.model_dump(mode="json"),
        "arm_spec": spec.arms[arm].model_dump(mode="json"),
    }


def write_status(
    out_dir: Path,
    status: RunStatus,
    state: TrainingState,
    error: str | None,
    device: str,
    stopped_early: str | None = None,
) -> None:
    """status.json, written atomically (``stopped_early``: why a finished run ended before its
    budget, under ``evaluation.stop_after_falls``)."""
    row = {
        "status": status,
        "error": error,
        "stopped_early": stopped_early,
        "step": state.step,
        "wall_clock_s": state.time_s,
        "tokens_per_s": state.tokens / state.time_s if state.time_s > 0 else 0.0,
        "peak_memory_mb": peak_memory_mb(device),
        "samples": state.samples,
    }
    write_atomic(RunFolder(out_dir).status, json.dumps(row, indent=2))


def budget_spent(budget: Budget, state: TrainingState) -> bool:
    """True once the run has used its budget (exactly one of steps, samples, wall-clock)."""
    if budget.steps is not None:
        return state.step >= budget.steps
    if budget.samples is not None:
        return state.samples >= budget.samples
    assert budget.wall_clock_s is not None
    return state.time_s >= budget.wall_clock_s


def fell_from_best(values: list[float], falls: int, higher: bool) -> str | None:
    """Why a run stops under ``evaluation.stop_after_falls``: its last ``falls`` evaluations
    were each worse than the best before them (None while that is not so)."""
    if len(values) <= falls:
        return None
    before = values[:-falls]
    best = max(before) if higher else min(before)
    if all((v < best) if higher else (v > best) for v in values[-falls:]):
        return f"worse than its best so far ({best:.4g}) for {falls} evaluations in a row"
    return None


def _evaluated(path: Path, key: str) -> dict[int, float]:
    """Step -> value of ``key`` in an eval.jsonl, in order (a resumed run's history)."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            step, value = int(row["step"]), row.get(key)
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[step] = float(value)
    return out


def _last_step(path: Path) -> int | None:
    if not path.exists():
        return None
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return int(json.loads(lines[-1])["step"]) if lines else None


BESIDE_CHECKPOINTS: dict[str, str] = {
    "*.jsonl": "the engine's and plugins' streams (metrics, eval, samples, swaps, rlhf_rounds, "
    "...): cut back to the checkpoint's step, the lines cut copied whole into attempts/<n>/",
    "control/": "labeler swap requests and applied.jsonl, the ledger of those the run took "
    "and before which step: kept; a resume takes each again before that same step",
    "rlhf/": "iterated-RLHF rounds (their pairs, judgements and reward models): kept; a round "
    "replayed after a resume reads its files back instead of asking or training again",
    "labels.sqlite": "the label store: kept, across restarts too (a label is a function of "
    "the labeler's identity and the sample, whichever attempt asked for it)",
    "checkpoint run.state": "in each checkpoint: the labeler and shadow in use, reward "
    "normalisation and drift baselines, the components' own state",
    "status.json, provenance.json, config.yaml": "rewritten by every attempt (provenance keeps "
    "one session per attempt)",
}
"""What a run keeps beside its checkpoints and how each is brought back to a checkpoint's step
on resume. A run that starts over from step 0 moves everything :func:`history_files` lists
into ``attempts/<n>/`` (the label store stays)."""


def history_files(out: Path) -> list[Path]:
    """What a run has written that an earlier attempt may have left and a run starting over
    must not reuse: every jsonl stream (the engine's and plugins'), error.log, the
    checkpoints, the labeler requests and their ledger (``control/``) and the iterated-RLHF
    rounds (``rlhf/``)."""
    folder = RunFolder(out)
    files = [*folder.streams(), folder.error_log, folder.checkpoints, folder.control, folder.rlhf]
    return [p for p in files if p.exists()]


def archive_attempt(out: Path) -> Path | None:
    """Move an earlier attempt's history (see :func:`history_files`) into
    ``attempts/<n>/`` of the run folder, so a run that starts over deletes nothing. Returns
    the folder it went to, or None when there was nothing to keep."""
    files = history_files(out)
    if not files:
        return None
    dest = _next_attempt(out)
    for path in files:
        os.replace(path, dest / path.name)
    note = {"kind": "restarted", "reason": "no usable checkpoint: the run started over",
            "files": [p.name for p in files]}  # fmt: skip
    (dest / ATTEMPT_NOTE).write_text(json.dumps(note, indent=1) + "\n", encoding="utf-8")
    return dest


def _next_attempt(out: Path) -> Path:
    root = RunFolder(out).attempts
    n = 1 + max((int(p.name) for p in root.glob("*") if p.name.isdigit()), default=0)
    dest = root / str(n)
    dest.mkdir(parents=True)
    return dest


def keep_cut_lines(out: Path, step: int, why: str) -> Path | None:
    """Before a resume cuts the jsonl streams back to ``step``: copy every stream that holds
    lines after it (or lines that are not a complete row) into ``attempts/<n>/`` whole, with
    ``attempt.json`` saying why, so nothing a run wrote is lost. Returns the folder, or None
    when no line would be cut."""
    streams = RunFolder(out).streams()
    cut = [path for path in streams if _lines_after(path, step)]
    if not cut:
        return None
    dest = _next_attempt(out)
    for path in cut:
        shutil.copy2(path, dest / path.name)
    note = {"kind": "resumed", "resumed_from_step": step, "reason": why,
            "files": [p.name for p in cut]}  # fmt: skip
    (dest / ATTEMPT_NOTE).write_text(json.dumps(note, indent=1) + "\n", encoding="utf-8")
    return dest


def _lines_after(path: Path, step: int) -> bool:
    """Whether ``path`` has a line that cutting back to ``step`` would drop."""
    for raw in path.read_bytes().splitlines():
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return bool(raw.strip())
        at = row.get("step") if isinstance(row, dict) else None
        if not isinstance(at, (int, float)) or isinstance(at, bool) or at > step:
            return True
    return False


def literal_log(console: Console | None) -> Callable[..., None]:
    """The run's log lines on ``console`` (nothing without one), printed as written: they carry
    outside text (exception messages, file names, labeler specs) that must never be read as
    rich markup (a ``[/path]`` in it would raise MarkupError and hide the message)."""
    if console is None:
        return lambda *_: None
    return functools.partial(console.log, markup=False)


def needs_critic(loaded: LoadedExperiment, arm: str) -> bool:
    """Whether the arm's algorithm trains a critic (so its checkpoints hold one)."""
    algorithm = loaded.components.get(arm, {}).get("algorithm")
    requirements = getattr(algorithm, "requirements", None)
    return bool(getattr(requirements, "critic", False))


def moving_reference(loaded: LoadedExperiment, arm: str) -> bool:
    """Whether the arm's reference moves (``training.sync_ref_model``: its checkpoints hold it)."""
    return loaded.spec.arms[arm].training.sync_ref_model


def resume_point(out: Path, critic: bool, reference: bool = False) -> ResumePoint:
    """Where a run in ``out`` would resume; raises :class:`UserError` when it has written
    checkpoints and none of them is usable (the run folder is not touched). ``critic``,
    ``reference``: the run's checkpoints hold a critic, a moving reference."""
    point = find_resume_point(RunFolder(out).checkpoints, critic, reference)
    if point.folder is None and point.unusable:
        reasons = "; ".join(f"{folder.name}: {why}" for folder, why in point.unusable)
        raise UserError(
            f"cannot resume {out}: no usable checkpoint ({reasons}). Nothing was changed; "
            "restore the checkpoint, or move the run folder away to start that run over."
        )
    return point


def start_or_resume(
    run: Run,
    resume: bool,
    log: Callable[[str], None] = lambda _: None,
    point: ResumePoint | None = None,
) -> TrainingState:
    """Load the newest usable checkpoint (and cut every jsonl stream back to it), or start.

    Nothing already written is deleted: a run that starts from step 0 in a folder where an
    earlier attempt left history (a run killed before its first checkpoint, or one that
    failed) has had that history moved into ``attempts/<n>/`` by :func:`run_one`, before the
    run was assembled (so what components write in ``on_run_start`` stays); a resume that
    cuts the streams back to its checkpoint first copies every stream it cuts into
    ``attempts/<n>/`` whole (:func:`keep_cut_lines`). With ``resume`` and checkpoints
    that are all unusable it raises :class:`UserError` and changes nothing; a newest
    checkpoint that is unusable is passed over for the previous one, saying so.
    """
    out = run.context.out_dir
    if point is None:  # ``point``: a resume point its caller found (and checked) already
        saved = (run.models.critic is not None, run.moving_reference is not None)
        point = resume_point(out, *saved) if resume else ResumePoint(None)
    for folder, why in point.unusable:
        log(f"checkpoint {folder} is unusable ({why}); resuming from an earlier one")
    if point.folder is None:  # run_one moved an earlier attempt's history aside already
        return TrainingState(sampler=run.sampler.state_dict())
    folder = point.folder
    learner = run.learner
    state = load_checkpoint(
        folder,
        run.models.actor,
        run.models.critic,
        learner.optimizer,
        learner.scheduler,
        run.stateful(),
        checked=True,  # find_resume_point read every file of it
        reference=run.moving_reference,
    )
    learner.version = state.policy_version
    run.sync_weights()  # the backend samples from the checkpoint's weights
    run.sampler.load_state_dict(state.sampler)
    run.context.state = dict(state.run_state)
    labelswap.restore(
        run.labeling, run.context, labeler_hooks
    )  # the labeler in use at the checkpoint
    run.context.step = state.step
    skipped = "; ".join(f"{folder.name} unusable: {why}" for folder, why in point.unusable)
    kept = keep_cut_lines(
        out, state.step, skipped or f"resumed from the checkpoint of step {state.step}"
    )
    if kept is not None:
        log(f"lines after step {state.step} are kept in {kept}")
    for path in RunFolder(out).streams():  # the engine's streams and every plugin's
        truncate_jsonl(path, state.step)
    return state


class _Loop:
    """The loop of one run: steps, evaluations and checkpoints on schedule."""

    def __init__(
        self, run: Run, state: TrainingState, sinks: Sinks, rounds: RoundsFactory | None = None
    ) -> None:
        self.run, self.state, self.sinks = run, state, sinks
        console = run.context.console
        self.log: Callable[[str], None] = literal_log(console)
        self.base_time = state.time_s
        self.clock_start = time.monotonic()
        self.last_eval = _last_step(RunFolder(run.context.out_dir).eval)
        self.last_ckpt = state.step if state.step > 0 else None
        run.labeling.attach(run.context)  # its normalisation state is checkpointed with the run
        evaluation = run.spec.evaluation
        self.metric = canonical.evaluation_key(evaluation.metric)
        self.higher = (
            evaluation.higher_is_better
            if evaluation.higher_is_better is not None
            else canonical.higher_is_better(self.metric)
        )
        self.evaluated = _evaluated(RunFolder(run.context.out_dir).eval, self.metric)
        self.stopped_early: str | None = None
        self.mirror = run.mirror
        self.mirror_failures = 0
        self.rounds: BetweenSteps | None = None  # iterated RLHF (labeling.iterate)
        if run.arm.labeling.iterate is not None:
            if rounds is None:
                raise UserError(
                    f"arms.{run.context.arm}.labeling.iterate: this run was started without the "
                    "iterated-RLHF rounds (run_one(..., rounds=alignzoo.human.iterate.Rounds), "
                    "as `alignzoo run` does)"
                )
            self.rounds = rounds(run.arm.labeling.iterate, run, self.log)

    def tick(self) -> None:
        self.state.time_s = self.base_time + (time.monotonic() - self.clock_start)

    def evaluate(self) -> None:
        if not distributed.is_main():  # rank 0 evaluates for the group
            self.last_eval = self.state.step
            return
        cfg = self.run.spec.evaluation
        sampling = self.run.arm.training.sampling
        max_new = cfg.max_new_tokens or sampling.max_new_tokens
        metrics = evaluate(
            self.run.hooks,
            self.run.eval_rows,
            max_new,
            cfg.pass_at_k,
            sampling,
            labeling=self.run.evaluation_labeling,
            step=self.state.step,
            pass_at_k_samples=cfg.pass_at_k_samples,
            episodes=self.run.episodes,
        )
        self.tick()
        row = {"step": self.state.step, "time_s": self.state.time_s, "samples": self.state.samples}
        self.sinks.evaluation({**row, **metrics})
        self.last_eval = self.state.step
        value = metrics.get(self.metric)
        if isinstance(value, (int, float)):
            self.evaluated[self.state.step] = float(value)

    def best_checkpoint_step(self) -> int | None:
        """The step of the best evaluation at a checkpoint kept so far or saved now (the
        earliest of equals): pruning keeps it, so ``export --step best`` and the report's
        ``compare_at: best_checkpoint`` can reach a peak that lies many checkpoints back."""
        steps = {
            self.state.step,
            *complete_checkpoints(RunFolder(self.run.context.out_dir).checkpoints),
        }
        scored = [(v if self.higher else -v, -s) for s, v in self.evaluated.items() if s in steps]
        return -max(scored)[1] if scored else None

    def stop_rule(self) -> bool:
        """Whether ``evaluation.stop_after_falls`` ends the run now (rank 0 decides for every
        rank, as it alone evaluates); sets :attr:`stopped_early`."""
        falls = self.run.spec.evaluation.stop_after_falls
        if falls is None:
            return False
        history = list(self.evaluated.values())
        why = fell_from_best(history, falls, self.higher) if distributed.is_main() else None
        why = distributed.broadcast_object(why)
        if why is not None:
            self.stopped_early = f"stopped early at step {self.state.step}: {self.metric} {why}"
            self.log(self.stopped_early)
        return why is not None

    def checkpoint(self) -> None:
        run = self.run
        self.tick()
        gathered = None
        if run.learner.sharded:  # every rank gives its shards; rank 0 holds the full state
            learner = run.learner
            gathered = gather_sharded(run.models.actor, run.models.critic, learner.optimizer)
        if not distributed.is_main():  # the weights are the same on every rank: rank 0 saves
            self.last_ckpt = self.state.step
            return
        self.state.sampler = run.sampler.state_dict()
        self.state.run_state = dict(run.context.state)
        self.state.policy_version = run.learner.version
        saved = save_checkpoint(
            RunFolder(run.context.out_dir).checkpoints,
            self.state,
            run.models.actor,
            run.models.critic,
            run.learner.optimizer,
            run.learner.scheduler,
            run.stateful(),
            gathered,
            keep_step=self.best_checkpoint_step(),
            reference=run.moving_reference,
        )
        if self.mirror is not None:
            self.copy_to_mirror(saved)
        self.last_ckpt = self.state.step
        device = run.models.device("actor")
        write_status(run.context.out_dir, RunStatus.RUNNING, self.state, None, device)

    def copy_to_mirror(self, saved: Path) -> None:
        """The checkpoint just saved, copied to the mirror (its manifest last); a failure is
        logged and counted (``checkpoint/mirror_failures``), training goes on."""
        assert self.mirror is not None
        kept = {p.name for p in complete_checkpoints(saved.parent).values()}
        try:
            mirror_upload(self.mirror, saved, kept)
        except Exception as exc:  # the store unreachable, a quota: the local copy stands
            self.mirror_failures += 1
            self.log(f"checkpoint {saved.name} was not mirrored to {self.mirror.url}: {exc}")

    def spent(self) -> bool:
        """Whether the budget is used up; for a wall-clock budget rank 0's clock decides for
        every data-parallel rank (so all of them stop after the same step)."""
        spent = budget_spent(self.run.spec.budget, self.state)
        if self.run.spec.budget.wall_clock_s is not None:
            spent = distributed.broadcast_object(spent)
        return spent

    def mirror_resume_point(self) -> None:
        """A resumed run's checkpoint copied to the mirror when the mirror lacks it (a kill
        between the local checkpoint and its upload; at the final step nothing else would)."""
        folder = RunFolder(self.run.context.out_dir).checkpoints / checkpoint_name(self.state.step)
        if self.mirror is None or self.state.step == 0 or not folder.is_dir():
            return
        try:
            mirrored = self.state.step in self.mirror.complete()
        except Exception as exc:  # the store unreachable: the next checkpoint tries again
            self.log(f"checkpoint mirror {self.mirror.url} could not be listed: {exc}")
            return
        if not mirrored:
            self.log(f"checkpoint {folder.name} is not in the mirror yet; copying it")
            self.copy_to_mirror(folder)

    def loop(self) -> None:
        run, spec = self.run, self.run.spec
        self.mirror_resume_point()
        if self.state.step == 0 and self.last_eval is None:
            self.evaluate()
        while not self.spent():
            step = self.state.step + 1
            run.context.step = step
            if self.rounds is not None:  # a round may request a swap of the reward model
                self.rounds.before_step(step)
            labelswap.poll(
                run.labeling, run.context, labeler_hooks, self.log
            )  # a swap between steps
            report = train_step(run, step)
            self.state.step = step
            self.state.samples += report.samples
            self.state.tokens += report.tokens
            self.tick()
            row = {"step": step, "time_s": self.state.time_s, "samples": self.state.samples}
            row.update(report.metrics)
            if self.mirror is not None:  # copies that failed so far (the local ones stand)
                row["checkpoint/mirror_failures"] = float(self.mirror_failures)
            run.hooks.on_step_end(run.context, step, row)
            self.sinks.step(row, step)
            self.sinks.samples(report.sample_rows)
            stop = False
            if step % spec.evaluation.every == 0:
                self.evaluate()
                stop = self.stop_rule()
            if step % run.arm.training.checkpoint_every == 0:
                self.checkpoint()
            if stop:
                break
        if self.last_eval != self.state.step:
            self.evaluate()
        if self.last_ckpt != self.state.step:
            self.checkpoint()


def run_one(
    loaded: LoadedExperiment,
    arm: str,
    seed: int,
    out_dir: Path,
    resume: bool = False,
    console: Console | None = None,
    resume_from: Path | None = None,
    rounds: RoundsFactory | None = None,
) -> RunSummary:
    """Train ``arm`` with ``seed`` into ``out_dir`` (resuming from its checkpoint if asked).

    ``rounds`` builds the iterated-RLHF rounds of an arm that sets ``labeling.iterate``
    (:class:`alignzoo.human.iterate.Rounds`, which the experiment runner passes): the engine
    does not import the human-feedback package, which is built on it.

    ``resume_from``: the run folder whose checkpoints a resume reads (default ``out_dir``);
    the data-parallel ranks other than 0 write scratch folders and resume from rank 0's.

    Raises :class:`UserError`, before writing anything, when ``resume`` is asked for and the
    run's checkpoints are all unusable.
    """
    out_dir = Path(out_dir)
    # Checked before anything is written, and reused by start_or_resume.
    source = Path(resume_from) if resume_from is not None else out_dir
    log = literal_log(console)
    if resume:  # a run folder without a checkpoint gets the mirror's newest, if it has one
        restore_from_mirror(loaded, arm, seed, RunFolder(source).checkpoints, log)
    saved = (needs_critic(loaded, arm), moving_reference(loaded, arm))
    point = resume_point(source, *saved) if resume else ResumePoint(None)
    if point.folder is not None and resume_from is None:  # the pointer first (a kill between
        before = point_latest_at(point.folder)  # a checkpoint's rename and its pointer)
        if before is not None:
            log(f"{CHECKPOINTS}/latest named {before}; it now names {point.folder.name}, the "
                "checkpoint this run resumes from")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    if point.folder is None:  # before on_run_start, so what plugins write there stays
        kept = archive_attempt(out_dir)
        if kept is not None:
            log(f"{out_dir}: no checkpoint to resume from; the earlier attempt is kept in {kept}")
    config = resolved_config(loaded, arm, seed)
    write_atomic(RunFolder(out_dir).config, yaml.safe_dump(config, sort_keys=False))
    # The run's thread count is a setting: a resume trains with the count its checkpoint
    # records, wherever and beside however many runs it now trains.
    with threads_set_to(resume_threads(point, log)):
        try:
            return _train(loaded, arm, seed, out_dir, resume, console, point, config, log, rounds)
        finally:  # a step that failed between sampling and update leaves one
            decode_trace.release()


def resume_threads(point: ResumePoint, log: Callable[[str], None]) -> int | None:
    """The thread count a run resuming from ``point`` trains with: the one its checkpoint
    records (None for a run that starts, or a checkpoint that records none: as they are)."""
    if point.folder is None:
        return None
    threads = recorded_threads(point.folder)
    now = current_threads()
    if threads is None:
        log(f"checkpoint {point.folder.name} records no thread count (written before alignzoo "
            f"kept it); resuming with this process's {now}, which may change the last digits")  # fmt: skip
    elif threads != now:
        log(f"resuming with {threads} thread(s), the count checkpoint {point.folder.name} "
            f"records (this process has {now})")  # fmt: skip
    return threads


def _train(
    loaded: LoadedExperiment,
    arm: str,
    seed: int,
    out_dir: Path,
    resume: bool,
    console: Console | None,
    point: ResumePoint,
    config: dict[str, Any],
    log: Callable[[str], None],
    rounds: RoundsFactory | None = None,
) -> RunSummary:
    """:func:`run_one` from assembling the run to its status: never raises for a failure of
    the run itself."""
    state = TrainingState()
    stopped_early: str | None = None
    run: Run | None = None
    device = "cpu"
    session = provenance.collect(loaded.source)
    recorded = False
    try:
        run = assemble(loaded, arm, seed, out_dir, console=console, log=log)
        device = run.models.device("actor")
        if device == "cpu" and run.arm.training.reuse_cpu_memory:
            keep_freed_memory()  # before the first step: its activations are then reused
        session.update(provenance.policy_fields(run.models.policy_path))
        session.update(provenance.component_fields(run.components))
        provenance.record(out_dir, session, resume)
        recorded = True
        state = start_or_resume(run, resume, log, point)
        write_status(out_dir, RunStatus.RUNNING, state, None, device)
        loop = _Loop(run, state, run.open_sinks(config), rounds)
        loop.loop()
        status, error, stopped_early = RunStatus.FINISHED, None, loop.stopped_early
    except Exception as exc:
        status, error = RunStatus.FAILED, f"{type(exc).__name__}: {exc}"
        if not recorded:  # even a run that could not start says what it ran on
            provenance.record(out_dir, session, resume)
        with open(RunFolder(out_dir).error_log, "a", encoding="utf-8") as handle:  # every attempt's
            handle.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {error}\n")
            handle.write(traceback.format_exc())
        if console is not None:
            # The error's text is shown as written: never read as markup (a gloo error's
            # "[/path/pair.cc:537]" would otherwise raise MarkupError and hide it).
            console.print(f"{out_dir}: run failed: {error}", style="red", markup=False)
    except BaseException:  # interrupted (Ctrl-C, an exit): the run ends with what it holds
        if run is not None:
            run.close(RunStatus.INTERRUPTED)
        raise
    if run is not None:
        try:
            run.close(status)
        except Exception as exc:  # a failure at the end must not hide the run's result
            if status is RunStatus.FINISHED:
                status, error = RunStatus.FAILED, f"closing the run: {type(exc).__name__}: {exc}"
    write_status(out_dir, status, state, error, device, stopped_early)
    return RunSummary(
        status=status,
        error=error,
        steps=state.step,
        wall_clock_s=state.time_s,
        tokens_per_s=state.tokens / state.time_s if state.time_s > 0 else 0.0,
        peak_memory_mb=peak_memory_mb(device),
        samples=state.samples,
    )
