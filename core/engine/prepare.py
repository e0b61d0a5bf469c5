"""The scoring stage between labeling and advantages: no-grad forward passes over the batch.

In micro-batches and in eval mode (no dropout), at the *behaviour snapshot* (the weights
before the step's update): the actor's log-probs of the sampled tokens (``old_logprobs``, so
the importance ratio of the first epoch is exactly 1) and its per-token entropy, the
reference log-probs and the critic's values. The canonical ``kl/ref`` and ``entropy`` metrics
(:mod:`alignzoo.metrics`) are computed here, one way for every arm, and, when the backend
returned its sampling log-probs, ``rollout/logprob_diff`` (the train/inference mismatch) and
the rollout correction's importance weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.forward import outside_support
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.scoring import Scorer
from alignzoo.ops import global_masked_mean, masked_kl_penalty, truncates

if TYPE_CHECKING:
    from alignzoo.engine.context import RunContext
    from alignzoo.engine.modes import Collected, DataMode


def behaviour_metrics(
    logprobs: torch.Tensor, entropy: torch.Tensor, batch: RolloutBatch
) -> dict[str, float]:
    """The canonical ``entropy`` and ``kl/ref`` of a behaviour snapshot: one way for every arm."""
    mask = batch.response_mask  # means over the tokens of the global batch (every rank's)
    metrics = {canonical.ENTROPY: float(global_masked_mean(entropy, mask))}
    if batch.ref_logprobs is not None:
        kl = masked_kl_penalty(logprobs, batch.ref_logprobs, mask, "k3")
        metrics[canonical.KL_REF] = float(global_masked_mean(kl, mask))
    if batch.rollout_logprobs is not None:  # the train/inference mismatch
        diff = (logprobs.float() - batch.rollout_logprobs.float()).abs() * mask
        metrics[canonical.ROLLOUT_LOGPROB_DIFF] = float(global_masked_mean(diff, mask))
        largest = float(diff.max()) if diff.numel() else 0.0
        metrics[canonical.ROLLOUT_LOGPROB_DIFF_MAX] = distributed.all_max(largest)
    return metrics


def prepare(
    scorer: Scorer, batch: RolloutBatch, generated: bool, behaviour: bool = True
) -> dict[str, float]:
    """Fill the batch's frozen views; returns the canonical ``kl/ref`` and ``entropy``.

    ``generated``: the batch was sampled by the policy, so the behaviour log-probs become
    ``batch.old_logprobs``. For offline rows they are used for the metrics only.
    ``behaviour=False`` leaves the actor's pass to the update (a
    :class:`~alignzoo.engine.update.FusedSnapshot`): the
    reference log-probs and critic values are filled, ``old_logprobs`` is cleared (the
    backend's sampling log-probs are not the trainer's) and no metric is returned yet.
    """
    if scorer.models.reference is not None:
        batch.ref_logprobs = scorer.reference_logprobs(batch)
    if scorer.models.critic is not None:
        batch.values = scorer.values(batch)
    if not behaviour:
        batch.old_logprobs = None
        return {}
    logprobs, entropy = scorer.behaviour(batch)
    logprobs, outside = outside_support(logprobs, batch.response_mask)
    counted = mask_outside_support(batch, outside)
    if generated:
        batch.old_logprobs = logprobs
    batch.entropy = entropy
    return {**behaviour_metrics(logprobs, entropy, batch), **counted}


def mask_outside_support(batch: RolloutBatch, outside: torch.Tensor) -> dict[str, float]:
    """Take the sampled tokens outside the trainer's truncated support (``outside`` ``[B, R]``,
    :func:`~alignzoo.engine.forward.outside_support`) out of ``batch.response_mask``; their
    count over every rank (``rollout/outside_support``) for a batch sampled with top-k or
    top-p, nothing otherwise (so an arm without them has the metrics it always had)."""
    if not truncates(batch.sampling):
        return {}
    if bool(outside.any()):
        keep = (~outside).to(device=batch.response_mask.device, dtype=batch.response_mask.dtype)
        batch.response_mask = batch.response_mask * keep
    count = distributed.all_sum(torch.tensor([float(outside.sum())], dtype=torch.float64))
    return {canonical.ROLLOUT_OUTSIDE_SUPPORT: float(count[0])}


def prepare_step(
    scorer: Scorer,
    collected: Collected,
    mode: DataMode,
    hooks: Hooks,
    context: RunContext,
    fused: bool,
    step: int,
) -> RolloutBatch | None:
    """The stage between labeling and advantages, for one step's collected batch: the no-grad
    scoring (unless the batch's behaviour snapshot was taken at generation, or the update takes
    it, ``fused``), the mode's selection, the arm's batch transforms and the mode's no-grad
    extras. Its canonical metrics go into ``collected.metrics``. None when nothing is left to
    train on (nothing collected, online pairs with no untied group, or a transform that
    filtered every sample);
    every rank has a batch of the same size (their collectives would otherwise hang)."""
    # Every sample dropped (unlabeled, or its episode failed): nothing to score. Every rank
    # agrees first, so none runs the scoring passes' collectives while another skips them.
    empty = collected.batch.size == 0
    distributed.all_equal(int(empty), f"whether step {step}'s batch is empty")
    if empty:
        return None
    if not collected.behaviour_taken:
        behaviour = prepare(scorer, collected.batch, generated=mode.online, behaviour=not fused)
        collected.metrics.update(behaviour)
    batch = mode.select(collected.batch, collected.metrics)
    if batch is not None:
        batch = hooks.transform_batch(batch, context)
    distributed.all_equal(batch.size if batch is not None else 0, f"step {step}'s batch size")
    if batch is None or batch.size == 0:
        return None
    return mode.prepare(batch, scorer)
