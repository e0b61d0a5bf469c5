"""Data parallelism over torch.distributed: which process this is, and the reductions the engine
needs so that N processes train exactly as one process with the same global batch.

Launched by ``torchrun --nproc-per-node N -m alignzoo run EXP.yaml`` (or any launcher that sets
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``): :func:`init_from_env` joins the
process group (gloo on CPU, NCCL on GPUs). Every rank then runs the same runs in the same order:

- each training step's prompts (or offline rows) are split into contiguous shards, one per rank
  (:func:`shard`); every prompt's samples come from its own seeded generator, so a prompt gets
  the same responses whichever rank samples it;
- the loss is normalised by the optimizer step's *global* token, sequence and group counts, and
  the actor (and critic) are wrapped in ``DistributedDataParallel`` or, with
  ``training.parallel: fsdp2``, sharded with ``fully_shard``; either averages the gradients,
  which are scaled back to the sum of the ranks' shares: the gradient of the whole global batch;
- batch statistics (advantage whitening, KTO's reference point, PPO's observed KL) are reduced
  over ranks (:func:`all_sum`), and the step's metrics too (:func:`reduce_metrics`);
- only rank 0 writes the run's files, evaluates and talks to the sinks; the other ranks keep
  their scratch files in ``<out>/.ranks/rank-<r>/``, removed when the experiment ends;
- decisions every rank must take alike (which runs to resume, whether a wall-clock budget is
  spent) are rank 0's, broadcast (:func:`broadcast_object`).

In one process every function here is the identity.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

# Step metrics that are counts: summed over ranks (everything else is averaged).
SUMMED_PREFIXES = ("label/", "batch/")
SUMMED_KEYS = ("loss",)


def _dist() -> Any:
    # ``import torch`` first: torch may sit in sys.modules as a lazily loaded module
    # (alignzoo.lazy_import), and importing a submodule of a lazy parent runs the submodule
    # twice (torch's own import loads torch.distributed too), which aborts the process.
    import torch

    return torch.distributed


def active() -> bool:
    """True when this process is one of several in an initialised process group."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 in a single process)."""
    return _dist().get_rank() if active() else 0


def world_size() -> int:
    """The number of processes (1 in a single process)."""
    return _dist().get_world_size() if active() else 1


def is_main() -> bool:
    """Rank 0: the process that writes files, evaluates and talks to the sinks."""
    return rank() == 0


def launched() -> bool:
    """The environment asks for several processes (``WORLD_SIZE`` > 1, as torchrun sets it)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


COLLECTIVE_TIMEOUT_ENV = "ALIGNZOO_COLLECTIVE_TIMEOUT_S"
"""How long a rank waits in a collective (a step's reductions, rank 0's evaluation and
checkpoint, the resume check) for the others before the run fails; default 1800 s, torch's."""


def collective_timeout() -> Any:
    """The process group's timeout: ``ALIGNZOO_COLLECTIVE_TIMEOUT_S`` seconds (default 1800).
    A rank that stops answering (hung in user code, a lost node torchrun did not notice) then
    fails every rank after that long instead of holding the group forever; keep it above the
    longest evaluation, during which the other ranks wait."""
    from datetime import timedelta

    from alignzoo.errors import UserError

    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "1800")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UserError(f"{COLLECTIVE_TIMEOUT_ENV}={raw!r}: expected a number of seconds above 0")
    return timedelta(seconds=seconds)


def init_from_env() -> bool:
    """Join the process group torchrun describes (gloo on CPU, NCCL when this rank has a GPU);
    returns True when this is one of several processes."""
    if not launched():
        return False
    dist = _dist()
    if not dist.is_initialized():
        import torch

        local = int(os.environ.get("LOCAL_RANK", "0"))
        gpu = torch.cuda.is_available() and torch.cuda.device_count() > local
        if gpu:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if gpu else "gloo", timeout=collective_timeout())
    return active()


def shutdown() -> None:
    """Leave the process group, if this process joined one: called on every exit path of the
    command line (finished, refused, failed), so that no rank's gloo or NCCL threads outlive
    the interpreter (which would abort the process: SIGABRT, "terminate called without an
    active exception", in place of its own exit code)."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        import contextlib

        with contextlib.suppress(Exception):  # a peer already gone: leaving is all that is left
            dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if active():
        _dist().barrier()


def shard(items: Sequence[T]) -> list[T]:
    """This rank's contiguous share of ``items`` (all of them in one process).

    The global batch must divide evenly (checked when the run is assembled), so every rank
    trains on the same number of rows and the shards, concatenated in rank order, are ``items``.
    """
    items = list(items)
    size = world_size()
    if size == 1:
        return items
    if len(items) % size:
        raise ValueError(f"{len(items)} items do not split evenly over {size} processes")
    per = len(items) // size
    start = rank() * per
    return items[start : start + per]


def all_sum(tensor: Any) -> Any:
    """The element-wise sum of ``tensor`` over ranks (``tensor`` itself in one process)."""
    if not active():
        return tensor
    out = tensor.detach().clone()
    _dist().all_reduce(out)
    return out


def all_max(value: float) -> float:
    """The largest ``value`` over ranks (``value`` itself in one process)."""
    if not active():
        return value
    import torch

    out = torch.tensor([float(value)], dtype=torch.float64)
    _dist().all_reduce(out, op=_dist().ReduceOp.MAX)
    return float(out[0])


def all_equal(value: int, what: str) -> None:
    """Raise a RuntimeError naming ``what`` when ranks disagree on ``value`` (which would make
    their collective calls mismatch and hang)."""
    if not active():
        return
    import torch

    pair = torch.tensor([value, -value], dtype=torch.long)
    _dist().all_reduce(pair, op=_dist().ReduceOp.MAX)
    if int(pair[0]) != -int(pair[1]):
        raise RuntimeError(
            f"the {world_size()} processes disagree on {what} ({-int(pair[1])} to {int(pair[0])}); "
            "data parallel training needs the same on every rank"
        )


def all_concat(items: Sequence[T]) -> list[T]:
    """Every rank's ``items``, concatenated in rank order (``items`` in one process): the
    inverse of :func:`shard`, for state every rank must compute from the whole step's data."""
    if not active():
        return list(items)
    gathered: list[list[T] | None] = [None] * world_size()
    _dist().all_gather_object(gathered, list(items))
    return [item for part in gathered for item in (part or [])]


def all_gather_object(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (``[value]`` in one process)."""
    if not active():
        return [value]
    gathered: list[T | None] = [None] * world_size()
    _dist().all_gather_object(gathered, value)
    return gathered  # type: ignore[return-value]


def broadcast_object(value: T) -> T:
    """Rank 0's ``value`` on every rank (``value`` itself in one process): for decisions every
    rank must take alike, such as which runs to resume or whether a wall-clock budget is spent."""
    if not active():
        return value
    box = [value]
    _dist().broadcast_object_list(box, src=0)
    return box[0]


def scatter_object(values: list[T] | None) -> T:
    """Rank 0's ``values[r]`` on rank r (``values[0]`` in one process); the other ranks pass
    None."""
    if not active():
        assert values is not None
        return values[0]
    box: list[T | None] = [None]
    _dist().scatter_object_list(box, values if is_main() else None, src=0)
    return box[0]  # type: ignore[return-value]


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """One step's metrics over all ranks: counts summed, everything else averaged."""
    if not active():
        return metrics
    gathered: list[dict[str, float] | None] = [None] * world_size()
    _dist().all_gather_object(gathered, metrics)
    keys = sorted({key for part in gathered if part for key in part})
    out: dict[str, float] = {}
    for key in keys:
        values = [float(part[key]) for part in gathered if part and key in part]
        summed = key in SUMMED_KEYS or key.startswith(SUMMED_PREFIXES)
        out[key] = sum(values) if summed else sum(values) / len(values)
    return out
