"""Run one arm in a child process that SIGKILLs itself at a chosen point (the kill-at-random-
points test).

Usage: python -m tests.core.engine._kill_worker

It imports torch, transformers and alignzoo once, then reads one job per stdin line (JSON:
experiment, arm, seed, out, resume, kill_at, log) and runs each in a child forked for it (a
fresh process as far as the run is concerned: it dies by SIGKILL on its own, and its files are
all that is left), writing the child's exit status (``-9``: killed) as one line on stdout. The
parent runs no torch op, so no thread pool exists when it forks. ``kill_at`` is
``<step>:<phase>`` (or null: run to the end). Phases:

- ``label``: inside the labeler call of training step <step> (before its first call);
- ``label-2``: the same, before the step's second labeler call (after the first returned);
- ``eval``: inside the evaluation after step <step>;
- ``metrics``: right after step <step>'s metrics line is written;
- ``ckpt-actor``: while writing the checkpoint of step <step>, after actor.safetensors;
- ``ckpt-trainer``: the same, after trainer.pt;
- ``ckpt-latest``: after the checkpoint folder is renamed into place, before ``latest``;
- ``ckpt-saved``: after ``latest`` names it, before it is mirrored and status.json rewritten;
- ``rlhf-retrain``: in the iterated-RLHF round before step <step>, once its reward model is
  trained (before its swap is requested);
- ``rlhf-request``: the same, once the swap is requested (before the run takes it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from alignzoo.config.loader import load_experiment
from alignzoo.engine import checkpoint, loop, sinks
from alignzoo.human import iterate
from alignzoo.labeling import callers as labeling
from alignzoo.labeling import swap

_where: dict[str, Any] = {"step": 0, "saving": None, "calls": 0, "round": None}
_kill: dict[str, Any] = {"step": -1, "phase": ""}  # set in each forked child


def _maybe_die(phase: str, step: int) -> None:
    if phase == _kill["phase"] and step == _kill["step"]:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _wrap(owner: Any, name: str, before: Any = None, after: Any = None) -> None:
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(*args, **kwargs)
        return result

    setattr(owner, name, wrapped)


def _install() -> None:
    def at_step(run: Any, step: int) -> None:
        _where["step"], _where["calls"] = step, 0

    def before_call(*args: Any, **kwargs: Any) -> None:
        _where["calls"] += 1
        _maybe_die("label" if _where["calls"] == 1 else f"label-{_where['calls']}", _where["step"])

    _wrap(loop, "train_step", before=at_step)
    _wrap(
        labeling.InlineCaller,
        "__call__",
        before=before_call,
    )
    _wrap(loop, "evaluate", before=lambda *a, **k: _maybe_die("eval", _where["step"]))
    _wrap(sinks.Sinks, "step", after=lambda self, metrics, step: _maybe_die("metrics", step))

    def saving(ckpt_dir: Any, state: Any, *args: Any, **kwargs: Any) -> None:
        _where["saving"] = state.step

    _wrap(
        checkpoint,
        "save_checkpoint",
        before=saving,
        after=lambda *a, **k: _maybe_die("ckpt-saved", _where["saving"]),
    )
    loop.save_checkpoint = checkpoint.save_checkpoint

    def after_save_model(model: Any, path: str, *args: Any, **kwargs: Any) -> None:
        if path.endswith("actor.safetensors"):
            _maybe_die("ckpt-actor", _where["saving"])

    _wrap(checkpoint, "save_model", after=after_save_model)
    _wrap(
        checkpoint.torch,
        "save",
        after=lambda obj, path, *a, **k: _maybe_die("ckpt-trainer", _where["saving"]),
    )

    def before_latest(path: Path, text: str) -> None:
        if path.name == checkpoint.LATEST:
            _maybe_die("ckpt-latest", _where["saving"])

    _wrap(checkpoint, "write_atomic", before=before_latest)

    def before_round(self: Any, k: int, step: int) -> None:
        _where["round"] = step + 1  # the round runs before this step

    _wrap(iterate.Rounds, "round", before=before_round)
    _wrap(
        iterate.Rounds,
        "_retrain",
        after=lambda *a, **k: _maybe_die("rlhf-retrain", _where["round"]),
    )
    _wrap(swap, "write_request", after=lambda *a, **k: _maybe_die("rlhf-request", _where["round"]))


def _run(job: dict[str, Any]) -> int:
    """The child: its output to the job's log, then the run; its exit code."""
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if job["kill_at"]:
        step, phase = job["kill_at"].split(":")
        _kill.update(step=int(step), phase=phase)
    try:
        loaded = load_experiment(job["experiment"])
        out = Path(job["out"])
        summary = loop.run_one(
            loaded, job["arm"], int(job["seed"]), out, resume=job["resume"], rounds=iterate.Rounds
        )
        print(summary, flush=True)
        return 0 if summary.status == "finished" else 1
    except BaseException:
        traceback.print_exc()
        return 2


def serve() -> None:
    _install()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = _run(job)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    serve()
