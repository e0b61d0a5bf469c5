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
from alignzoo.config.schema import RolloutCorrection
from alignzoo.engine.behaviour import Behaviour, UpdatePasses
from alignzoo.engine.hooks import Hooks, implementers
from alignzoo.engine.learner import Learner
from alignzoo.engine.modes import DataMode
from alignzoo.engine.refsync import syncs_done
from alignzoo.engine.scoring import packing_of
from alignzoo.errors import RunError
from alignzoo.kernels import trace as decode_trace
from alignzoo.kernels.forward import (
    AutocastFactory,
    critic_forward,
    evaluating,
    outside_support,
    policy_forward_with_logits,
    policy_outputs,
    response_logits,
)
from alignzoo.kernels.packing import Packing, padding_fraction
from alignzoo.ops import (
    global_masked_mean,
    masked_kl_penalty,
    rollout_is_weights,
    rollout_log_ratio,
    truncates,
)
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
        batch.old_logprobs,
        batch.rollout_logprobs,
        batch.response_mask,
        cfg.cap,
        cfg.level,
        cfg.mode,
    )


def correction_metrics(batch: RolloutBatch, cfg: RolloutCorrection) -> dict[str, float]:
    """The rollout correction's weights over the step's batch (its ``old_logprobs`` filled):
    ``rollout/is_weight_mean`` and ``_max`` (after truncation or masking) and
    ``rollout/is_clipped``, the share of tokens whose ratio exceeded the cap (truncated, or
    masked out). Nothing when the correction is off."""
    if cfg.level == "off" or batch.old_logprobs is None or batch.rollout_logprobs is None:
        return {}
    mask = batch.response_mask
    old, sampled = batch.old_logprobs.to(mask.device), batch.rollout_logprobs.to(mask.device)
    weights = rollout_is_weights(old, sampled, mask, cfg.cap, cfg.level, cfg.mode)
    over = (rollout_log_ratio(old, sampled, mask, cfg.level) > math.log(cfg.cap)) & mask.bool()
    largest = float(weights.max()) if weights.numel() else 0.0
    return {
        canonical.ROLLOUT_IS_WEIGHT_MEAN: float(global_masked_mean(weights, mask)),
        canonical.ROLLOUT_IS_WEIGHT_MAX: distributed.all_max(largest),
        canonical.ROLLOUT_IS_CLIPPED: float(global_masked_mean(over.float(), mask)),
    }


def behaviour_distance(batch: RolloutBatch) -> dict[str, float]:
    """``rollout/kl_behaviour``: KL(pi_rollout || pi_old) per token (k3 on the sampled tokens)
    between the weights that sampled the batch and those that train on it (an asynchronous
    arm's samples may be several steps old). Nothing without the sampling log-probs."""
    if batch.old_logprobs is None or batch.rollout_logprobs is None:
        return {}
    mask = batch.response_mask
    sampled, current = batch.rollout_logprobs.to(mask.device), batch.old_logprobs.to(mask.device)
    kl = masked_kl_penalty(sampled, current, mask, "k3")
    return {canonical.ROLLOUT_KL_BEHAVIOUR: float(global_masked_mean(kl, mask))}


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


@torch.no_grad()
def frozen_logits(
    model: torch.nn.Module | None,
    batch: RolloutBatch,
    autocast: AutocastFactory,
    packing: Packing | None,
) -> torch.Tensor:
    """A frozen model's (the teacher's) response logits ``[B, R, V]``, in eval mode."""
    if model is None:
        raise RunError("the algorithm asks for the teacher's logits and the arm loaded no teacher")
    with evaluating(model):
        return response_logits(model, batch, autocast, packing).detach()


def micro_step(
    learner: Learner,
    hooks: Hooks,
    requirements: AlgorithmRequirements,
    step_batch: RolloutBatch,
    index: list[int],
    context: LossContext,
    passes: UpdatePasses,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward one micro-batch with gradients and call ``compute_loss`` with the step's context.

    The pass is reported to ``passes`` before the loss (when it is the behaviour snapshot, the
    micro-batch's ``old_logprobs`` are its detached log-probs: importance ratio exactly 1);
    the rollout correction of a micro-batch whose behaviour log-probs came only now is set
    from them."""
    models = learner.models
    mb = step_batch.select(index)
    packing = packing_of(learner.cfg)
    logits = teacher_logits = None
    if requirements.teacher_logits:  # a divergence over the vocabulary: both whole logits
        token, logits = policy_forward_with_logits(
            learner.actor_module,
            mb,
            entropy=requirements.entropy,
            autocast=models.autocast,
            detached_entropy=passes.needs_entropy,
            packing=packing,
            log_sum_sq_probs=requirements.log_sum_sq_probs,
        )
        teacher_logits = frozen_logits(models.teacher, mb, models.autocast, packing)
    else:
        token = policy_outputs(
            learner.actor_module,
            mb,
            entropy=requirements.entropy,
            autocast=models.autocast,
            detached_entropy=passes.needs_entropy,
            packing=packing,
            log_sum_sq_probs=requirements.log_sum_sq_probs,
        )
    logprobs, entropy = token.logprobs, token.entropy
    outside = None
    if truncates(mb.sampling):  # a token the sampler kept and this pass cuts: not trained on
        fill = mb.old_logprobs if mb.old_logprobs is not None else 0.0
        logprobs, outside = outside_support(logprobs, mb.response_mask, fill)
        if bool(outside.any()):
            keep = (~outside).to(device=mb.response_mask.device, dtype=mb.response_mask.dtype)
            mb.response_mask = mb.response_mask * keep
    passes.record(mb, index, logprobs, entropy, outside)
    if mb.rollout_is_weights is None:
        apply_rollout_correction(mb, learner.cfg.rollout_correction, hooks)
    outputs = PolicyOutputs(
        logprobs=logprobs,
        entropy=entropy if requirements.entropy else None,
        logits=logits,
        teacher_logits=None if teacher_logits is None else teacher_logits.to(logprobs.device),
        log_sum_sq_probs=token.log_sum_sq_probs,
    )
    if models.critic is not None:
        values = critic_forward(
            learner.critic_module, mb, autocast=models.autocast, packing=packing
        )
        outputs.values = values.to(logprobs.device)  # the critic may sit on another device
    loss, metrics = hooks.compute_loss(mb.to(logprobs.device), outputs, context)
    return loss, {**metrics, canonical.PADDING_FRAC: padding_fraction(mb, packing)}


def update(
    learner: Learner,
    hooks: Hooks,
    requirements: AlgorithmRequirements,
    mode: DataMode,
    batch: RolloutBatch,
    step: int,
    behaviour: Behaviour,
) -> dict[str, float]:
    """Train on one step's batch (its advantages computed); returns its metrics.

    The rollout correction's importance weights (``training.rollout_correction``) are set
    first from the batch's behaviour log-probs; each forward pass is reported to what
    ``behaviour`` asks of the update (:meth:`~alignzoo.engine.behaviour.Behaviour.during_update`),
    whose metrics are returned with the rest. Every optimizer step advances the learner's
    policy version by one.

    With ``training.sync_ref_model`` an optimizer step may end with the reference's sync
    (:meth:`~alignzoo.engine.learner.Learner.step`); ``reference/syncs`` counts them so far.

    ``loss`` is each optimizer step's loss (the sum of its micro-batches' shares), averaged over
    the step's optimizer steps; the algorithm's metrics are averaged over micro-batches weighted
    by their samples, then over optimizer steps; ``lr`` is the learning rate the optimizer steps
    used (averaged over them).
    """
    cfg = learner.cfg
    mode.check(batch, step)
    passes = behaviour.during_update(batch, learner)
    apply_rollout_correction(batch, cfg.rollout_correction, hooks)
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
            distributed.all_equal(len(micros), f"the micro-batches of step {step}")
            context = global_context(batch.select(mb_index).loss_context(len(micros)))
            step_loss = 0.0
            weighted: dict[str, float] = defaultdict(float)
            for micro in micros:
                index = [mb_index[i] for i in micro]
                loss, metrics = micro_step(
                    learner, hooks, requirements, batch, index, context, passes
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
            decode_trace.release()  # recorded with the weights this step changes
            learner.step()
    out = {k: sum(v) / len(v) for k, v in sums.items()}
    out.update(passes.finish(batch))
    out.update(correction_metrics(batch, cfg.rollout_correction))
    if cfg.async_ is not None:
        out.update(behaviour_distance(batch))
    if cfg.sync_ref_model:  # a moving reference: its syncs so far (the last may be this step's)
        out[canonical.REFERENCE_SYNCS] = float(syncs_done(cfg, learner.version))
    return out


def _clip(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the gradient norm (if asked) and return the norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    limit = max_norm if max_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(grads, limit)
    full = getattr(norm, "full_tensor", None)  # FSDP2: the norm over every rank's shards
    return float(full() if callable(full) else norm)
