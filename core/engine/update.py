"""The update stage: epochs x minibatches x micro-batches of ``compute_loss``, one optimizer step
per minibatch (gradient accumulation, clipping, scheduler).

Each minibatch is one optimizer step. Its :class:`~alignzoo.types.LossContext` (valid tokens,
samples and groups of the whole minibatch) is handed to ``compute_loss`` with every
micro-batch; the algorithm normalises its loss by those counts, so each micro-batch returns its
share of the minibatch's loss and the engine back-propagates each share as it is. The sum of
the gradients is then the gradient of the whole minibatch's loss, whatever ``micro_batch_size``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from alignzoo import metrics as canonical
from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.engine.forward import critic_forward, policy_forward
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.learner import Learner
from alignzoo.engine.modes import DataMode
from alignzoo.errors import RunError
from alignzoo.types import AlgorithmRequirements, LossContext


def split_units(units: list[list[int]], size: int) -> list[list[int]]:
    """Consecutive groups of units holding about ``size`` samples each (at least one unit)."""
    if not units:
        return []
    per = max(1, size // len(units[0]))
    return [[i for u in units[k : k + per] for i in u] for k in range(0, len(units), per)]


def micro_step(
    learner: Learner,
    hooks: Hooks,
    requirements: AlgorithmRequirements,
    step_batch: RolloutBatch,
    index: list[int],
    context: LossContext,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward one micro-batch with gradients and call ``compute_loss`` with the step's context."""
    models = learner.models
    mb = step_batch.select(index)
    logprobs, entropy = policy_forward(
        models.actor, mb, entropy=requirements.entropy, autocast=models.autocast
    )
    outputs = PolicyOutputs(logprobs=logprobs, entropy=entropy)
    if models.critic is not None:
        values = critic_forward(models.critic, mb, autocast=models.autocast)
        outputs.values = values.to(logprobs.device)  # the critic may sit on another device
    return hooks.compute_loss(mb.to(logprobs.device), outputs, context)


def update(
    learner: Learner,
    hooks: Hooks,
    requirements: AlgorithmRequirements,
    mode: DataMode,
    batch: RolloutBatch,
    step: int,
) -> dict[str, float]:
    """Train on one step's batch; returns its metrics.

    ``loss`` is each optimizer step's loss (the sum of its micro-batches' shares), averaged over
    the step's optimizer steps; the algorithm's metrics are averaged over micro-batches weighted
    by their samples, then over optimizer steps; ``lr`` is the learning rate the optimizer steps
    used (averaged over them).
    """
    cfg = learner.cfg
    mode.check(batch, step)
    units = mode.units(batch.size)
    minibatch = cfg.minibatch_size or batch.size
    sums: dict[str, list[float]] = defaultdict(list)
    generator = torch.Generator().manual_seed(abs(learner.seed) * 100_003 + step)
    actor_params, critic_params = learner.actor_parameters, learner.critic_parameters
    learner.models.actor.train()
    algorithm = hooks.algorithm
    for epoch in range(cfg.epochs):
        order = units
        if cfg.epochs > 1 or minibatch < batch.size:
            order = [units[i] for i in torch.randperm(len(units), generator=generator).tolist()]
        for mb_index in split_units(order, minibatch):
            learner.optimizer.zero_grad(set_to_none=True)
            micros = split_units(mode.units(len(mb_index)), cfg.micro_batch_size)
            context = batch.select(mb_index).loss_context(micro_batches=len(micros))
            step_loss = 0.0
            weighted: dict[str, float] = defaultdict(float)
            for micro in micros:
                index = [mb_index[i] for i in micro]
                loss, metrics = micro_step(learner, hooks, requirements, batch, index, context)
                if not torch.isfinite(loss.detach()).all():
                    raise RunError(
                        f"step {step}: algorithm {algorithm!r} returned a non-finite loss "
                        f"({float(loss.detach())}) in epoch {epoch}; stopping (the last "
                        "checkpoint is kept)"
                    )
                loss.backward()
                step_loss += float(loss.detach())
                share = len(index) / len(mb_index)
                for k, v in metrics.items():
                    weighted[k] += share * v
            sums[canonical.LOSS].append(step_loss)
            for k, v in weighted.items():
                sums[k].append(v)
            norms = {"actor": _clip(actor_params, cfg.max_grad_norm)}
            if critic_params:
                norms["critic"] = _clip(critic_params, cfg.max_grad_norm)
            for role, norm in norms.items():
                if not math.isfinite(norm):  # stepping would write NaN into the weights
                    raise RunError(
                        f"step {step}: the {role}'s gradient norm is {norm} (algorithm "
                        f"{algorithm!r}, epoch {epoch}); stopping before the optimizer step "
                        "(the last checkpoint is kept)"
                    )
                sums[f"{role}/grad_norm"].append(norm)
            sums[canonical.LR].append(learner.lr)
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
