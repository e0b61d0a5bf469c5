"""Run one arm in a child process that SIGKILLs itself at a chosen point (the kill-at-random-
points test).

Usage: python -m tests.core.engine._kill_worker EXPERIMENT.yaml ARM SEED OUT_DIR RESUME(0|1)
with ``ALIGNZOO_KILL_AT=<step>:<phase>`` (or unset: run to the end). Phases:

- ``label``: inside the labeler call of training step <step> (before its first call);
- ``label-2``: the same, before the step's second labeler call (after the first returned);
- ``eval``: inside the evaluation after step <step>;
- ``metrics``: right after step <step>'s metrics line is written;
- ``ckpt-actor``: while writing the checkpoint of step <step>, after actor.safetensors;
- ``ckpt-trainer``: the same, after trainer.pt;
- ``ckpt-latest``: after the checkpoint folder is renamed into place, before ``latest``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from alignzoo.config.loader import load_experiment
from alignzoo.engine import checkpoint, labeling, loop, sinks

_where: dict[str, Any] = {"step": 0, "saving": None, "calls": 0}
_target = os.environ.get("ALIGNZOO_KILL_AT")
_kill_step, _kill_phase = (
    (int(_target.split(":")[0]), _target.split(":")[1]) if _target else (-1, "")
)


def _maybe_die(phase: str, step: int) -> None:
    if phase == _kill_phase and step == _kill_step:
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

    _wrap(checkpoint, "save_checkpoint", before=saving)
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

    _wrap(checkpoint, "_write_text_atomic", before=before_latest)


if __name__ == "__main__":
    _install()
    path, arm, seed, out, resume = sys.argv[1:6]
    summary = loop.run_one(load_experiment(path), arm, int(seed), Path(out), resume=resume == "1")
    print(summary)
    sys.exit(0 if summary.status == "finished" else 1)
