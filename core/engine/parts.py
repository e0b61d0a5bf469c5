"""The pieces of a run that both parties of an arm build for themselves: the trainer
(:func:`~alignzoo.engine.assemble.assemble`) and each rollout producer of ``training.async``
(:mod:`~alignzoo.engine.producers`): fresh component instances, the labeler chain, the seeds.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from alignzoo.config.loader import EVAL_LABELER, LoadedExperiment
from alignzoo.config.schema import ArmSpec
from alignzoo.engine.hooks import Hooks
from alignzoo.errors import UserError
from alignzoo.labeling import LabelingStage
from alignzoo.labeling.store import STORE_FILE, LabelStore
from alignzoo.plugin import Component
from alignzoo.registry import build_plugin_manager


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators with the run seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def fresh_components(loaded: LoadedExperiment, arm: str) -> dict[str, Component]:
    """New instances of the arm's components (``type(c)(c.params)``): no state shared between runs."""
    if arm not in loaded.components:
        raise UserError(
            f"{loaded.source}: no arm named {arm!r}; arms: {', '.join(loaded.components)}"
        )
    return {slot: type(c)(c.params) for slot, c in loaded.components[arm].items()}


def labeler_hooks(component: Any, name: str) -> Hooks:
    """The hooks of a plugin manager holding one labeler alone (a fallback, the evaluation
    labeler, one swapped in: :func:`alignzoo.labeling.swap.poll` is handed this)."""
    return Hooks(build_plugin_manager([component]), name)


def labeling_stage(
    arm_spec: ArmSpec,
    components: dict[str, Any],
    hooks: Hooks,
    seed: int,
    out_dir: Path | None = None,
) -> LabelingStage:
    """The arm's labeler chain: its labeler (through the run's hooks, so modifiers wrapping
    ``score_batch`` apply), then each of ``labeling.fallbacks`` on its own."""
    chain: list[tuple[str, Any, Hooks]] = [(arm_spec.labeler.name, components["labeler"], hooks)]
    for i, ref in enumerate(arm_spec.labeling.fallbacks):
        component = components[f"labeling.fallbacks.{i}"]
        name = ref.name if ref.name not in {n for n, _, _ in chain} else f"{ref.name}.{i + 1}"
        chain.append((name, component, labeler_hooks(component, ref.name)))
    where = arm_spec.labeling.store
    store = None
    if where is not None:
        if where == "run":
            store = LabelStore(out_dir / STORE_FILE) if out_dir is not None else None
        else:
            store = LabelStore(Path(where).expanduser())
    return LabelingStage.build(arm_spec.labeling, chain, seed=seed, store=store)


def run_hooks(components: dict[str, Component], algorithm: str) -> Hooks:
    """The hooks of a run's own plugin manager: every component but the labeler fallbacks and
    the evaluation labeler, which never take part in the training labeler's ``score_batch``."""
    run_components = [
        c
        for slot, c in components.items()
        if not slot.startswith("labeling.") and slot != EVAL_LABELER
    ]
    return Hooks(build_plugin_manager(run_components), algorithm)


def start_fallbacks(labeling: LabelingStage, context: Any) -> None:
    """``on_run_start`` for the labeler chain's fallbacks (they live outside the run's manager,
    so its ``on_run_start`` does not reach them)."""
    for slot in labeling.slots[1:]:
        if hasattr(slot.call, "hooks"):
            slot.call.hooks.on_run_start(context)
