"""The scoring stage between labeling and advantages: no-grad forward passes over the batch.

In micro-batches and in eval mode (no dropout), at the *behaviour snapshot* (the weights
before the step's update): the actor's log-probs of the sampled tokens (``old_logprobs``, so
the importance ratio of the first epoch is exactly 1) and its per-token entropy, the
reference log-probs and the critic's values. The canonical ``kl/ref`` and ``entropy`` metrics
(:mod:`alignzoo.metrics`) are computed here, one way for every arm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.forward import (
    chunks,
    critic_forward,
    evaluating,
    no_grad_map,
    policy_forward,
    sequence_logprob,
)
from alignzoo.engine.models import Models
from alignzoo.ops import masked_kl_penalty, masked_mean


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


def prepare(scorer: Scorer, batch: RolloutBatch, generated: bool) -> dict[str, float]:
    """Fill the batch's frozen views; returns the canonical ``kl/ref`` and ``entropy``.

    ``generated``: the batch was sampled by the policy, so the behaviour log-probs become
    ``batch.old_logprobs``. For offline rows they are used for the metrics only.
    """
    logprobs, entropy = scorer.behaviour(batch)
    if generated:
        batch.old_logprobs = logprobs
    batch.entropy = entropy
    mask = batch.response_mask
    metrics = {canonical.ENTROPY: float(masked_mean(entropy, mask))}
    if scorer.models.reference is not None:
        batch.ref_logprobs = scorer.reference_logprobs(batch)
        kl = masked_kl_penalty(logprobs, batch.ref_logprobs, mask, "k3")
        metrics[canonical.KL_REF] = float(masked_mean(kl, mask))
    if scorer.models.critic is not None:
        batch.values = scorer.values(batch)
    return metrics
