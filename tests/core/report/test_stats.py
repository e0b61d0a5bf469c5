"""alignzoo.report.stats agrees with scipy on known samples and degrades gracefully on edge cases."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

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
    # C(16, 8) = 12870 splits: exact by default (up to 100,000), Monte Carlo when told so.
    mc = stats.permutation_pvalue(x, y, n_resamples=5000, seed=3, max_exact=0)
    assert mc == stats.permutation_pvalue(x, y, n_resamples=5000, seed=3, max_exact=0)
    assert mc == pytest.approx(exact, abs=0.02)
    assert mc != stats.permutation_pvalue(x, y, n_resamples=5000, seed=4, max_exact=0)
    assert stats.permutation_pvalue(x, y) == pytest.approx(exact, rel=1e-9)


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


# --------------------------------------------------------------------------- intervals of the tests


def test_t_intervals_match_scipy() -> None:
    diffs = np.subtract(PAIRED_ARM, PAIRED_BASE)
    ref = sps.ttest_rel(PAIRED_ARM, PAIRED_BASE).confidence_interval(0.99)
    assert stats.paired_t_ci(diffs, alpha=0.01) == pytest.approx((ref.low, ref.high))
    for x, y in [(A, B), (C, D), (A, C)]:
        ref = sps.ttest_ind(y, x, equal_var=False).confidence_interval(0.95)
        assert stats.welch_ci(x, y) == pytest.approx((ref.low, ref.high))
    assert stats.paired_t_ci([0.1]) is None and stats.welch_ci([0.5], A) is None
    assert stats.paired_t_ci([0.2, 0.2, 0.2]) == (pytest.approx(0.2), pytest.approx(0.2))


def _check_ends(pvalue_at: Callable[[float], float | None], low: float, high: float) -> None:
    """Just inside the interval the test does not reject the shift; just outside it does."""
    for shift, rejected in [
        (low - 1e-6, True),
        (low + 1e-6, False),
        (high - 1e-6, False),
        (high + 1e-6, True),
    ]:
        p = pvalue_at(shift)
        assert p is not None and (p < 0.05) == rejected, (shift, p)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_sign_flip_interval_is_the_set_of_shifts_not_rejected(k: int) -> None:
    rng = np.random.default_rng(5)
    for n in (6, 7, 8, 9):
        d = np.round(rng.normal(0.2, 1.0, n), 2)  # rounded: ties among the subset means
        ci = stats.sign_flip_ci(d, 0.05 / k)
        if stats.min_sign_flip_pvalue(n) >= 0.05 / k:
            assert ci is None  # no shift can be rejected
            continue
        assert ci is not None
        low, high = ci
        assert low <= np.mean(d) <= high
        _check_ends(lambda shift, d=d: k * stats.sign_flip_pvalue(d - shift), low, high)  # type: ignore[misc, operator]
        # Its ends are means of subsets of the differences (order statistics of them).
        subset_means = {
            round(float(np.mean(d[list(s)])), 9)
            for r in range(1, n + 1)
            for s in itertools.combinations(range(n), r)
        }
        assert round(low, 9) in subset_means and round(high, 9) in subset_means


@pytest.mark.parametrize(("x", "y"), [(A, B), (B, A), (A, C), (D, B)])
def test_permutation_interval_is_the_set_of_shifts_not_rejected(
    x: list[float], y: list[float]
) -> None:
    ci = stats.permutation_ci(x, y)
    assert ci is not None
    low, high = ci
    assert low <= np.mean(y) - np.mean(x) <= high

    def scipy_p(shift: float) -> float:
        return sps.permutation_test(
            (np.subtract(y, shift), x),
            _diff_of_means,
            permutation_type="independent",
            n_resamples=np.inf,
        ).pvalue

    _check_ends(scipy_p, low, high)
    # 3 + 4 seeds: 2/35 > 0.05, so no shift is rejected: there is no interval.
    assert stats.permutation_ci(C, D) is None


def test_monte_carlo_interval_agrees_with_its_pvalue() -> None:
    rng = np.random.default_rng(11)
    d = rng.normal(0.8, 1.0, 18)  # 2^18 sign patterns: Monte Carlo
    ci = stats.sign_flip_ci(d)
    assert ci is not None
    _check_ends(lambda shift: stats.sign_flip_pvalue(d - shift), *ci)
    a, b = rng.normal(0.0, 1.0, 10), rng.normal(1.0, 1.0, 10)  # C(20, 10) splits: Monte Carlo
    ci = stats.permutation_ci(a, b)
    assert ci is not None
    _check_ends(lambda shift: stats.permutation_pvalue(a, b - shift), *ci)


# --------------------------------------------------------------------------- Holm and the rule


def test_holm_by_hand_and_as_a_step_down() -> None:
    p = [0.01, 0.04, 0.03, 0.005]
    # Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> running max.
    assert stats.holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5]) == pytest.approx([0.5])
    assert stats.holm([0.3, 0.6]) == pytest.approx([0.6, 0.6])
    assert stats.holm([0.9, 0.8]).max() <= 1.0
    rng = np.random.default_rng(0)
    batch = rng.uniform(0, 0.1, size=(500, 5))
    adjusted = stats.holm(batch)
    for row, adj in zip(batch, adjusted, strict=True):
        # Holm's procedure itself: reject the smallest p while it is below alpha / (k - i).
        rejected = np.zeros(5, dtype=bool)
        for i, j in enumerate(np.argsort(row)):
            if row[j] >= 0.05 / (5 - i):
                break
            rejected[j] = True
        assert np.array_equal(adj < 0.05, rejected)
        assert np.all(adj >= row)


@pytest.mark.parametrize(
    ("n_base", "n_arm", "paired", "k", "test"),
    [
        (5, 5, True, 1, stats.PAIRED_T),  # 2/32 = 0.0625
        (6, 6, True, 1, stats.SIGN_FLIP),  # 2/64 = 0.031
        (6, 6, True, 2, stats.PAIRED_T),  # ... but not below 0.025
        (7, 7, True, 2, stats.SIGN_FLIP),  # 2/128 = 0.016
        (7, 7, True, 6, stats.PAIRED_T),  # 0.016 > 0.0083
        (8, 8, True, 6, stats.SIGN_FLIP),  # 0.0078 < 0.0083
        (8, 8, True, 7, stats.PAIRED_T),  # 0.0078 > 0.0071
        (5, 3, False, 1, stats.PERMUTATION),  # 2/56 = 0.036
        (3, 3, False, 1, stats.WELCH),  # 2/20
        (5, 5, False, 6, stats.PERMUTATION),  # 2/252 = 0.0079 < 0.0083
        (4, 4, False, 2, stats.WELCH),  # 2/70 = 0.029 > 0.025
    ],
)
def test_which_test_decides(n_base: int, n_arm: int, paired: bool, k: int, test: str) -> None:
    choice = stats.choose_test(n_base, n_arm, paired=paired, n_comparisons=k)
    assert choice is not None and choice.test == test
    assert choice.level == pytest.approx(0.05 / k)
    assert (choice.assumption is None) == choice.resampling
    assert stats.choose_test(1, 5, paired=False) is None


def test_the_issue_four_seeds_six_arms() -> None:
    """A paired t p of about 0.03 with 4 seeds was "worse" next to a bootstrap interval; among
    six arms it is not detected, its interval is the t-interval and includes 0, and the report
    says why the t-test decides and what it assumes."""
    base = [0.34, 0.36, 0.33, 0.38]
    worse = [b + d for b, d in zip(base, [-0.01, -0.02, -0.015, -0.03], strict=True)]
    shifts = [
        [0.01, 0, 0, 0],
        [0, 0.01, 0, 0],
        [0, 0, 0.01, 0],
        [0, 0, 0, 0.01],
        [0.01, -0.01, 0.005, 0],
    ]
    others = [[b + e for b, e in zip(base, s, strict=True)] for s in shifts]
    assert stats.bootstrap_mean_ci(np.subtract(worse, base))[1] < 0  # type: ignore[index]
    alone = stats.compare(base, worse, paired=True)
    assert alone.verdict == "worse" and alone.test == stats.PAIRED_T
    assert alone.p_value == pytest.approx(sps.ttest_rel(worse, base).pvalue)
    ref = sps.ttest_rel(worse, base).confidence_interval(0.95)
    assert alone.ci == pytest.approx((ref.low, ref.high))
    assert "cannot go below p = 0.125" in alone.sentence and "roughly normal" in alone.sentence

    family = [stats.ArmValues("dpo", base, worse, True)] + [
        stats.ArmValues(f"arm{i}", base, o, True) for i, o in enumerate(others)
    ]
    c = stats.compare_arms(family, baseline="grpo")[0]
    assert c.n_comparisons == 6 and c.ci_alpha == pytest.approx(0.05 / 6)
    assert c.p_value == pytest.approx(alone.p_value)
    assert c.p_adjusted == pytest.approx(min(1.0, 6 * alone.p_value))  # the smallest of the six
    assert c.verdict == "no detectable difference"
    ref = sps.ttest_rel(worse, base).confidence_interval(1 - 0.05 / 6)
    assert c.ci == pytest.approx((ref.low, ref.high))
    assert c.ci[0] < 0 < c.ci[1]
    assert "Holm-adjusted p" in c.sentence and "over 6 comparisons" in c.sentence
    assert "0.05/6" in c.sentence and "per-seed differences are roughly normal" in c.sentence
    # Seeds to detect: for the t-test at the Holm/Bonferroni level.
    diffs = np.subtract(worse, base)
    assert c.seeds_needed == stats.paired_seeds_needed(diffs, alpha=0.05 / 6)
    assert c.seeds_needed > stats.paired_seeds_needed(diffs)  # type: ignore[operator]
    assert f"About {c.seeds_needed} seeds per arm" in c.sentence


def test_a_later_holm_step_explains_an_interval_that_includes_0() -> None:
    # Six 6-seed arms clearly worse (p = 1/32 each, sign-flip cannot decide at 0.05/7: t-test)
    # and one with raw p a little under 0.05: Holm's last step detects it at 0.05, while its
    # simultaneous interval (at 0.05/7) includes 0.
    base = [0.30, 0.34, 0.31, 0.36, 0.33, 0.35]
    rng = np.random.default_rng(1)
    family = [
        stats.ArmValues(
            f"bad{i}", base, list(np.subtract(base, 0.2 + rng.normal(0, 0.01, 6))), True
        )
        for i in range(6)
    ]
    diffs = [0.012, 0.006, 0.008, 0.02, 0.002, 0.011]
    family.append(stats.ArmValues("edge", base, list(np.add(base, diffs)), True))
    edge = stats.compare_arms(family)[-1]
    assert 0.05 / 7 < edge.p_value < 0.05  # type: ignore[operator]
    assert edge.p_adjusted == pytest.approx(edge.p_value)
    assert edge.verdict == "better"
    assert edge.ci is not None and edge.ci[0] < 0 < edge.ci[1]
    assert stats.HOLM_NOTE in edge.sentence and "0.05/1 = 0.05" in edge.sentence
