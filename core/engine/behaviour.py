"""The behaviour policy: what the policy that sampled a batch assigned to its tokens.

A batch's *behaviour snapshot* is computed on the weights that sampled it (before the update
that trains on it), without dropout: the actor's log-probs of the sampled tokens
(``old_logprobs``, so the importance ratio of the first epoch is exactly 1) and its per-token
``entropy``, with the reference's log-probs and the critic's values beside them, under the
distribution each sample was drawn from. Its canonical metrics are computed here, one way for
every arm: ``entropy``, ``kl/ref``, ``rollout/logprob_diff`` (when the backend recorded its
sampling log-probs) and ``rollout/outside_support`` (a sampled token the trainer's truncated
distribution cuts is masked out of the loss and counted).

One :class:`Behaviour` strategy per run, chosen at assembly (:func:`choose_behaviour`), fills
the snapshot once per batch, at the one point of the step where it is valid:

=================== ================================================ ==========================
strategy            the snapshot is                                  when
=================== ================================================ ==========================
:class:`AtGeneration`  a no-grad pass as the batch is generated      ``labeling.overlap``: the
                                                                     batch trains a step later
:class:`SeparatePass`  a no-grad pass before the mode selects        otherwise
:class:`FusedWithUpdate` the update's own forward passes             one epoch, one optimizer
                                                                     step (:func:`fuses_behaviour`)
=================== ================================================ ==========================

Every stage calls every strategy at its own point and never asks which one runs: the collector
calls :meth:`Behaviour.at_collection` on each batch it produces, the prepare stage
:meth:`Behaviour.before_update` on the collected batch, and the update
:meth:`Behaviour.during_update` for the :class:`UpdatePasses` its forward passes report to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.modes import DataMode
from alignzoo.engine.scoring import Scorer
from alignzoo.kernels.forward import outside_support
from alignzoo.ops import global_masked_mean, masked_kl_penalty, truncates

if TYPE_CHECKING:
    from alignzoo.config.schema import TrainingConfig
    from alignzoo.engine.hooks import Hooks
    from alignzoo.engine.learner import Learner
    from alignzoo.types import AlgorithmRequirements


def behaviour_metrics(
    logprobs: torch.Tensor, entropy: torch.Tensor, batch: RolloutBatch
) -> dict[str, float]:
    """The canonical ``entropy`` and ``kl/ref`` of a behaviour snapshot, and the train/inference
    mismatch when the backend recorded its log-probs."""
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


def mask_outside_support(batch: RolloutBatch, outside: torch.Tensor) -> dict[str, float]:
    """Take the sampled tokens outside the trainer's truncated support (``outside`` ``[B, R]``,
    :func:`~alignzoo.kernels.forward.outside_support`) out of ``batch.response_mask``; their
    count over every rank (``rollout/outside_support``) for a batch sampled with top-k or
    top-p, nothing otherwise (so an arm without them has the metrics it always had)."""
    if not truncates(batch.sampling):
        return {}
    if bool(outside.any()):
        keep = (~outside).to(device=batch.response_mask.device, dtype=batch.response_mask.dtype)
        batch.response_mask = batch.response_mask * keep
    count = distributed.all_sum(torch.tensor([float(outside.sum())], dtype=torch.float64))
    return {canonical.ROLLOUT_OUTSIDE_SUPPORT: float(count[0])}


def frozen_views(scorer: Scorer, batch: RolloutBatch) -> None:
    """The reference's and the teacher's log-probs and the critic's values of the batch (for
    the arms that have them), at the weights of the snapshot."""
    if scorer.models.reference is not None:
        batch.ref_logprobs = scorer.reference_logprobs(batch)
    if scorer.models.teacher is not None and scorer.teacher_scores:
        batch.teacher_logprobs = scorer.teacher_logprobs(batch)
    if scorer.models.critic is not None:
        batch.values = scorer.values(batch)


def snapshot(scorer: Scorer, batch: RolloutBatch, generated: bool) -> dict[str, float]:
    """The whole behaviour snapshot by no-grad passes, filled into ``batch``; its metrics.

    ``generated``: the policy sampled the batch, so its log-probs become ``old_logprobs``; for
    dataset rows they only give the metrics."""
    frozen_views(scorer, batch)
    logprobs, entropy = scorer.behaviour(batch)
    logprobs, outside = outside_support(logprobs, batch.response_mask)
    counted = mask_outside_support(batch, outside)
    if generated:
        batch.old_logprobs = logprobs
    batch.entropy = entropy
    return {**behaviour_metrics(logprobs, entropy, batch), **counted}


class UpdatePasses:
    """What the update's forward passes tell the behaviour policy: nothing, unless they are the
    snapshot (:class:`FusedSnapshot`)."""

    needs_entropy = False
    """Whether each pass must also compute the (detached) entropy, for the snapshot."""

    def record(
        self,
        micro_batch: RolloutBatch,
        index: list[int],
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        outside: torch.Tensor | None,
    ) -> None:
        """Micro-batch ``index``'s pass, before its loss: its log-probs and entropy ``[b, R]``
        and its tokens outside the support (None when it samples without top-k / top-p)."""

    def finish(self, batch: RolloutBatch) -> dict[str, float]:
        """After the update: the snapshot's metrics, if the passes were the snapshot."""
        return {}


class FusedSnapshot(UpdatePasses):
    """The behaviour snapshot taken from the update's own forward passes.

    When a batch is trained on once, in one optimizer step, every micro-batch's forward pass
    runs on the weights that sampled it, with dropout off: its detached log-probs and entropy
    *are* the snapshot, so the separate no-grad pass is skipped (one forward pass fewer per
    step, as TRL does with one iteration per generation). Each micro-batch's log-probs become
    its ``old_logprobs`` (importance ratio exactly 1) as it is recorded; :meth:`finish` fills
    ``old_logprobs`` / ``entropy`` of the whole batch and returns the metrics a separate pass
    would.
    """

    needs_entropy = True

    def __init__(self, batch: RolloutBatch, generated: bool, learner: Learner) -> None:
        shape = tuple(batch.response_ids.shape)
        self.generated = generated
        self.learner = learner
        self.version = learner.version  # every pass must run on these weights
        self.logprobs = torch.zeros(shape)
        self.entropy = torch.zeros(shape)
        self.seen = torch.zeros(shape[0], dtype=torch.bool)
        self.outside = torch.zeros(shape, dtype=torch.bool)  # tokens outside the support

    def record(
        self,
        micro_batch: RolloutBatch,
        index: list[int],
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        outside: torch.Tensor | None,
    ) -> None:
        rows = torch.as_tensor(index, dtype=torch.long)
        if bool(self.seen[rows].any()):
            raise RuntimeError("FusedSnapshot: a row was recorded twice (more than one pass)")
        if self.learner.version != self.version:
            raise RuntimeError("a fused behaviour snapshot needs one epoch and one optimizer step")
        assert entropy is not None
        self.logprobs[rows] = logprobs.detach().float().cpu()
        self.entropy[rows] = entropy.detach().float().cpu()
        if outside is not None:
            self.outside[rows] = outside.cpu()
        self.seen[rows] = True
        if self.generated:
            micro_batch.old_logprobs = logprobs.detach().float()

    def finish(self, batch: RolloutBatch) -> dict[str, float]:
        if not bool(self.seen.all()):
            raise RuntimeError("FusedSnapshot: some rows were never trained on")
        counted = mask_outside_support(batch, self.outside)
        if self.generated:
            batch.old_logprobs = self.logprobs
        batch.entropy = self.entropy
        return {**behaviour_metrics(self.logprobs, self.entropy, batch), **counted}


class Behaviour:
    """How a run fills each batch's behaviour snapshot: the base does nothing at any point; a
    strategy overrides the one point where it acts.

    ``online``: the run's batches are sampled by the policy (their log-probs become
    ``old_logprobs``), not read from a dataset."""

    def __init__(self, scorer: Scorer, online: bool) -> None:
        self.scorer = scorer
        self.online = online

    def at_collection(self, batch: RolloutBatch) -> dict[str, float]:
        """A batch as the collector produces it (for a look-ahead batch: as it is generated,
        before its labeling); the snapshot's metrics when it is taken here."""
        return {}

    def before_update(self, batch: RolloutBatch) -> dict[str, float]:
        """The step's collected batch, before the mode selects from it; metrics likewise."""
        return {}

    def during_update(self, batch: RolloutBatch, learner: Learner) -> UpdatePasses:
        """What the update's forward passes over ``batch`` report to."""
        return UpdatePasses()


class AtGeneration(Behaviour):
    """The snapshot taken as the batch is generated, by a separate no-grad pass: for a batch
    that trains a step later (``labeling.overlap``), on weights one update newer."""

    def at_collection(self, batch: RolloutBatch) -> dict[str, float]:
        return snapshot(self.scorer, batch, generated=self.online)


class SeparatePass(Behaviour):
    """The snapshot taken by a separate no-grad pass over the collected batch."""

    def before_update(self, batch: RolloutBatch) -> dict[str, float]:
        return snapshot(self.scorer, batch, generated=self.online)


class FusedWithUpdate(Behaviour):
    """The snapshot taken from the update's forward passes (:class:`FusedSnapshot`); the
    reference's and critic's passes still run before the update."""

    def before_update(self, batch: RolloutBatch) -> dict[str, float]:
        frozen_views(self.scorer, batch)
        batch.old_logprobs = None  # the backend's sampling log-probs are not the trainer's
        return {}

    def during_update(self, batch: RolloutBatch, learner: Learner) -> UpdatePasses:
        return FusedSnapshot(batch, generated=self.online, learner=learner)


def fuses_behaviour(
    cfg: TrainingConfig,
    requirements: AlgorithmRequirements,
    mode: DataMode,
    hooks: Hooks,
    dropout_off: bool,
    overlapping: bool,
) -> bool:
    """Whether an arm's update can be its own behaviour snapshot (:class:`FusedWithUpdate`).

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


def traces_decode(
    cfg: TrainingConfig, mode: DataMode, overlapping: bool, dropout_off: bool
) -> bool:
    """Whether an arm's decode loop should record its activations for the update's backward
    pass (``training.decode_trace``, :mod:`alignzoo.kernels.trace`): one epoch and one
    optimizer step per batch, so the update runs with the weights that sampled it; dropout off
    (the decode loop samples in eval mode); and no labeling overlap or producers (which
    sample the next batch before the update)."""
    one_step = cfg.epochs == 1 and (
        cfg.minibatch_size is None or cfg.minibatch_size >= mode.step_sizes(cfg)[1]
    )
    return cfg.decode_trace and one_step and dropout_off and not overlapping and cfg.async_ is None


def choose_behaviour(
    scorer: Scorer,
    cfg: TrainingConfig,
    requirements: AlgorithmRequirements,
    mode: DataMode,
    hooks: Hooks,
    dropout_off: bool,
    overlapping: bool,
) -> Behaviour:
    """The arm's strategy: at generation for an overlapping arm, fused with the update where
    :func:`fuses_behaviour` allows it, else a separate pass."""
    if overlapping:
        return AtGeneration(scorer, mode.online)
    if fuses_behaviour(cfg, requirements, mode, hooks, dropout_off, overlapping):
        return FusedWithUpdate(scorer, mode.online)
    return SeparatePass(scorer, mode.online)
