"""Assembling one run: fresh components in a per-run PluginManager, roles placed on devices
before any model loads, then exactly the models the algorithm asks for, data and optimizer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from alignzoo.config.loader import LoadedExperiment
from alignzoo.config.schema import ArmSpec, ExperimentSpec
from alignzoo.engine import models
from alignzoo.engine.context import RunContext
from alignzoo.engine.evaluate import eval_rows
from alignzoo.engine.forward import AutocastFactory
from alignzoo.engine.sampler import PromptSampler
from alignzoo.engine.update import Learner, build_optimizer, build_scheduler
from alignzoo.errors import RunError, UserError
from alignzoo.plugin import Component
from alignzoo.registry import build_plugin_manager
from alignzoo.types import AlgorithmRequirements


@dataclass
class Engine:
    """Everything a run holds once assembled."""

    run: RunContext
    pm: Any
    components: dict[str, Component]
    requirements: AlgorithmRequirements
    online: bool
    policy_path: str
    learner: Learner
    sampler: PromptSampler
    eval_rows: list[dict[str, Any]]
    autocast: AutocastFactory
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> ExperimentSpec:
        return self.run.spec

    @property
    def arm(self) -> ArmSpec:
        return self.run.arm_spec


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


def needed_roles(req: AlgorithmRequirements, arm: ArmSpec) -> list[str]:
    """The roles this run has: actor, rollout and labeler always; ref, critic, reward on demand."""
    roles = ["actor", "rollout", "labeler"]
    if req.reference:
        roles.append("ref")
    if req.critic:
        roles.append("critic")
    if arm.model.reward_model is not None:
        roles.append("reward")
    return roles


def place_roles(pm: Any, roles: list[str]) -> dict[str, str]:
    """Ask the device mapper where each role goes (before anything loads)."""
    from alignzoo.devices import available_devices

    placed = pm.hook.place_roles(roles=roles, available=available_devices())
    if placed is None:
        raise UserError("the arm's device mapper placed no roles")
    missing = [r for r in roles if r not in placed]
    if missing:
        raise UserError(f"the device mapper did not place role(s) {', '.join(missing)}")
    return dict(placed)


def step_sizes(arm: ArmSpec, data: str = "online", online: bool = True) -> tuple[int, int]:
    """(samples a step counts towards the budget, samples it trains on at most).

    Online: ``prompts x samples_per_prompt`` are sampled; preference pairs keep at most two
    samples per prompt. Offline: a preference row is two samples, an unpaired row one.
    """
    cfg = arm.training
    if online:
        sampled = cfg.prompts_per_step * cfg.samples_per_prompt
        return sampled, 2 * cfg.prompts_per_step if data == "preference" else sampled
    rows = cfg.prompts_per_step * (2 if data == "preference" else 1)
    return rows, rows


def total_optimizer_steps(
    spec: ExperimentSpec, arm: ArmSpec, data: str = "online", online: bool = True
) -> int | None:
    """Optimizer steps the budget allows (None for a wall-clock budget): for lr schedules.

    ``data`` is the algorithm's data mode and ``online`` whether the arm samples its batches.
    """
    cfg = arm.training
    counted, trained = step_sizes(arm, data, online)
    steps = spec.budget.steps
    if steps is None and spec.budget.samples is not None:
        steps = math.ceil(spec.budget.samples / counted)
    if steps is None:
        return None
    unit = 2 if data == "preference" else 1  # pairs are never split (trainer._split)
    per_minibatch = max(1, (cfg.minibatch_size or trained) // unit)
    return steps * cfg.epochs * max(1, math.ceil(trained // unit / per_minibatch))


def assemble(
    loaded: LoadedExperiment,
    arm: str,
    seed: int,
    out_dir: Path,
    console: Any = None,
    log: Callable[[str], None] = print,
) -> Engine:
    """Build the run: components, devices, models, data, optimizer. Calls ``on_run_start``."""
    spec = loaded.spec
    components = fresh_components(loaded, arm)
    arm_spec = spec.arms[arm]
    pm = build_plugin_manager(components.values())
    req = pm.hook.algorithm_requirements()
    if req is None:
        raise UserError(f"arm {arm!r}: the algorithm states no requirements")
    data_online = spec.data.online if arm_spec.online is None else arm_spec.online
    online = req.data == "online" or data_online
    if req.data == "preference" and online and arm_spec.training.samples_per_prompt < 2:
        raise UserError(
            f"arms.{arm}.training.samples_per_prompt: online preference pairs need at least 2 "
            "samples per prompt"
        )
    run = RunContext(
        experiment=spec.name,
        arm=arm,
        seed=seed,
        out_dir=out_dir,
        spec=spec,
        arm_spec=arm_spec,
        console=console,
    )
    run.devices = place_roles(pm, needed_roles(req, arm_spec))
    seed_everything(seed)

    mcfg = arm_spec.model
    path = models.policy_path(mcfg, spec.data.task, log)
    run.tokenizer = models.load_tokenizer(path)
    run.actor = models.load_actor(path, mcfg, run.device("actor"))
    if req.reference:
        run.reference = models.load_reference(path, mcfg, run.device("ref"))
    if req.critic:
        run.critic = models.load_critic(path, mcfg, run.device("critic"), seed)

    from alignzoo.engine.datasets import load_split

    train = load_split(spec.data, "train", "online" if online else req.data)
    evaluation = load_split(spec.data, "eval", "online")
    optimizer = build_optimizer(
        models.trainable_parameters(run.actor),
        models.trainable_parameters(run.critic) if run.critic is not None else [],
        arm_spec.training,
    )
    autocast = models.autocast_factory(mcfg, run.device("actor"))
    learner = Learner(
        pm=pm,
        actor=run.actor,
        critic=run.critic,
        optimizer=optimizer,
        scheduler=build_scheduler(
            optimizer, arm_spec.training, total_optimizer_steps(spec, arm_spec, req.data, online)
        ),
        cfg=arm_spec.training,
        requirements=req,
        autocast=autocast,
        algorithm_name=arm_spec.algorithm.name,
        seed=seed,
    )
    engine = Engine(
        run=run,
        pm=pm,
        components=components,
        requirements=req,
        online=online,
        policy_path=path,
        learner=learner,
        sampler=PromptSampler(train, seed),
        eval_rows=eval_rows(evaluation, spec.evaluation.num_prompts),
        autocast=autocast,
    )
    try:
        pm.hook.on_run_start(run=run)
        pm.hook.sync_weights(model=run.actor)
    except (UserError, RunError):
        raise
    except Exception as exc:
        raise RunError(f"on_run_start failed: {type(exc).__name__}: {exc}") from exc
    seed_everything(seed)  # every arm enters the loop with the same RNG state for a seed
    return engine
