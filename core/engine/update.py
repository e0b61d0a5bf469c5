"""The update stage: epochs x minibatches x micro-batches of ``compute_loss``, then one optimizer
step per minibatch (gradient accumulation, clipping, scheduler), and the optimizer's set-up.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.forward import (
    AutocastFactory,
    critic_forward,
    mismatch_partners,
    mismatched_view,
    policy_forward,
    sequence_logprob,
)
from alignzoo.errors import RunError
from alignzoo.ops import masked_mean
from alignzoo.types import AlgorithmRequirements


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
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


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
    """What the update stage needs: models, optimizer, scheduler and the arm's settings."""

    pm: Any
    actor: Any
    critic: Any | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    cfg: TrainingConfig
    requirements: AlgorithmRequirements
    autocast: AutocastFactory
    algorithm_name: str
    seed: int


def _units(size: int, paired: bool) -> list[list[int]]:
    """Indivisible index groups of ``range(size)``: pairs for preference data (kept together),
    else single samples."""
    if paired:
        return [[i, i + 1] for i in range(0, size, 2)]
    return [[i] for i in range(size)]


def _split(units: list[list[int]], size: int) -> list[list[int]]:
    """Consecutive groups of units holding about ``size`` samples each (at least one unit)."""
    per = max(1, size // len(units[0]))
    return [[i for u in units[k : k + per] for i in u] for k in range(0, len(units), per)]


def micro_step(
    learner: Learner, step_batch: RolloutBatch, index: list[int]
) -> tuple[Any, dict[str, float]]:
    """Forward one micro-batch with gradients and call ``compute_loss``."""
    req = learner.requirements
    mb = step_batch.select(index)
    logprobs, entropy = policy_forward(
        learner.actor, mb, entropy=req.entropy, autocast=learner.autocast
    )
    outputs = PolicyOutputs(logprobs=logprobs, entropy=entropy)
    if learner.critic is not None:
        values = critic_forward(learner.critic, mb, autocast=learner.autocast)
        outputs.values = values.to(logprobs.device)  # the critic may sit on another device
    if req.mismatched_pairs:
        partners = mismatch_partners(step_batch.size)
        partner = [partners[i] for i in index]
        view = mismatched_view(mb, step_batch.select(partner))
        outputs.mismatched_logprobs = sequence_logprob(learner.actor, view, learner.autocast)
    device = logprobs.device
    result = learner.pm.hook.compute_loss(batch=mb.to(device), outputs=outputs)
    if result is None:
        raise RunError(f"algorithm {learner.algorithm_name!r} returned no loss")
    loss = result.loss
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        got = (
            f"a tensor of shape {list(loss.shape)}, requires_grad={loss.requires_grad}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise RunError(
            f"algorithm {learner.algorithm_name!r}: compute_loss must return a scalar tensor "
            f"that depends on outputs.logprobs; got {got}"
        )
    metrics = {k: float(v) for k, v in result.metrics.items()}
    if entropy is not None and "entropy" not in metrics:
        metrics["entropy"] = float(masked_mean(entropy.detach(), mb.response_mask.to(device)))
    return loss, metrics


def update(learner: Learner, batch: RolloutBatch, step: int) -> dict[str, float]:
    """Train on one step's batch; returns the metrics averaged over micro-batches / opt steps.

    ``lr`` is the learning rate the step's optimizer steps used (averaged over them).
    """
    cfg = learner.cfg
    paired = learner.requirements.data == "preference"
    if paired and (batch.size % 2 or not torch.equal(batch.group_ids[::2], batch.group_ids[1::2])):
        raise RunError(
            f"step {step}: the preference batch is no longer adjacent (chosen, rejected) pairs "
            f"({batch.size} samples); a batch transform must keep or drop both samples of a pair"
        )
    units = _units(batch.size, paired)
    minibatch = cfg.minibatch_size or batch.size
    sums: dict[str, list[float]] = defaultdict(list)
    generator = torch.Generator().manual_seed(abs(learner.seed) * 100_003 + step)
    groups = learner.optimizer.param_groups
    actor_params = groups[0]["params"]
    critic_params = groups[1]["params"] if len(groups) > 1 else []
    learner.actor.train()
    for epoch in range(cfg.epochs):
        order = units
        if cfg.epochs > 1 or minibatch < batch.size:
            order = [units[i] for i in torch.randperm(len(units), generator=generator).tolist()]
        for mb_index in _split(order, minibatch):
            learner.optimizer.zero_grad(set_to_none=True)
            for micro in _split(_units(len(mb_index), paired), cfg.micro_batch_size):
                index = [mb_index[i] for i in micro]
                loss, metrics = micro_step(learner, batch, index)
                if not torch.isfinite(loss.detach()).all():
                    raise RunError(
                        f"step {step}: algorithm {learner.algorithm_name!r} returned a "
                        f"non-finite loss ({float(loss.detach())}) in epoch {epoch}; "
                        "stopping (the last checkpoint is kept)"
                    )
                (loss * (len(index) / len(mb_index))).backward()
                sums["loss"].append(float(loss.detach()))
                for k, v in metrics.items():
                    sums[k].append(v)
            norms = {"actor": _clip(actor_params, cfg.max_grad_norm)}
            if critic_params:
                norms["critic"] = _clip(critic_params, cfg.max_grad_norm)
            for role, norm in norms.items():
                if not math.isfinite(norm):  # stepping would write NaN into the weights
                    raise RunError(
                        f"step {step}: the {role}'s gradient norm is {norm} (algorithm "
                        f"{learner.algorithm_name!r}, epoch {epoch}); stopping before the "
                        "optimizer step (the last checkpoint is kept)"
                    )
                sums[f"{role}/grad_norm"].append(norm)
            sums["lr"].append(float(groups[0]["lr"]))
            learner.optimizer.step()
            learner.scheduler.step()
    return {k: sum(v) / len(v) for k, v in sums.items()}


def _clip(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the gradient norm (if asked) and return the norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    limit = max_norm if max_norm is not None else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(grads, limit))
