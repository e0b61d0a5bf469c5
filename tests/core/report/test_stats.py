"""alignzoo.report.stats agrees with scipy on known samples and degrades gracefully on edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from alignzoo.report import stats

A = [0.61, 0.58, 0.66, 0.55, 0.63]
B = [0.70, 0.74, 0.66, 0.79, 0.71]
C = [0.42, 0.47, 0.39]
D = [0.45, 0.52, 0.41, 0.49]


def test_mean_ci_matches_scipy_t_interval() -> None:
    s = stats.mean_ci(A)
    low, high = sps.t.interval(0.95, len(A) - 1, loc=np.mean(A), scale=sps.sem(A))
    assert s.n == 5
    assert s.mean == pytest.approx(np.mean(A))
    assert s.std == pytest.approx(np.std(A, ddof=1))
    assert (s.ci_low, s.ci_high) == pytest.approx((low, high))
    assert s.half_width == pytest.approx((high - low) / 2)


def test_mean_ci_one_seed_is_undefined_not_a_crash() -> None:
    s = stats.mean_ci([0.5])
    assert (s.n, s.mean, s.std, s.ci_low, s.ci_high, s.half_width) == (
        1,
        0.5,
        None,
        None,
        None,
        None,
    )


def test_mean_ci_zero_variance_collapses() -> None:
    s = stats.mean_ci([0.3, 0.3, 0.3])
    assert s.ci_low == pytest.approx(0.3) and s.ci_high == pytest.approx(0.3)


@pytest.mark.parametrize(("x", "y"), [(A, B), (C, D), (B, A), (A, C)])
def test_welch_matches_scipy(x: list[float], y: list[float]) -> None:
    expected = sps.ttest_ind(y, x, equal_var=False).pvalue
    assert stats.welch_pvalue(x, y) == pytest.approx(expected, rel=1e-9)


@pytest.mark.filterwarnings("ignore:Precision loss")
def test_welch_edge_cases() -> None:
    assert stats.welch_pvalue([0.5], [0.4, 0.6]) is None
    assert stats.welch_pvalue([0.5, 0.5], [0.5, 0.5]) == 1.0
    assert stats.welch_pvalue([0.5, 0.5], [0.7, 0.7]) == 0.0
    # Zero variance in one arm only is an ordinary (finite) test.
    expected = sps.ttest_ind([0.6, 0.7, 0.8], [0.5, 0.5, 0.5], equal_var=False).pvalue
    assert stats.welch_pvalue([0.5, 0.5, 0.5], [0.6, 0.7, 0.8]) == pytest.approx(expected)


def _diff_of_means(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


@pytest.mark.parametrize(("x", "y"), [(A, B), (C, D), (B, A), ([1.0, 2.0], [1.5, 3.0])])
def test_exact_permutation_matches_scipy(x: list[float], y: list[float]) -> None:
    ref = sps.permutation_test(
        (y, x),
        _diff_of_means,
        permutation_type="independent",
        n_resamples=np.inf,
        alternative="two-sided",
    )
    assert stats.permutation_pvalue(x, y) == pytest.approx(ref.pvalue, rel=1e-9)


def test_monte_carlo_permutation_is_close_to_exact_and_deterministic() -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(0.0, 1.0, 8)
    y = rng.normal(0.8, 1.0, 8)
    exact = sps.permutation_test(
        (y, x), _diff_of_means, permutation_type="independent", n_resamples=np.inf
    ).pvalue
    # C(16, 8) = 12870 splits > 5000 resamples: the Monte Carlo path.
    mc = stats.permutation_pvalue(x, y, n_resamples=5000, seed=3)
    assert mc == stats.permutation_pvalue(x, y, n_resamples=5000, seed=3)
    assert mc == pytest.approx(exact, abs=0.02)
    assert stats.permutation_pvalue(x, y, n_resamples=20000) == pytest.approx(exact, rel=1e-9)


def test_min_permutation_pvalue() -> None:
    assert stats.min_permutation_pvalue(2, 2) == pytest.approx(2 / 6)
    assert stats.min_permutation_pvalue(4, 4) == pytest.approx(2 / 70)
    assert stats.permutation_pvalue([0.0, 0.1], [1.0, 1.1]) == pytest.approx(2 / 6)


def test_identical_samples_permutation_is_one() -> None:
    assert stats.permutation_pvalue([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]) == 1.0
    assert stats.permutation_pvalue(A, A) == 1.0


def test_bootstrap_matches_scipy_percentile() -> None:
    ref = sps.bootstrap(
        (B, A),
        _diff_of_means,
        method="percentile",
        n_resamples=40000,
        rng=np.random.default_rng(0),
    ).confidence_interval
    low, high = stats.bootstrap_diff_ci(A, B, n_resamples=40000)
    assert low == pytest.approx(ref.low, abs=0.004)
    assert high == pytest.approx(ref.high, abs=0.004)
    assert low < np.mean(B) - np.mean(A) < high


def test_bootstrap_by_hand() -> None:
    # Two values per arm: the resampled means take 3 values each, with probabilities 1/4, 1/2,
    # 1/4; so the difference [1,3] - [0,0] has the 2.5% and 97.5% percentiles 1 and 3.
    low, high = stats.bootstrap_diff_ci([0.0, 0.0], [1.0, 3.0], n_resamples=20000)
    assert (low, high) == (1.0, 3.0)


def test_bootstrap_edge_cases() -> None:
    assert stats.bootstrap_diff_ci([0.5], [0.6, 0.7]) is None
    assert stats.bootstrap_diff_ci([0.5, 0.5], [0.5, 0.5]) == (0.0, 0.0)
    assert stats.bootstrap_diff_ci(A, B) == stats.bootstrap_diff_ci(A, B)


def test_cohens_d_by_hand() -> None:
    sp = math.sqrt(
        ((len(A) - 1) * np.var(A, ddof=1) + (len(B) - 1) * np.var(B, ddof=1))
        / (len(A) + len(B) - 2)
    )
    assert stats.cohens_d(A, B) == pytest.approx((np.mean(B) - np.mean(A)) / sp)
    assert stats.cohens_d(B, A) == pytest.approx(-(np.mean(B) - np.mean(A)) / sp)
    assert stats.cohens_d([1.0, 1.0], [2.0, 2.0]) is None
    assert stats.cohens_d([1.0], [2.0]) is None


def test_power_agrees_with_simulation_free_reference() -> None:
    # d = 1, n = 17 per arm is the textbook ~80% power design.
    assert stats.t_test_power(1.0, 17) == pytest.approx(0.807, abs=0.005)
    assert stats.t_test_power(1.0, 16) < 0.8 < stats.t_test_power(1.0, 17)
    assert stats.t_test_power(0.5, 64) == pytest.approx(0.801, abs=0.005)


def test_seeds_needed_is_the_smallest_n_with_80_percent_power() -> None:
    n = stats.seeds_needed(A, B)
    d = abs(stats.cohens_d(A, B))
    assert n is not None and n >= 2
    assert stats.t_test_power(d, n) >= 0.8
    if n > 2:
        assert stats.t_test_power(d, n - 1) < 0.8
    # A medium effect needs more seeds than a large one.
    assert stats.seeds_needed([0.0, 1.0, 2.0], [0.5, 1.5, 2.5]) > stats.seeds_needed(A, B)


def test_seeds_needed_edge_cases() -> None:
    assert stats.seeds_needed(A, A) is None
    assert stats.seeds_needed([0.5, 0.5], [0.5, 0.5]) is None
    assert stats.seeds_needed([0.5, 0.5], [0.6, 0.6]) == 2
    assert stats.seeds_needed([0.5], [0.6]) is None


def test_compare_detects_better_and_worse_with_direction() -> None:
    up = stats.compare(A, B, arm="new", baseline="old", metric="eval/exact_match")
    assert up.verdict == "better"
    assert up.test == "permutation test"  # 5 vs 5 seeds can reach 0.05 exactly
    assert "new is better than old" in up.sentence
    down = stats.compare(B, A, arm="new", baseline="old")
    assert down.verdict == "worse"
    # The same numbers for a loss: lower is better.
    assert stats.compare(A, B, higher_is_better=False).verdict == "worse"
    assert up.difference == pytest.approx(np.mean(B) - np.mean(A))
    assert up.ci is not None and up.ci[0] > 0


def test_compare_uses_welch_when_permutation_cannot_reach_alpha() -> None:
    cmp = stats.compare([0.10, 0.11, 0.12], [0.50, 0.51, 0.52])
    assert cmp.test == "Welch's t-test"
    assert cmp.p_value == cmp.p_welch < 0.05
    assert cmp.verdict == "better"


def test_compare_no_detectable_difference_suggests_seeds() -> None:
    cmp = stats.compare([0.50, 0.55, 0.60], [0.52, 0.58, 0.57], arm="b", baseline="a")
    assert cmp.verdict == "no detectable difference"
    assert cmp.seeds_needed is not None and cmp.seeds_needed > 3
    assert f"About {cmp.seeds_needed} seeds per arm" in cmp.sentence


def test_compare_identical_and_single_seed() -> None:
    same = stats.compare([0.5, 0.5], [0.5, 0.5])
    assert same.verdict == "no detectable difference"
    assert same.seeds_needed is None
    assert "zero" in same.sentence
    one = stats.compare([0.5], [0.9])
    assert one.verdict == "no detectable difference"
    assert one.ci is None and one.p_value is None
    assert "at least 2 seeds" in one.sentence
    # The difference is +0.4, not zero: the sentence must not say it is.
    assert "zero" not in one.sentence and one.seeds_needed is None


def test_compare_does_not_ask_for_fewer_seeds_than_it_ran() -> None:
    # 4 vs 4 with one overlap: the exact permutation p is 4/70 > 0.05, yet the observed d is so
    # large that a t-test would need only 4 seeds per arm for 80% power.
    cmp = stats.compare([0.0, 0.3, 0.5, 1.55], [1.5, 2.0, 2.2, 2.4])
    assert cmp.test == "permutation test"
    assert cmp.p_value == pytest.approx(4 / 70)
    assert cmp.verdict == "no detectable difference"
    assert cmp.seeds_needed is not None and cmp.seeds_needed <= 4
    assert f"About {cmp.seeds_needed} seeds" not in cmp.sentence
    assert "not detected with 4" in cmp.sentence and "more seeds" in cmp.sentence


def test_direction_defaults() -> None:
    assert stats.higher_is_better("eval/exact_match")
    assert stats.higher_is_better("eval/score")
    assert not stats.higher_is_better("loss")


# --------------------------------------------------------------------------- paired by seed

PAIRED_BASE = [0.32, 0.37, 0.35, 0.37, 0.30, 0.36]
PAIRED_ARM = [0.31, 0.36, 0.32, 0.36, 0.28, 0.35]  # tracks the baseline seed by seed


def test_paired_t_and_sign_flip_agree_with_scipy() -> None:
    diffs = np.subtract(PAIRED_ARM, PAIRED_BASE)
    assert stats.paired_t_pvalue(diffs) == pytest.approx(
        sps.ttest_rel(PAIRED_ARM, PAIRED_BASE).pvalue
    )
    expected = sps.permutation_test(
        (PAIRED_ARM, PAIRED_BASE),
        lambda x, y: np.mean(x - y),
        permutation_type="samples",
        n_resamples=np.inf,
        alternative="two-sided",
    ).pvalue
    assert stats.sign_flip_pvalue(diffs) == pytest.approx(expected)
    assert stats.min_sign_flip_pvalue(4) == pytest.approx(0.125)
    assert stats.min_sign_flip_pvalue(6) < 0.05


def test_paired_power_matches_the_noncentral_t_and_seeds_needed_is_minimal() -> None:
    diffs = np.subtract(PAIRED_ARM, PAIRED_BASE)
    dz = stats.paired_effect_size(diffs)
    assert dz == pytest.approx(np.mean(diffs) / np.std(diffs, ddof=1))
    n = stats.paired_seeds_needed(diffs)
    assert n is not None
    assert stats.paired_t_power(dz, n) >= 0.8 > stats.paired_t_power(dz, n - 1)
    crit = sps.t.ppf(0.975, n - 1)
    nc = abs(dz) * np.sqrt(n)
    assert stats.paired_t_power(dz, n) == pytest.approx(
        sps.nct.sf(crit, n - 1, nc) + sps.nct.cdf(-crit, n - 1, nc)
    )
    assert stats.paired_seeds_needed([0.0, 0.0, 0.0]) is None


def test_pairing_detects_what_the_unpaired_test_cannot() -> None:
    unpaired = stats.compare(PAIRED_BASE, PAIRED_ARM, arm="b", baseline="a")
    paired = stats.compare(PAIRED_BASE, PAIRED_ARM, arm="b", baseline="a", paired=True)
    assert unpaired.verdict == "no detectable difference"
    assert paired.verdict == "worse" and paired.paired
    assert paired.test == "sign-flip test, paired by seed"  # 6 pairs: it can reach 0.05
    assert paired.p_value == paired.p_permutation < 0.05
    low, high = paired.ci
    assert low < paired.difference < high < 0
    with pytest.raises(ValueError, match="one value per seed"):
        stats.compare([1.0, 2.0], [1.0, 2.0, 3.0], paired=True)
