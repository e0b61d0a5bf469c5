"""alignzoo.testing: the property kit for plugin authors (public API).

Three modules:

- :mod:`alignzoo.testing.strategies`: hypothesis strategies that draw whole batches
  (:func:`~alignzoo.testing.strategies.batch_cases`, :func:`~alignzoo.testing.strategies.batches`)
  for an algorithm's :class:`~alignzoo.types.AlgorithmRequirements`, and the pieces they are
  made of (log-probs near 0 and very negative, masks with any right-padding, rewards, groups,
  preference pairs, unpaired labels); :func:`~alignzoo.testing.strategies.make_batch` builds a
  batch from explicit numbers for golden-value tests.
- :mod:`alignzoo.testing.contract`: the contract suite every algorithm must pass (padding
  invariance, permutation equivariance over samples and groups, finite loss and gradients at
  extreme log-probs, output types, finite float metrics).
- :mod:`alignzoo.testing.components`: the contract suites of labelers, backends, device mappers
  and modifiers (:func:`~alignzoo.testing.components.check_component`,
  :func:`~alignzoo.testing.components.assert_contract`).

In a plugin's tests::

    from alignzoo.testing import assert_algorithm_contract

    def test_contract():
        assert_algorithm_contract("my_algorithm")   # a registered name, a class or an instance

    def test_labeler_contract():
        assert_contract("labeler", MyLabeler, params={"threshold": 0.5})

On the command line: ``alignzoo check KIND NAME`` (algorithm, labeler, backend, device_mapper,
modifier).
This package imports torch and hypothesis.
"""

from __future__ import annotations

from alignzoo.testing.components import (
    KIND_CHECKS,
    assert_contract,
    check_backend,
    check_component,
    check_device_mapper,
    check_labeler,
    check_modifier,
)
from alignzoo.testing.contract import (
    CHECKS,
    CheckResult,
    assert_algorithm_contract,
    check_algorithm,
    evaluate,
)
from alignzoo.testing.strategies import (
    BatchCase,
    batch_cases,
    batches,
    extreme_logprob_values,
    group_ids,
    logprob_values,
    make_batch,
    preference_pairs,
    response_lengths,
    response_masks,
    rewards,
    unpaired_labels,
)

__all__ = [
    "CHECKS",
    "KIND_CHECKS",
    "BatchCase",
    "CheckResult",
    "assert_algorithm_contract",
    "assert_contract",
    "batch_cases",
    "batches",
    "check_algorithm",
    "check_backend",
    "check_component",
    "check_device_mapper",
    "check_labeler",
    "check_modifier",
    "evaluate",
    "extreme_logprob_values",
    "group_ids",
    "logprob_values",
    "make_batch",
    "preference_pairs",
    "response_lengths",
    "response_masks",
    "rewards",
    "unpaired_labels",
]
