"""The learner: what trains the models. It owns the optimizer (AdamW, one parameter group for
the actor and one for the critic), the learning-rate schedule and, under torch.distributed,
the data-parallel strategy (``training.parallel``):

- ``ddp``: the DistributedDataParallel wrappers the update's forward passes run through; the
  models themselves stay whole in :class:`Models`;
- ``fsdp2``: the actor and critic are sharded in place with ``fully_shard`` (one unit per
  transformer block, then the whole model), before the optimizer is built, so parameters,
  gradients and AdamW's state are DTensor shards. Every forward pass of a sharded model is a
  collective: all ranks run it with the same micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from alignzoo import distributed
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.models import Models, trainable_parameters
from alignzoo.engine.refsync import mix_into_reference, sync_due


def build_optimizer(
    actor_params: list[torch.nn.Parameter],
    critic_params: list[torch.nn.Parameter],
    cfg: TrainingConfig,
) -> torch.optim.AdamW:
    """AdamW with one parameter group for the actor and one for the critic (its own lr)."""
    groups = [{"params": actor_params, "lr": cfg.lr}]
    if critic_params:
        groups.append(
            {"params": critic_params, "lr": cfg.critic_lr if cfg.critic_lr is not None else cfg.lr}
        )
    params = [*actor_params, *critic_params]
    # torch's fused AdamW (one kernel over all tensors) where it exists for the parameters'
    # devices and dtypes; the update is AdamW's either way.
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def lr_factor(step: int, warmup: int, total: int | None, schedule: str) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based): linear warmup, then the
    schedule (linear / cosine decay to 0 over ``total`` steps; constant without a known total)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total is None or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total: int | None
) -> Any:
    """A LambdaLR following :func:`lr_factor`; ``total`` counts optimizer steps (None: unknown)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total, cfg.lr_schedule)
    )


@dataclass
class Learner:
    """The optimizer and schedule over the trainable models of a run, and the arm's settings."""

    models: Models
    optimizer: torch.optim.Optimizer
    scheduler: Any
    cfg: TrainingConfig
    seed: int
    actor_wrapper: Any = None  # DistributedDataParallel around the actor, under several processes
    critic_wrapper: Any = None
    gradient_scale: float = 1.0  # the world size under DDP/FSDP2 (they average the gradients)
    sharded: bool = False  # the actor and critic are FSDP2-sharded (training.parallel: fsdp2)
    version: int = 0
    """The policy version: the optimizer steps the actor's weights have taken (checkpointed).
    A sampled batch records the version that sampled it (``RolloutBatch.policy_version``)."""

    def step(self) -> None:
        """One optimizer step and one step of the schedule: the next policy version; then, with
        ``training.sync_ref_model``, the reference's sync when this version is due one
        (:mod:`~alignzoo.engine.refsync`)."""
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        if sync_due(self.cfg, self.version):
            reference = self.models.reference
            assert reference is not None  # assemble refuses a moving reference without one
            mix_into_reference(reference, self.models.actor, self.cfg.ref_model_mixup_alpha)

    @property
    def actor_module(self) -> Any:
        """What the update's forward passes run: the actor, or its DDP wrapper."""
        return self.actor_wrapper if self.actor_wrapper is not None else self.models.actor

    @property
    def critic_module(self) -> Any:
        """The critic, or its DDP wrapper (None without a critic)."""
        return self.critic_wrapper if self.critic_wrapper is not None else self.models.critic

    @property
    def actor_parameters(self) -> list[torch.nn.Parameter]:
        """The actor's trainable parameters (the optimizer's first group)."""
        return list(self.optimizer.param_groups[0]["params"])

    @property
    def critic_parameters(self) -> list[torch.nn.Parameter]:
        """The critic's parameters (the second group), empty without a critic."""
        groups = self.optimizer.param_groups
        return list(groups[1]["params"]) if len(groups) > 1 else []

    @property
    def lr(self) -> float:
        """The actor's current learning rate."""
        return float(self.optimizer.param_groups[0]["lr"])


def build_learner(
    models: Models, cfg: TrainingConfig, total_steps: int | None, seed: int
) -> Learner:
    """AdamW over the actor's (and critic's) trainable parameters with the arm's schedule;
    ``total_steps`` counts optimizer steps (None: unknown, for a wall-clock budget).

    Under several processes the models are first made data parallel as ``cfg.parallel`` says
    (FSDP2 shards before the optimizer sees the parameters)."""
    sharded = distributed.active() and cfg.parallel == "fsdp2"
    if sharded:
        models.actor = fully_shard_model(models.actor)
        if models.critic is not None:
            models.critic = fully_shard_model(models.critic)
    optimizer = build_optimizer(
        trainable_parameters(models.actor),
        trainable_parameters(models.critic) if models.critic is not None else [],
        cfg,
    )
    learner = Learner(
        models=models,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg, total_steps),
        cfg=cfg,
        seed=seed,
        sharded=sharded,
    )
    if distributed.active():
        if not sharded:
            learner.actor_wrapper = _data_parallel(models.actor)
            if models.critic is not None:
                learner.critic_wrapper = _data_parallel(models.critic)
        learner.gradient_scale = float(distributed.world_size())
    return learner


def _data_parallel(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` wrapped in DistributedDataParallel (its weights broadcast from rank 0); the
    engine keeps the plain module for everything but the update's forward passes."""
    device = next(module.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)


def shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules FSDP2 shards as units of their own: the blocks a transformers model
    names in ``_no_split_modules`` (its decoder layers), outermost first."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    return [sub for sub in module.modules() if sub is not module and type(sub).__name__ in names]


def fully_shard_model(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` sharded in place over the process group with FSDP2: every rank first takes
    rank 0's weights (as DDP does), then each transformer block and the whole model become
    ``fully_shard`` units. The gradients are averaged over ranks, as under DDP."""
    from torch.distributed.fsdp import fully_shard

    dist = torch.distributed
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)
    for unit in shard_units(module):
        fully_shard(unit)
    fully_shard(module)
    return module
