"""The contract's ``direction`` check: every built-in (and its variants) moves the policy the way
its kind promises, and a copy with the loss's sign flipped, or the advantages', is caught with a
short message naming the property."""

from __future__ import annotations

from typing import Any

import pytest

from alignzoo.batch import RolloutBatch
from alignzoo.plugin import hookimpl
from alignzoo.registry import get_registry
from alignzoo.testing import check_algorithm
from alignzoo.types import LossOutput

BUILT_INS = ("dpo", "gkd", "grpo", "kto", "opd", "ppo", "reinforce_pp", "rloo", "sft", "simpo")
VARIANTS = [
    ("grpo", {"scale_rewards": "none", "loss_aggregation": "seq-mean-token-sum"}),  # Dr. GRPO-like
    ("grpo", {"importance_ratio": "sequence"}),  # GSPO
    ("grpo", {"clip_eps_high": 0.28, "loss_aggregation": "token-mean"}),  # DAPO's clip-higher
    ("dpo", {"loss_type": "ipo"}),
    ("dpo", {"loss_type": "robust", "label_smoothing": 0.1}),
    ("dpo", {"label_smoothing": 0.1}),
    ("ppo", {"kl_controller": "adaptive"}),
]


def direction(algorithm: Any) -> Any:
    [result] = [r for r in check_algorithm(algorithm, max_examples=15, checks=["direction"])
                if r.name == "direction"]  # fmt: skip
    return result


def flipped_loss(cls: type) -> type:
    class FlippedLoss(cls):  # type: ignore[misc, valid-type]
        @hookimpl
        def compute_loss(self, batch: RolloutBatch, outputs: Any, context: Any) -> LossOutput:
            out = super().compute_loss(batch, outputs, context)
            return LossOutput(-out.loss, out.metrics)

    return FlippedLoss


def flipped_advantages(cls: type) -> type:
    class FlippedAdvantages(cls):  # type: ignore[misc, valid-type]
        @hookimpl
        def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
            batch = super().compute_advantages(batch)
            batch.advantages = -batch.advantages
            return batch

    return FlippedAdvantages


@pytest.mark.parametrize("name", BUILT_INS)
def test_every_built_in_moves_the_policy_the_promised_way(name: str) -> None:
    result = direction(name)
    assert result.passed, result.detail


@pytest.mark.parametrize(("name", "params"), VARIANTS)
def test_variants_pass_too(name: str, params: dict[str, Any]) -> None:
    cls = get_registry().get("algorithm", name)
    instance = cls(params)
    result = direction(instance)
    assert result.passed, result.detail


@pytest.mark.parametrize("name", BUILT_INS)
def test_a_flipped_loss_sign_is_caught_with_a_short_message(name: str) -> None:
    result = direction(flipped_loss(get_registry().get("algorithm", name)))
    assert not result.passed
    first = result.detail.splitlines()[0]
    assert first.startswith("direction: a gradient step on the loss ")
    assert "flipped" in first
    assert len(result.detail) < 1500, result.detail  # summarised, not dumped


@pytest.mark.parametrize("name", ["grpo", "ppo", "reinforce_pp", "rloo"])
def test_flipped_advantages_are_caught(name: str) -> None:
    result = direction(flipped_advantages(get_registry().get("algorithm", name)))
    assert not result.passed
    assert "direction:" in result.detail


@pytest.mark.parametrize("name", BUILT_INS)
def test_every_built_in_declares_and_honours_sample_weights(name: str) -> None:
    cls = get_registry().get("algorithm", name)
    [result] = [r for r in check_algorithm(name, max_examples=15, checks=["weights_honoured"])
                if r.name == "weights_honoured"]  # fmt: skip
    assert result.passed and "examples" in result.detail, result.detail
    assert cls().algorithm_requirements().weights


def test_an_algorithm_that_declares_weights_but_ignores_them_is_caught() -> None:
    from alignzoo.plugins.algorithms.grpo import GRPO

    class IgnoresWeights(GRPO):
        @hookimpl
        def compute_loss(self, batch: RolloutBatch, outputs: Any, context: Any) -> LossOutput:
            batch.weights = None
            return super().compute_loss(batch, outputs, context)

    [result] = [r for r in check_algorithm(IgnoresWeights, max_examples=15,
                                           checks=["weights_honoured"])
                if r.name == "weights_honoured"]  # fmt: skip
    assert not result.passed and result.detail.startswith("weights_honoured: sample 0")


def test_weights_used_as_a_mask_are_caught() -> None:
    """A loss that keeps the weighted samples but drops their size (weights > 0 as a 0/1 mask)
    passes the weight-0 half of the property and fails the doubling half."""
    from alignzoo.plugins.algorithms.grpo import GRPO

    class MasksWeights(GRPO):
        @hookimpl
        def compute_loss(self, batch: RolloutBatch, outputs: Any, context: Any) -> LossOutput:
            if batch.weights is not None:
                batch.weights = (batch.weights > 0).to(batch.weights.dtype)
            return super().compute_loss(batch, outputs, context)

    [result] = [r for r in check_algorithm(MasksWeights, max_examples=15,
                                           checks=["weights_honoured"])
                if r.name == "weights_honoured"]  # fmt: skip
    assert not result.passed and "scaled its gradient by 1, not 2" in result.detail


def test_the_built_ins_listed_here_are_the_registrys() -> None:
    """A new built-in algorithm joins BUILT_INS (and so every direction and weights check)."""
    registered = {
        e.name
        for e in get_registry().entries()
        if e.kind == "algorithm" and e.distribution == "alignzoo"
    }
    assert registered == set(BUILT_INS)
