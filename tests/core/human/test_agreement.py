"""Krippendorff's alpha against the published example, pairwise agreement, and the filter
that keeps what at least two annotators agree on."""

from __future__ import annotations

import math

import pytest

from alignzoo.human.agreement import consensus, krippendorff_alpha, pair_agreement

# Krippendorff (2011), "Computing Krippendorff's Alpha-Reliability": 4 observers, 12 units,
# None where an observer gave no value. The paper's results: nominal 0.743, interval 0.849.
_ = None
OBSERVERS = [
    [1, 2, 3, 3, 2, 1, 4, 1, 2, _, _, _],
    [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, _, 3],
    [_, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, _],
    [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, _],
]
UNITS = [[observer[u] for observer in OBSERVERS] for u in range(12)]


def test_alpha_reproduces_krippendorffs_worked_example() -> None:
    assert krippendorff_alpha(UNITS, "nominal") == pytest.approx(0.743, abs=5e-4)
    assert krippendorff_alpha(UNITS, "interval") == pytest.approx(0.849, abs=5e-4)


def test_alpha_is_one_for_perfect_agreement_and_nan_without_variation() -> None:
    assert krippendorff_alpha([[1, 1], [3, 3, None], [5, 5, 5]]) == pytest.approx(1.0)
    assert math.isnan(krippendorff_alpha([[2, 2], [2, 2]]))  # nothing to agree on
    assert math.isnan(krippendorff_alpha([[1], [None, 4]]))  # nothing pairable


def test_pair_agreement_counts_annotator_pairs() -> None:
    # Item 1: A, A, B (1 of 3 pairs agree); item 2: tie, tie (1 of 1); item 3: one choice only.
    items = [[1, 1, 0], [0.5, 0.5, None], [1]]
    out = pair_agreement(items)
    assert out["pairs"] == 4 and out["raw"] == pytest.approx(2 / 4)
    assert out["alpha"] == pytest.approx(krippendorff_alpha(items, "nominal"))
    assert math.isnan(pair_agreement([[1], [0]])["raw"])


@pytest.mark.parametrize(
    ("values", "kept", "value", "reason"),
    [
        ([4, 5], True, (0.75 + 1.0) / 2, ""),  # 0.25 apart on [1, 5] mapped to [0, 1]
        ([1, 5], False, None, "disagreement"),
        ([2, 5, 2], True, 0.25, ""),  # two of three agree; the third is left out
        ([3, None, None], False, None, "too few judgements"),  # cannot judge is no value
        ([4, 3], False, None, "disagreement"),  # 0.25 apart, and agreeing needs < 0.25 here
    ],
)
def test_the_filter_keeps_items_two_annotators_agree_on(values, kept, value, reason) -> None:
    tolerance = 0.25 if values == [4, 3] else 0.3
    verdict = consensus(values, 1, 5, min_agree=2, tolerance=tolerance)
    assert verdict.kept is kept and verdict.reason == reason
    if kept:
        assert verdict.value == pytest.approx(value) and verdict.agreeing >= 2
