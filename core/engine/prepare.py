"""The scoring stage between labeling and advantages: what the frozen views of the batch need.

Without gradients, in micro-batches: the behaviour log-probs recomputed by the actor (so the
importance ratio of the first epoch is exactly 1), the reference log-probs, the critic's values,
and KTO's mismatched-pair reference log-probs (prompt ``i`` with the response of sample
``(i + 1) mod B``).
"""

from __future__ import annotations

from typing import Any

from alignzoo.batch import RolloutBatch
from alignzoo.engine.forward import (
    critic_forward,
    evaluating,
    mismatch_partners,
    mismatched_view,
    no_grad_map,
    policy_forward,
    sequence_logprob,
)


def prepare(engine: Any, batch: RolloutBatch, generated: bool) -> RolloutBatch:
    """Fill old_logprobs (sampled batches), ref_logprobs, values and mismatched_ref_logprobs."""
    run, ac = engine.run, engine.autocast
    micro = engine.arm.training.micro_batch_size
    if generated:
        with evaluating(run.actor):
            batch.old_logprobs = no_grad_map(
                lambda b: policy_forward(run.actor, b, autocast=ac)[0], batch, micro
            )
    if run.reference is not None:
        batch.ref_logprobs = no_grad_map(
            lambda b: policy_forward(run.reference, b, autocast=ac)[0], batch, micro
        )
    if run.critic is not None:
        with evaluating(run.critic):  # values without dropout, like the behaviour log-probs
            batch.values = no_grad_map(
                lambda b: critic_forward(run.critic, b, autocast=ac), batch, micro
            )
    return batch


def prepare_mismatched(engine: Any, batch: RolloutBatch) -> RolloutBatch:
    """KTO: reference sequence log-probs of the mismatched pairs (after batch transforms, so the
    partners are those the update stage pairs too)."""
    if not engine.requirements.mismatched_pairs:
        return batch
    run = engine.run
    view = mismatched_view(batch, batch.select(mismatch_partners(batch.size)))
    scorer = run.reference if run.reference is not None else run.actor
    with evaluating(scorer):
        batch.mismatched_ref_logprobs = no_grad_map(
            lambda b: sequence_logprob(scorer, b, engine.autocast),
            view,
            engine.arm.training.micro_batch_size,
        )
    return batch
