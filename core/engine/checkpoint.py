"""Checkpoints: written atomically, kept two deep, read back without unpickling anything.

Layout of ``checkpoints/step-000010/``:
    actor.safetensors, critic.safetensors   model weights (a LoRA actor: only its adapters;
                                            the frozen base is the starting policy)
    reference.safetensors                   a moving reference's weights
                                            (``training.sync_ref_model``: they are no longer
                                            the starting policy's)
    trainer.pt                              optimizer, scheduler, torch RNG, components' state
                                            (read only with ``torch.load(weights_only=True)``)
    state.json                              step, samples, time_s, sampler cursor, run.state,
                                            python and numpy RNG states, the thread count
                                            the run trains with (kept across resumes:
                                            :mod:`alignzoo.engine.threads`) and the policy version
                                            (the optimizer steps taken)
``checkpoints/latest`` names the newest complete folder. A folder is written under a temporary
name and renamed into place; ``latest`` is written to a temporary file and renamed too, so a
kill at any moment leaves the previous checkpoint readable. A kill between the two renames
leaves ``latest`` one checkpoint behind: the next resume rewrites it to name the checkpoint it
resumes from (:func:`point_latest_at`) before anything else, and a run always checkpoints its
final step, so a finished run's ``latest`` names the step its status.json reports.

FSDP2-sharded models (``training.parallel: fsdp2``) are gathered into the same files through
torch.distributed.checkpoint's state-dict API (:func:`gather_sharded`, every rank takes part,
rank 0 writes), and loaded back by every rank into its shards: one layout for every
strategy, so a checkpoint resumes with any number of processes and exports like any other.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from alignzoo.plugin import Stateful
from alignzoo.runfolder import fsync_dir, write_atomic
from alignzoo.weights import is_sharded

KEEP = 2
LATEST = "latest"
REFERENCE_FILE = "reference.safetensors"


@dataclass
class TrainingState:
    """What the loop carries between steps, besides models and optimizer."""

    step: int = 0
    samples: int = 0
    time_s: float = 0.0
    tokens: int = 0
    sampler: dict[str, int] = field(default_factory=dict)
    run_state: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0  # the learner's optimizer steps (Learner.version)


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(
    ckpt_dir: Path,
    state: TrainingState,
    actor: Any,
    critic: Any | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    components: dict[str, Any],
    gathered: GatheredState | None = None,
    keep_step: int | None = None,
    reference: Any | None = None,
) -> Path:
    """Write checkpoint ``step-<n>`` atomically, point ``latest`` at it, keep the last two
    (and the one of ``keep_step``: the best evaluated so far, for ``export --step best``).

    ``gathered``: the full weights and optimizer state of sharded models (from
    :func:`gather_sharded`), written in place of the modules' own. ``reference``: a moving
    reference (``training.sync_ref_model``), whose weights are saved too (it is never sharded:
    every rank holds it whole)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(state.step)
    final = ckpt_dir / name
    tmp = ckpt_dir / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if gathered is not None:
        save_file(gathered.actor, str(tmp / "actor.safetensors"), metadata={"format": "pt"})
        if gathered.critic is not None:
            save_file(gathered.critic, str(tmp / "critic.safetensors"), metadata={"format": "pt"})
    else:
        save_actor(actor, tmp / "actor.safetensors")
        if critic is not None:
            save_model(critic, str(tmp / "critic.safetensors"))
    if reference is not None:
        save_model(reference, str(tmp / REFERENCE_FILE))
    trainer = {
        "optimizer": gathered.optimizer if gathered is not None else optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "components": {
            slot: c.state_dict() for slot, c in components.items() if isinstance(c, Stateful)
        },
    }
    if torch.cuda.is_available():
        trainer["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(trainer, tmp / "trainer.pt")
    meta = {
        "step": state.step,
        "samples": state.samples,
        "time_s": state.time_s,
        "tokens": state.tokens,
        "sampler": state.sampler,
        "run_state": state.run_state,
        "rng": _rng_state(),
        "threads": torch.get_num_threads(),
        "policy_version": state.policy_version,
    }
    (tmp / "state.json").write_text(json.dumps(meta), encoding="utf-8")
    for f in tmp.iterdir():
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # the same step saved again (a resumed run): move the old one aside
        old = ckpt_dir / f".old-{name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(ckpt_dir)
    write_atomic(ckpt_dir / LATEST, name + "\n")
    _prune(ckpt_dir, keep={name, *([] if keep_step is None else [checkpoint_name(keep_step)])})
    return final


def checkpoint_name(step: int) -> str:
    """The folder name of step ``step``'s checkpoint."""
    return f"step-{step:06d}"


def complete_checkpoints(ckpt_dir: Path) -> dict[int, Path]:
    """Step -> folder of every complete checkpoint of ``ckpt_dir`` (a ``step-<n>`` folder with
    its ``state.json``), in step order."""
    found = {}
    for folder in ckpt_dir.glob("step-*"):
        tail = folder.name.split("-", 1)[1]
        if tail.isdigit() and (folder / "state.json").is_file():
            found[int(tail)] = folder
    return dict(sorted(found.items()))


def _prune(ckpt_dir: Path, keep: set[str]) -> None:
    complete = sorted(p for p in ckpt_dir.glob("step-*") if p.is_dir())
    for old in complete[:-KEEP]:
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
    for leftover in [*ckpt_dir.glob(".tmp-step-*"), *ckpt_dir.glob(".old-step-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


_STATE_KEYS = ("step", "samples", "time_s", "sampler", "run_state", "rng")


class CheckpointError(Exception):
    """A checkpoint folder that cannot be resumed from; the message names the file and why."""


def _read_state(folder: Path) -> dict[str, Any]:
    path = folder / "state.json"
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or any(k not in meta for k in _STATE_KEYS):
        missing = [k for k in _STATE_KEYS if not isinstance(meta, dict) or k not in meta]
        raise CheckpointError(f"{path} lacks {', '.join(missing)}")
    if not isinstance(meta["step"], int) or meta["step"] < 0:
        raise CheckpointError(f"{path}: step must be a non-negative integer, got {meta['step']!r}")
    return meta


def recorded_threads(folder: Path) -> int | None:
    """The thread count the run of checkpoint ``folder`` trained with (None for a checkpoint
    written before alignzoo recorded it)."""
    threads = _read_state(folder).get("threads")
    counted = isinstance(threads, int) and not isinstance(threads, bool) and threads > 0
    return threads if counted else None


def _check_weights(path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                handle.get_tensor(key)  # reads every byte: a truncated file fails here
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None


def _read_trainer(folder: Path) -> dict[str, Any]:
    path = folder / "trainer.pt"
    try:
        trainer = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as exc:  # torch raises many kinds for a damaged or foreign file
        raise CheckpointError(f"{path} is not a readable trainer state ({exc})") from None
    need = ("optimizer", "scheduler", "torch_rng", "components")
    if not isinstance(trainer, dict) or any(k not in trainer for k in need):
        raise CheckpointError(f"{path} lacks the optimizer, scheduler, RNG or component state")
    return trainer


def check_checkpoint(folder: Path, critic: bool, reference: bool = False) -> None:
    """Raise :class:`CheckpointError` unless every file of ``folder`` reads back whole.

    Reads state.json, every tensor of actor.safetensors (and critic.safetensors when the run
    has a critic, reference.safetensors when its reference moves) and trainer.pt, without
    touching any model: a checkpoint that passes can be loaded, one that fails is never
    half-applied.
    """
    _read_state(folder)
    _check_weights(folder / "actor.safetensors")
    if critic:
        _check_weights(folder / "critic.safetensors")
    if reference:
        _check_weights(folder / REFERENCE_FILE)
    _read_trainer(folder)


@dataclass
class ResumePoint:
    """Where a run resumes: the newest usable checkpoint, and the newer ones that were not."""

    folder: Path | None
    unusable: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def written(self) -> bool:
        """True when the run ever completed a checkpoint (usable or not)."""
        return self.folder is not None or bool(self.unusable)


def find_resume_point(ckpt_dir: Path, critic: bool, reference: bool = False) -> ResumePoint:
    """The newest checkpoint of ``ckpt_dir`` that :func:`check_checkpoint` accepts.

    Complete checkpoints are the ``step-*`` folders (only complete ones are renamed into
    place), tried newest first; each one that fails is listed in ``unusable`` with its
    reason. ``folder`` is None when none is usable (or none was ever written).
    """
    point = ResumePoint(None)
    if not ckpt_dir.is_dir():
        return point
    complete = sorted((p for p in ckpt_dir.glob("step-*") if p.is_dir()), reverse=True)
    for folder in complete:
        try:
            check_checkpoint(folder, critic, reference)
        except CheckpointError as exc:
            point.unusable.append((folder, str(exc)))
            continue
        point.folder = folder
        break
    return point


def checkpoint_manifest(folder: Path) -> dict[str, Any]:
    """What a checkpoint folder holds, to tell two views of it apart: its name and, per file
    (relative path), its size and SHA-256."""
    files: dict[str, list[Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        files[str(path.relative_to(folder))] = [path.stat().st_size, full_sha256(path)]
    return {"checkpoint": folder.name, "files": files}


def full_sha256(path: Path) -> str:
    """The SHA-256 of every byte of a file (read in 1 MiB blocks). Not
    :func:`alignzoo.provenance.file_sha256`, which hashes only the edges of a big file: two
    checkpoints' weights may differ anywhere."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pointed_name(ckpt_dir: Path) -> str | None:
    """The folder name ``checkpoints/latest`` holds (None when it is missing or unreadable)."""
    try:
        name = (ckpt_dir / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name or None


def point_latest_at(folder: Path) -> str | None:
    """Make ``latest`` (in ``folder``'s parent) name the checkpoint ``folder``, atomically.

    Returns what it named before when it had to be rewritten (``"nothing"`` when it was
    missing), None when it named ``folder`` already. The one rule every writer keeps: the
    resume point and a finished run's final step are what ``latest`` names, so that a kill
    between renaming a checkpoint into place and writing the pointer is repaired by the next
    resume before anything else happens.
    """
    before = pointed_name(folder.parent)
    if before == folder.name:
        return None
    write_atomic(folder.parent / LATEST, folder.name + "\n")
    return before or "nothing"


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The folder ``latest`` names (else the newest complete one), or None when there is none.

    Only complete checkpoints ever carry a ``step-*`` name (they are renamed into place).
    """
    name = pointed_name(ckpt_dir)
    if name is not None and name.startswith("step-") and (ckpt_dir / name / "state.json").is_file():
        return ckpt_dir / name
    complete = list(complete_checkpoints(ckpt_dir).values())
    return complete[-1] if complete else None


def load_checkpoint(
    folder: Path,
    actor: Any,
    critic: Any | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    components: dict[str, Any],
    checked: bool = False,
    reference: Any | None = None,
) -> TrainingState:
    """Restore models, optimizer, scheduler, RNGs and components; return the loop's state.
    ``reference``: a moving reference, whose weights the checkpoint holds.

    A checkpoint written before the policy version was recorded gives the optimizer steps its
    schedule counted, which is what the version counts.

    Unless ``checked`` (the caller ran :func:`check_checkpoint` on it already), the files are
    checked first: a damaged checkpoint raises :class:`CheckpointError` before anything is
    changed.
    """
    if not checked:
        check_checkpoint(folder, critic is not None, reference is not None)
    meta = _read_state(folder)
    trainer = _read_trainer(folder)
    if is_sharded(actor):
        _load_sharded(folder, actor, critic, optimizer, trainer["optimizer"])
    else:
        load_actor_weights(actor, folder / "actor.safetensors")
        if critic is not None:
            load_model(critic, str(folder / "critic.safetensors"), device=str(_device(critic)))
        optimizer.load_state_dict(trainer["optimizer"])
    if reference is not None:
        load_model(reference, str(folder / REFERENCE_FILE), device=str(_device(reference)))
    scheduler.load_state_dict(trainer["scheduler"])
    for slot, c in components.items():
        if slot in trainer["components"] and isinstance(c, Stateful):
            c.load_state_dict(trainer["components"][slot])
    torch.set_rng_state(trainer["torch_rng"])
    if "cuda_rng" in trainer and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(trainer["cuda_rng"])
    _set_rng_state(meta["rng"])
    return TrainingState(
        step=meta["step"],
        samples=meta["samples"],
        time_s=meta["time_s"],
        tokens=meta.get("tokens", 0),
        sampler=meta["sampler"],
        run_state=meta["run_state"],
        policy_version=meta.get("policy_version", int(getattr(scheduler, "last_epoch", 0))),
    )


# --------------------------------------------------------------------------- sharded models


@dataclass
class GatheredState:
    """Sharded models' full state, as a one-process run would save it."""

    actor: dict[str, torch.Tensor]
    critic: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any]  # torch's own layout: states and groups by parameter index


def _trained(actor: Any, critic: Any | None) -> torch.nn.Module:
    """One module over the trained models, for the optimizer's parameter names."""
    return torch.nn.ModuleDict(
        {"actor": actor} if critic is None else {"actor": actor, "critic": critic}
    )


def _parameter_names(actor: Any, critic: Any | None, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the optimizer's order (the order of its
    indices in ``optimizer.state_dict()``); a tied parameter has its first name."""
    names: dict[int, str] = {}
    for name, param in _trained(actor, critic).named_parameters():
        names.setdefault(id(param), name)
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _tied_groups(module: Any) -> list[list[str]]:
    """Names that share one tensor (tied embeddings), sorted; one list per shared tensor."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return [sorted(names) for names in by_tensor.values() if len(names) > 1]


def _untied(module: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with one name per tied tensor (the first, as safetensors' save_model keeps)."""
    dropped = {name for names in _tied_groups(module) for name in names[1:]}
    return {name: t.contiguous() for name, t in tensors.items() if name not in dropped}


def _retied(module: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every name of a tied tensor (a file keeps one of them)."""
    out = dict(tensors)
    for names in _tied_groups(module):
        present = [n for n in names if n in out]
        for name in names:
            if present and name not in out:
                out[name] = out[present[0]]
    return out


def gather_sharded(
    actor: Any, critic: Any | None, optimizer: torch.optim.Optimizer
) -> GatheredState | None:
    """The full weights and optimizer state of FSDP2-sharded models, through
    torch.distributed.checkpoint's ``get_model_state_dict`` / ``get_optimizer_state_dict``.

    A collective: every rank calls it; rank 0 receives the state (on the CPU), the others None.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    actor_state: Any = get_model_state_dict(actor, options=options)
    critic_state: Any = (
        get_model_state_dict(critic, options=options) if critic is not None else None
    )
    named: Any = get_optimizer_state_dict(_trained(actor, critic), optimizer, options=options)
    if torch.distributed.get_rank() != 0:
        return None
    index = {name: i for i, name in enumerate(_parameter_names(actor, critic, optimizer))}
    plain = {
        "state": {index[name]: value for name, value in named["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in named["param_groups"]
        ],
    }
    return GatheredState(
        actor=_untied(actor, actor_state),
        critic=_untied(critic, critic_state) if critic_state is not None else None,
        optimizer=plain,
    )


def _load_sharded(
    folder: Path,
    actor: Any,
    critic: Any | None,
    optimizer: torch.optim.Optimizer,
    plain: dict[str, Any],
) -> None:
    """Load a checkpoint's full weights and optimizer state into this rank's shards (every
    rank reads the files and keeps its share; a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    for module, name in ((actor, "actor"), (critic, "critic")):
        if module is not None:
            full: Any = _retied(module, load_file(str(folder / f"{name}.safetensors")))
            set_model_state_dict(module, full, options=options)
    names = _parameter_names(actor, critic, optimizer)
    if len(names) != sum(len(g["params"]) for g in plain["param_groups"]):
        raise CheckpointError(
            f"{folder / 'trainer.pt'}: its optimizer state is for a different set of parameters"
        )
    named: Any = {
        "state": {names[int(i)]: value for i, value in plain["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(i)] for i in group["params"]]}
            for group in plain["param_groups"]
        ],
    }
    set_optimizer_state_dict(_trained(actor, critic), optimizer, named, options=options)


ADAPTERS = "adapters"
"""``actor.safetensors`` metadata ``format`` of a LoRA actor: only the trained adapter weights."""


def _is_adapted(actor: Any) -> bool:
    return hasattr(actor, "peft_config") and hasattr(actor, "disable_adapter")


def save_actor(actor: Any, path: Path) -> None:
    """The actor's weights: all of them, or for a LoRA actor only the adapters it trains (the
    base weights are the starting policy, which the run loads again on resume)."""
    if not _is_adapted(actor):
        save_model(actor, str(path))
        return
    trained = {
        name: param.detach().cpu().contiguous()
        for name, param in actor.named_parameters()
        if param.requires_grad
    }
    save_file(trained, str(path), metadata={"format": ADAPTERS})


def load_actor_weights(actor: Any, path: Path) -> None:
    """Load what :func:`save_actor` wrote into ``actor`` (on its own device); adapters-only
    files must name exactly the actor's trained parameters."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        adapters = (handle.metadata() or {}).get("format") == ADAPTERS
    if not adapters:
        load_model(actor, str(path), device=str(_device(actor)))
        return
    tensors = load_file(str(path), device=str(_device(actor)))
    trained = {n for n, p in actor.named_parameters() if p.requires_grad}
    if set(tensors) != trained:
        wrong = sorted(set(tensors) ^ trained)[:3]
        raise CheckpointError(
            f"{path}: its adapter weights do not match the arm's adapters (e.g. {wrong}); was "
            "model.lora changed since the checkpoint?"
        )
    actor.load_state_dict(tensors, strict=False)


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the complete lines of ``path`` whose ``step`` is at most ``step`` (atomically).

    A line that is not a JSON object with a numeric ``step`` (a line cut by a kill, bytes that
    are not UTF-8) is dropped.
    """
    if not path.exists():
        return
    kept = []
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            row = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        at = row.get("step") if isinstance(row, dict) else None
        if isinstance(at, (int, float)) and not isinstance(at, bool) and at <= step:
            kept.append(line)
    write_atomic(path, "".join(x + "\n" for x in kept))
