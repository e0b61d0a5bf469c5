"""One run's folder, ``<out>/<arm>/seed-<n>/``: the name of everything the engine, its
components and the runner write there (:class:`RunFolder`), the statuses ``status.json``
records (:class:`RunStatus`), and :func:`write_atomic`, the one way a file of a run or an
experiment is replaced whole. :mod:`alignzoo.runfolder.runfiles` reads experiment folders as
the runner and the report see them. The package sits below the engine, the runner, labeling and
the report, which all read or write run folders; it imports only the package root and
:mod:`alignzoo.config`.

What a run folder holds::

    status.json        how the run stands (RunStatus), its step, clocks and error
    config.yaml        the resolved arm and seed the run trained
    provenance.json    one session per attempt: code, environment, weights
    metrics.jsonl      one row per step
    eval.jsonl         one row per evaluation
    samples.jsonl      sampled responses
    <stream>.jsonl     a component's own stream (swaps, health, rlhf_rounds, labels_slowest, ...)
    error.log          every failed attempt's traceback
    labels.sqlite      the label store
    checkpoints/       step-<n>/ folders and the ``latest`` pointer
    attempts/<n>/      what an earlier attempt wrote (attempt.json says why)
    control/           labeler swap requests (labeler.yaml) and their ledger (applied.jsonl)
    rlhf/              iterated-RLHF rounds
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

STATUS = "status.json"
CONFIG = "config.yaml"
PROVENANCE = "provenance.json"
METRICS = "metrics.jsonl"
EVAL = "eval.jsonl"
SAMPLES = "samples.jsonl"
ERROR_LOG = "error.log"
LABELS = "labels.sqlite"
CHECKPOINTS = "checkpoints"
ATTEMPTS = "attempts"
ATTEMPT_NOTE = "attempt.json"
"""What an ``attempts/<n>/`` folder holds and why (written beside the files kept there)."""
CONTROL = "control"
RLHF = "rlhf"

SEED_FOLDER = re.compile(r"^seed-(-?\d+)$")
"""The name of a run folder inside its arm's folder; group 1 is the seed."""


class RunStatus(str, Enum):
    """How a run stands: the ``"status"`` of its status.json (the same strings on disk), of
    :class:`~alignzoo.engine.loop.RunSummary` and of the runner's results."""

    RUNNING = "running"
    """Training, or stopped without saying so (killed, interrupted): a resume continues it."""
    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    """Ended by an interrupt (Ctrl-C, an exit): what ``on_run_end`` hears; status.json keeps
    saying running."""
    PENDING = "pending"
    """Not started: a folder with no status.json and no metrics, as the report reads it."""

    def __str__(self) -> str:
        return self.value


def seed_folder(seed: int) -> str:
    """The folder name of seed ``seed``'s run inside its arm's folder."""
    return f"seed-{seed}"


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder (see the module's layout); it reads and writes nothing."""

    path: Path

    @classmethod
    def of(cls, out: Path, arm: str, seed: int) -> RunFolder:
        """The folder of ``arm`` with ``seed`` in the experiment folder ``out``."""
        return cls(Path(out) / arm / seed_folder(seed))

    @property
    def status(self) -> Path:
        return self.path / STATUS

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def provenance(self) -> Path:
        return self.path / PROVENANCE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def eval(self) -> Path:
        return self.path / EVAL

    @property
    def samples(self) -> Path:
        return self.path / SAMPLES

    @property
    def error_log(self) -> Path:
        return self.path / ERROR_LOG

    @property
    def labels(self) -> Path:
        return self.path / LABELS

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def attempts(self) -> Path:
        return self.path / ATTEMPTS

    @property
    def control(self) -> Path:
        return self.path / CONTROL

    @property
    def rlhf(self) -> Path:
        return self.path / RLHF

    def stream(self, name: str) -> Path:
        """The jsonl file of stream ``name`` (the engine's metrics, eval and samples, and each
        component's own)."""
        return self.path / f"{name}.jsonl"

    def streams(self) -> list[Path]:
        """Every jsonl stream the folder holds, by name."""
        return sorted(self.path.glob("*.jsonl"))


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (text as UTF-8) so that a reader, or a run after a crash
    at any moment, sees the old file whole or the new one whole: written to ``.<name>.tmp``
    beside it, flushed and fsynced, renamed over ``path``, then the folder fsynced so the
    rename itself survives a power loss."""
    tmp = path.with_name(f".{path.name}.tmp")
    if isinstance(data, str):
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    else:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (a rename into it) durable; a platform that cannot
    open a folder skips it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
