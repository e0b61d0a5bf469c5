"""No-grad forward passes of a run's models over a batch, in micro-batches and in eval mode
(no dropout): the actor's per-token log-probs and entropy, the reference's log-probs, the
critic's values and sequence log-probs. The behaviour policy (:mod:`alignzoo.engine.behaviour`)
and the data modes that need more than one pass (KTO's mismatched pairs) use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.models import Models
from alignzoo.engine.served import ServedTeacher
from alignzoo.kernels.forward import (
    chunks,
    critic_forward,
    evaluating,
    no_grad_map,
    policy_forward,
    sequence_logprob,
)
from alignzoo.kernels.packing import Packing


def packing_of(cfg: TrainingConfig) -> Packing | None:
    """How an arm's forward passes pack their micro-batches (``training.packing``), or None."""
    return Packing(cfg.packing_length) if cfg.packing else None


@dataclass
class Scorer:
    """No-grad forward passes of the run's models over a batch, ``micro_batch_size`` at a time
    (each micro-batch packed when ``packing`` is set: ``training.packing``)."""

    models: Models
    micro_batch_size: int
    packing: Packing | None = None
    teacher_scores: bool = True  # the algorithm reads batch.teacher_logprobs

    @torch.no_grad()
    def behaviour(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's per-token log-probs and entropy ``[B, R]`` (CPU, fp32)."""
        actor, autocast = self.models.actor, self.models.autocast
        logprobs, entropy = [], []
        with evaluating(actor):
            for index in chunks(batch.size, self.micro_batch_size):
                lp, ent = policy_forward(
                    actor,
                    batch.select(index),
                    entropy=True,
                    autocast=autocast,
                    packing=self.packing,
                )
                assert ent is not None
                logprobs.append(lp.detach().float().cpu())
                entropy.append(ent.detach().float().cpu())
        return torch.cat(logprobs), torch.cat(entropy)

    def reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The frozen reference's per-token log-probs ``[B, R]``, at the sampling temperature
        (without top-k / top-p: the KL term compares the tempered distributions, as TRL's)."""
        reference, autocast = self.models.reference, self.models.autocast
        assert reference is not None
        return no_grad_map(  # tempered, not truncated: KL between the tempered policies
            lambda b: policy_forward(
                reference, b, autocast=autocast, truncate=False, packing=self.packing
            )[0],
            batch,
            self.micro_batch_size,
        )

    def teacher_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The teacher's per-token log-probs of the sampled tokens ``[B, R]``, at the sampling
        temperature (as the reference's: the distributions compared are the tempered ones); a
        served teacher's from its endpoint (temperature 1 only, :mod:`alignzoo.engine.served`)."""
        teacher, autocast = self.models.teacher, self.models.autocast
        assert teacher is not None
        if isinstance(teacher, ServedTeacher):
            return teacher.logprobs(batch)
        return no_grad_map(
            lambda b: policy_forward(
                teacher, b, autocast=autocast, truncate=False, packing=self.packing
            )[0],
            batch,
            self.micro_batch_size,
        )

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """The critic's values ``[B, R]`` (without dropout, like the behaviour log-probs)."""
        critic, autocast = self.models.critic, self.models.autocast
        assert critic is not None
        with evaluating(critic):
            return no_grad_map(
                lambda b: critic_forward(critic, b, autocast=autocast, packing=self.packing),
                batch,
                self.micro_batch_size,
            )

    def sequence_logprobs(
        self,
        batch: RolloutBatch,
        role: Literal["actor", "ref"] = "actor",
        truncate: bool | None = None,
    ) -> torch.Tensor:
        """Sum of response log-probs per sample ``[B]`` under the actor or the reference, in
        the distribution ``batch.sampling`` names (``truncate``: with its top-k / top-p; by
        default for the actor, never for the reference)."""
        model = self.models.actor if role == "actor" else self.models.reference
        assert model is not None
        cut = (role == "actor") if truncate is None else truncate
        with evaluating(model):
            return no_grad_map(
                lambda b: sequence_logprob(model, b, self.models.autocast, cut, self.packing),
                batch,
                self.micro_batch_size,
            )
