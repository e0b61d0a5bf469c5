"""Checkpoints: written atomically, kept two deep, read back without unpickling anything.

Layout of ``checkpoints/step-000010/``:
    actor.safetensors, critic.safetensors   model weights
    trainer.pt                              optimizer, scheduler, torch RNG, components' state
                                            (read only with ``torch.load(weights_only=True)``)
    state.json                              step, samples, time_s, sampler cursor, run.state,
                                            python and numpy RNG states
``checkpoints/latest`` names the newest complete folder. A folder is written under a temporary
name and renamed into place; ``latest`` is written to a temporary file and renamed too, so a
kill at any moment leaves the previous checkpoint readable.
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
from safetensors.torch import load_model, save_model

from alignzoo.plugin import Stateful

KEEP = 2
LATEST = "latest"


@dataclass
class TrainingState:
    """What the loop carries between steps, besides models and optimizer."""

    step: int = 0
    samples: int = 0
    time_s: float = 0.0
    tokens: int = 0
    sampler: dict[str, int] = field(default_factory=dict)
    run_state: dict[str, Any] = field(default_factory=dict)


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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(
    ckpt_dir: Path,
    state: TrainingState,
    actor: Any,
    critic: Any | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    components: dict[str, Any],
) -> Path:
    """Write checkpoint ``step-<n>`` atomically, point ``latest`` at it, keep the last two."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.step:06d}"
    final = ckpt_dir / name
    tmp = ckpt_dir / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(actor, str(tmp / "actor.safetensors"))
    if critic is not None:
        save_model(critic, str(tmp / "critic.safetensors"))
    trainer = {
        "optimizer": optimizer.state_dict(),
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
    _fsync_dir(ckpt_dir)
    _write_text_atomic(ckpt_dir / LATEST, name + "\n")
    _prune(ckpt_dir, keep=name)
    return final


def _prune(ckpt_dir: Path, keep: str) -> None:
    complete = sorted(p for p in ckpt_dir.glob("step-*") if p.is_dir())
    for old in complete[:-KEEP]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)
    for leftover in [*ckpt_dir.glob(".tmp-step-*"), *ckpt_dir.glob(".old-step-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The folder ``latest`` names (else the newest complete one), or None when there is none.

    Only complete checkpoints ever carry a ``step-*`` name (they are renamed into place).
    """
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        folder = ckpt_dir / pointer.read_text(encoding="utf-8").strip()
        if (folder / "state.json").is_file():
            return folder
    complete = sorted(p for p in ckpt_dir.glob("step-*") if (p / "state.json").is_file())
    return complete[-1] if complete else None


def load_checkpoint(
    folder: Path,
    actor: Any,
    critic: Any | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    components: dict[str, Any],
) -> TrainingState:
    """Restore models, optimizer, scheduler, RNGs and components; return the loop's state."""
    load_model(actor, str(folder / "actor.safetensors"), device=str(_device(actor)))
    if critic is not None:
        load_model(critic, str(folder / "critic.safetensors"), device=str(_device(critic)))
    trainer = torch.load(folder / "trainer.pt", weights_only=True, map_location="cpu")
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    for slot, c in components.items():
        if slot in trainer["components"] and isinstance(c, Stateful):
            c.load_state_dict(trainer["components"][slot])
    meta = json.loads((folder / "state.json").read_text(encoding="utf-8"))
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
    )


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the complete lines of ``path`` whose ``step`` is at most ``step`` (atomically)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if isinstance(row, dict) and int(row.get("step", 0)) <= step:
            kept.append(line)
    _write_text_atomic(path, "".join(x + "\n" for x in kept))
