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
from dataclasses import replace

import torch

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.config.schema import RolloutCorrection, TrainingConfig
from alignzoo.engine.forward import critic_forward, outside_support, policy_forward
from alignzoo.engine.hooks import Hooks, implementers
from alignzoo.engine.learner import Learner
from alignzoo.engine.modes import DataMode
from alignzoo.engine.prepare import behaviour_metrics, mask_outside_support
from alignzoo.errors import RunError
from alignzoo.ops import rollout_is_weights, truncates
from alignzoo.types import AlgorithmRequirements, LossContext


def apply_rollout_correction(batch: RolloutBatch, cfg: RolloutCorrection, hooks: Hooks) -> None:
    """Set ``batch.rollout_is_weights`` from its ``old_logprobs`` and ``rollout_logprobs``
    (``training.rollout_correction``; nothing when its level is off)."""
    if cfg.level == "off" or batch.old_logprobs is None:
        return
    if batch.rollout_logprobs is None:
        backend = implementers(hooks.pm, "generate")
        raise RunError(
            f"training.rollout_correction (level {cfg.level}) needs the sampling log-probs, and "
            f"the backend {backend!r} returned none (batch.rollout_logprobs); turn the "
            "correction off or use a backend that records them"
        )
    batch.rollout_is_weights = rollout_is_weights(
        batch.old_logprobs, batch.rollout_logprobs, batch.response_mask, cfg.cap, cfg.level
    )


class FusedSnapshot:
    """The behaviour snapshot taken from the update's own forward passes.

    When a batch is trained on once, in one optimizer step, every micro-batch's forward pass
    runs on the weights before the update, with dropout off: its detached log-probs and entropy
    *are* the behaviour snapshot, so the separate no-grad pass of :func:`prepare` is skipped
    (one forward pass fewer per step, as TRL does with one iteration per generation). Each
    micro-batch records its rows; :meth:`finish` fills ``old_logprobs`` / ``entropy`` of the
    whole batch and returns the same canonical metrics :func:`prepare` would.
    """

    def __init__(self, batch: RolloutBatch, generated: bool) -> None:
        shape = tuple(batch.response_ids.shape)
        self.generated = generated
        self.logprobs = torch.zeros(shape)
        self.entropy = torch.zeros(shape)
        self.seen = torch.zeros(shape[0], dtype=torch.bool)
        self.outside = torch.zeros(shape, dtype=torch.bool)  # tokens outside the support

    def record(self, index: list[int], logprobs: torch.Tensor, entropy: torch.Tensor) -> None:
        """Keep micro-batch ``index``'s detached log-probs and entropy ``[b, R]``."""
        rows = torch.as_tensor(index, dtype=torch.long)
        if bool(self.seen[rows].any()):
            raise RuntimeError("FusedSnapshot: a row was recorded twice (more than one pass)")
        self.logprobs[rows] = logprobs.detach().float().cpu()
        self.entropy[rows] = entropy.detach().float().cpu()
        self.seen[rows] = True

    def finish(self, batch: RolloutBatch) -> dict[str, float]:
        """Fill the batch's behaviour fields; the canonical metrics of :func:`prepare`."""
        if not bool(self.seen.all()):
            raise RuntimeError("FusedSnapshot: some rows were never trained on")
        counted = mask_outside_support(batch, self.outside)
        if self.generated:
            batch.old_logprobs = self.logprobs
        batch.entropy = self.entropy
        return {**behaviour_metrics(self.logprobs, self.entropy, batch), **counted}


def global_context(context: LossContext) -> LossContext:
    """The optimizer step's counts over every rank (this rank's own in one process)."""
    if not distributed.active():
        return context
    local = torch.tensor([context.tokens, context.sequences, context.groups], dtype=torch.float64)
    tokens, sequences, groups = distributed.all_sum(local).tolist()
    return replace(context, tokens=tokens, sequences=int(sequences), groups=int(groups))


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
    snapshot: FusedSnapshot | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward one micro-batch with gradients and call ``compute_loss`` with the step's context.

    With a ``snapshot``, this forward pass is also the behaviour snapshot: its detached
    log-probs become the micro-batch's ``old_logprobs`` (importance ratio exactly 1)."""
    models = learner.models
    mb = step_batch.select(index)
    logprobs, entropy = policy_forward(
        learner.actor_module,
        mb,
        entropy=requirements.entropy,
        autocast=models.autocast,
        detached_entropy=snapshot is not None,
    )
    if truncates(mb.sampling):  # a token the sampler kept and this pass cuts: not trained on
        fill = mb.old_logprobs if mb.old_logprobs is not None else 0.0
        logprobs, outside = outside_support(logprobs, mb.response_mask, fill)
        if bool(outside.any()):
            keep = (~outside).to(device=mb.response_mask.device, dtype=mb.response_mask.dtype)
            mb.response_mask = mb.response_mask * keep
        if snapshot is not None:
            snapshot.outside[torch.as_tensor(index, dtype=torch.long)] = outside.cpu()
    if snapshot is not None:
        assert entropy is not None
        snapshot.record(index, logprobs, entropy)
        if snapshot.generated:
            mb.old_logprobs = logprobs.detach().float()
            apply_rollout_correction(mb, learner.cfg.rollout_correction, hooks)
    outputs = PolicyOutputs(logprobs=logprobs, entropy=entropy if requirements.entropy else None)
    if models.critic is not None:
        values = critic_forward(learner.critic_module, mb, autocast=models.autocast)
        outputs.values = values.to(logprobs.device)  # the critic may sit on another device
    return hooks.compute_loss(mb.to(logprobs.device), outputs, context)


def update(
    learner: Learner,
    hooks: Hooks,
    requirements: AlgorithmRequirements,
    mode: DataMode,
    batch: RolloutBatch,
    step: int,
    fused: bool = False,
) -> dict[str, float]:
    """Train on one step's batch (its advantages computed); returns its metrics.

    The rollout correction's importance weights (``training.rollout_correction``) are set
    first. ``fused``: take the behaviour snapshot from this update's forward passes (a
    :class:`FusedSnapshot`, only valid for one epoch and one optimizer step, see
    :func:`fuses_behaviour`; each micro-batch's correction is then set from its own pass); its
    canonical metrics are returned with the rest.

    ``loss`` is each optimizer step's loss (the sum of its micro-batches' shares), averaged over
    the step's optimizer steps; the algorithm's metrics are averaged over micro-batches weighted
    by their samples, then over optimizer steps; ``lr`` is the learning rate the optimizer steps
    used (averaged over them).
    """
    cfg = learner.cfg
    mode.check(batch, step)
    snapshot = FusedSnapshot(batch, generated=mode.online) if fused else None
    if snapshot is None:  # fused: each micro-batch's weights are set with its old_logprobs
        apply_rollout_correction(batch, cfg.rollout_correction, hooks)
    units = mode.units(batch.size)
    minibatch = cfg.minibatch_size or batch.size
    sums: dict[str, list[float]] = defaultdict(list)
    generator = torch.Generator().manual_seed(abs(learner.seed) * 100_003 + step)
    actor_params, critic_params = learner.actor_parameters, learner.critic_parameters
    learner.models.actor.train()
    algorithm = hooks.algorithm
    if snapshot is not None and (cfg.epochs > 1 or minibatch < batch.size):
        raise RuntimeError("a fused behaviour snapshot needs one epoch and one optimizer step")
    for epoch in range(cfg.epochs):
        order = units
        if cfg.epochs > 1 or minibatch < batch.size:
            order = [units[i] for i in torch.randperm(len(units), generator=generator).tolist()]
        for mb_index in split_units(order, minibatch):
            learner.optimizer.zero_grad(set_to_none=True)
            micros = split_units(mode.units(len(mb_index)), cfg.micro_batch_size)
            distributed.all_equal(len(micros), f"the micro-batches of step {step}")
            context = global_context(batch.select(mb_index).loss_context(len(micros)))
            step_loss = 0.0
            weighted: dict[str, float] = defaultdict(float)
            for micro in micros:
                index = [mb_index[i] for i in micro]
                loss, metrics = micro_step(
                    learner, hooks, requirements, batch, index, context, snapshot
                )
                if not torch.isfinite(loss.detach()).all():
                    raise RunError(
                        f"step {step}: algorithm {algorithm!r} returned a non-finite loss "
                        f"({float(loss.detach())}) in epoch {epoch}; stopping (the last "
                        "checkpoint is kept)"
                    )
                # DDP averages the ranks' gradients; each rank's loss is its share of the
                # global batch's, so the sum of the shares is what the step must follow.
                (loss * learner.gradient_scale).backward()
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
    out = {k: sum(v) / len(v) for k, v in sums.items()}
    if snapshot is not None:
        out.update(snapshot.finish(batch))
    return out


def fuses_behaviour(
    cfg: TrainingConfig,
    requirements: AlgorithmRequirements,
    mode: DataMode,
    hooks: Hooks,
    dropout_off: bool,
    overlapping: bool,
) -> bool:
    """Whether an arm's update can be its own behaviour snapshot (:class:`FusedSnapshot`).

    Only when that gives the very numbers of a separate pass: ``training.fuse_behaviour`` on;
    one epoch and one optimizer step per batch (so no update happens before a micro-batch's
    forward); dropout off (train and eval mode agree); the trained batch is the collected
    one (no batch transform, a mode whose ``select`` keeps every sample); advantages that do
    not read ``old_logprobs``; and no labeling overlap (which snapshots at generation time).
    """
    one_step = cfg.epochs == 1 and (
        cfg.minibatch_size is None or cfg.minibatch_size >= mode.step_sizes(cfg)[1]
    )
    keeps_batch = type(mode).select is DataMode.select and not hooks.transforms_batch
    return (
        cfg.fuse_behaviour
        and one_step
        and dropout_off
        and keeps_batch
        and not requirements.old_logprobs_in_advantages
        and not overlapping
    )


def _clip(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the gradient norm (if asked) and return the norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    limit = max_norm if max_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(grads, limit)
    full = getattr(norm, "full_tensor", None)  # FSDP2: the norm over every rank's shards
    return float(full() if callable(full) else norm)
