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

from dataclasses import dataclass
from typing import Literal

import torch

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import RolloutCorrection
from alignzoo.engine.forward import (
    chunks,
    critic_forward,
    evaluating,
    no_grad_map,
    policy_forward,
    sequence_logprob,
)
from alignzoo.engine.hooks import Hooks, implementers
from alignzoo.engine.models import Models
from alignzoo.errors import RunError
from alignzoo.ops import global_masked_mean, masked_kl_penalty, rollout_is_weights


@dataclass
class Scorer:
    """No-grad forward passes of the run's models over a batch, ``micro_batch_size`` at a time."""

    models: Models
    micro_batch_size: int

    @torch.no_grad()
    def behaviour(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's per-token log-probs and entropy ``[B, R]`` (CPU, fp32)."""
        actor, autocast = self.models.actor, self.models.autocast
        logprobs, entropy = [], []
        with evaluating(actor):
            for index in chunks(batch.size, self.micro_batch_size):
                lp, ent = policy_forward(
                    actor, batch.select(index), entropy=True, autocast=autocast
                )
                assert ent is not None
                logprobs.append(lp.detach().float().cpu())
                entropy.append(ent.detach().float().cpu())
        return torch.cat(logprobs), torch.cat(entropy)

    def reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The frozen reference's per-token log-probs ``[B, R]``."""
        reference, autocast = self.models.reference, self.models.autocast
        assert reference is not None
        return no_grad_map(
            lambda b: policy_forward(reference, b, autocast=autocast)[0],
            batch,
            self.micro_batch_size,
        )

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """The critic's values ``[B, R]`` (without dropout, like the behaviour log-probs)."""
        critic, autocast = self.models.critic, self.models.autocast
        assert critic is not None
        with evaluating(critic):
            return no_grad_map(
                lambda b: critic_forward(critic, b, autocast=autocast), batch, self.micro_batch_size
            )

    def sequence_logprobs(
        self, batch: RolloutBatch, role: Literal["actor", "ref"] = "actor"
    ) -> torch.Tensor:
        """Sum of response log-probs per sample ``[B]`` under the actor or the reference."""
        model = self.models.actor if role == "actor" else self.models.reference
        assert model is not None
        with evaluating(model):
            return no_grad_map(
                lambda b: sequence_logprob(model, b, self.models.autocast),
                batch,
                self.micro_batch_size,
            )


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


def prepare(
    scorer: Scorer, batch: RolloutBatch, generated: bool, behaviour: bool = True
) -> dict[str, float]:
    """Fill the batch's frozen views; returns the canonical ``kl/ref`` and ``entropy``.

    ``generated``: the batch was sampled by the policy, so the behaviour log-probs become
    ``batch.old_logprobs``. For offline rows they are used for the metrics only.
    ``behaviour=False`` leaves the actor's pass to the update (a :class:`FusedSnapshot`): the
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
    if generated:
        batch.old_logprobs = logprobs
    batch.entropy = entropy
    return behaviour_metrics(logprobs, entropy, batch)


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
        if self.generated:
            batch.old_logprobs = self.logprobs
        batch.entropy = self.entropy
        return behaviour_metrics(self.logprobs, self.entropy, batch)
