"""Statistics for comparing arms over seeds: confidence intervals, tests, effect size, power.

Every function takes the per-seed values of a metric (one number per seed, for example each
seed's final evaluation accuracy) and is honest about small samples: where a quantity is
undefined (a confidence interval from one seed) it returns ``None`` rather than a number, and
the report prints "n/a". Randomised procedures (Monte Carlo permutation test, bootstrap) use a
fixed seed so that the same inputs always give the same report.

Conventions: a *difference* is ``arm - baseline``; ``higher_is_better`` says which direction of
the metric is an improvement.

How a report decides (:func:`decide`, used by :func:`compare_arms` and so by the report)
-----------------------------------------------------------------------------------------
The report compares k arms with one baseline. Those k comparisons are one family, and the
family-wise error rate (the chance of any false "better" or "worse") is held at ``alpha`` with
Holm's step-down method (:func:`holm`): the verdict uses the Holm-adjusted p-value.

Which test gives each arm's raw p-value (:func:`choose_test`), with n seeds:

* paired (the arm finished exactly the baseline's seeds): the exact sign-flip test of the
  per-seed differences when its smallest possible p-value, ``2 / 2**n``, is below
  ``alpha / k`` (Holm's strictest step, so the test can detect a difference whatever the other
  arms do): with ``alpha = 0.05`` that is n >= 6 for one arm, n >= 8 for up to six. Otherwise
  the paired t-test, whose verdict rests on the per-seed differences being roughly normal (the
  report prints this caveat on the row).
* unpaired: the exact permutation test under the same rule (smallest p ``2 / C(n_a + n_b,
  n_a)``), otherwise Welch's t-test, resting on each arm's per-seed values being roughly
  normal.
* either arm with fewer than 2 seeds: no test and no verdict; such an arm is not counted in k.

The interval printed beside a verdict belongs to the test that gave it, at the Bonferroni
level ``alpha / k``, so the k intervals are simultaneous 95% intervals: the t-interval (paired
or Welch) for a t-test row, and for a sign-flip or permutation row the set of shifts of the
arm that the test does not reject at ``alpha / k`` (the inverted test; :func:`sign_flip_ci`,
:func:`permutation_ci`). An interval excludes 0 exactly when the raw p is below ``alpha / k``,
and then Holm detects the difference too. Holm can also detect a difference whose interval
includes 0 (its later steps use ``alpha / (k - 1)``, ..., ``alpha``); the sentence then says
why. "Seeds to detect" is computed for the t-test at ``alpha / k``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import special
from scipy import stats as sps

from alignzoo import metrics as canonical

Values = Sequence[float] | np.ndarray
Verdict = Literal["better", "worse", "no detectable difference"]

ALPHA = 0.05
POWER = 0.8
N_RESAMPLES = 9999
"""Monte Carlo resamples of a sign-flip or permutation test too large to enumerate."""
EXACT_LIMIT = 100_000
"""Sign patterns or splits up to which the resampling tests enumerate every one (exact)."""
_REL_TOL = 1e-12
_SNAP_TOL = 1e-9


def _array(values: Values) -> np.ndarray:
    arr = np.asarray(list(values), dtype=float)
    if arr.ndim != 1:
        raise ValueError("expected a flat sequence of numbers (one per seed)")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"values must be finite, got {arr.tolist()}")
    return arr


def _close(x: float, y: float, scale: float = 1.0) -> bool:
    return abs(x - y) <= _REL_TOL * max(1.0, abs(scale))


def _t_two_sided(t: float, df: float) -> float:
    """Two-sided p-value of a t statistic (``scipy.special.stdtr``: the t CDF, without the
    overhead of ``scipy.stats.t``)."""
    return float(min(1.0, 2 * special.stdtr(df, -abs(t))))


def _t_crit(alpha: float, df: float) -> float:
    """The t quantile whose two-sided tail is ``alpha``: |t| above it is p below alpha."""
    return float(-special.stdtrit(df, alpha / 2))


# --------------------------------------------------------------------------- one arm


@dataclass(frozen=True)
class Summary:
    """Mean of a metric over seeds with its 95% t-interval (``None`` with fewer than 2 seeds)."""

    n: int
    mean: float
    std: float | None
    ci_low: float | None
    ci_high: float | None

    @property
    def half_width(self) -> float | None:
        """Half the width of the confidence interval (the "±" number)."""
        if self.ci_low is None or self.ci_high is None:
            return None
        return (self.ci_high - self.ci_low) / 2


def mean_ci(values: Values, confidence: float = 0.95) -> Summary:
    """Mean and ``confidence`` interval of the mean from the t-distribution with n-1 dof.

    ``std`` is the sample standard deviation (ddof=1). With one value, std and the interval are
    ``None``; with zero variance the interval collapses to the mean.
    """
    arr = _array(values)
    if arr.size == 0:
        raise ValueError("mean_ci needs at least one value")
    mean = float(arr.mean())
    if arr.size < 2:
        return Summary(1, mean, None, None, None)
    std = float(arr.std(ddof=1))
    half = float(sps.t.ppf((1 + confidence) / 2, arr.size - 1)) * std / math.sqrt(arr.size)
    return Summary(int(arr.size), mean, std, mean - half, mean + half)


# --------------------------------------------------------------------------- two arms


def welch_pvalue(baseline: Values, arm: Values) -> float | None:
    """Two-sided p-value of Welch's unequal-variance t-test.

    ``None`` when either arm has fewer than 2 seeds. When both arms have zero variance the test
    statistic is degenerate: p is 1.0 if the means are equal and 0.0 otherwise.
    """
    a, b = _array(baseline), _array(arm)
    if a.size < 2 or b.size < 2:
        return None
    diff, se, df = _welch_parts(a, b)
    if se is None:
        return 1.0 if _close(diff, 0.0, max(abs(a.mean()), abs(b.mean()))) else 0.0
    return _t_two_sided(diff / se, df)


def _welch_parts(a: np.ndarray, b: np.ndarray) -> tuple[float, float | None, float]:
    """Difference of means, its standard error (``None`` when degenerate) and Welch's df."""
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    diff = float(b.mean() - a.mean())
    se2 = float(va + vb)
    if se2 <= 0 or math.sqrt(se2) <= _REL_TOL * max(1.0, abs(a.mean()), abs(b.mean())):
        return diff, None, float("nan")
    # Welch–Satterthwaite degrees of freedom.
    df = se2**2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    return diff, math.sqrt(se2), float(df)


def welch_ci(baseline: Values, arm: Values, alpha: float = ALPHA) -> tuple[float, float] | None:
    """The ``1 - alpha`` Welch t-interval of ``mean(arm) - mean(baseline)``.

    It is the interval of :func:`welch_pvalue`: it excludes 0 exactly when that p is below
    ``alpha``. ``None`` with fewer than 2 seeds in an arm; a point when neither arm has spread.
    """
    a, b = _array(baseline), _array(arm)
    if a.size < 2 or b.size < 2:
        return None
    diff, se, df = _welch_parts(a, b)
    if se is None:
        return diff, diff
    half = _t_crit(alpha, df) * se
    return diff - half, diff + half


# Sign-flip and permutation tests of a shift. Testing "the arm is the baseline shifted by delta"
# with a resampling test needs no new resampling for each delta: for a resample that moves m >= 1
# values (the sign-flip test flips the signs of a set S of per-seed differences; the permutation
# test swaps m arm values I with m baseline values J), the resampled mean difference is at least
# the observed one exactly when the resample's *shift value* w is at most delta, where w is the
# mean of the differences in S, or mean(I) - mean(J). So
#     p_greater(delta) = (base + #{w <= delta}) / denom,  p_less(delta) = (base + #{w >= delta}) / denom,
# with ``base`` the resamples that move nothing (always as extreme), plus 1 for a Monte Carlo
# null (the (count + 1) / (n + 1) correction), and ``denom`` the number of resamples (+ 1 for
# Monte Carlo). The two-sided p is twice the smaller, capped at 1 (as scipy.stats.permutation_test).
# Both are monotone in delta, so the shifts not rejected form an interval whose ends are order
# statistics of w: that is the confidence interval that belongs to the test.


def _two_sided_count(count: int, denom: int) -> float:
    return min(1.0, 2 * (count / denom))


@dataclass(frozen=True)
class _ShiftNull:
    """A sign-flip or permutation test of every shift at once (see the comment above)."""

    w: np.ndarray
    base: int
    denom: int
    tol: float  # shift values within floating-point error of the shift count as ties

    def pvalue(self, shift: float = 0.0) -> float:
        le = int(np.count_nonzero(self.w <= shift + self.tol))
        ge = int(np.count_nonzero(self.w >= shift - self.tol))
        return _two_sided_count(self.base + min(le, ge), self.denom)

    def interval(self, alpha: float) -> tuple[float, float] | None:
        """The shifts whose p-value is at least ``alpha``; ``None`` when that is every shift
        (too few resamples to reject anything at ``alpha``)."""
        # r: the fewest shift values on each side that keep p >= alpha. The same expression
        # as ``pvalue``, so that 0 is outside the interval exactly when pvalue(0) < alpha.
        r = max(0, math.ceil(alpha * self.denom / 2) - self.base)
        while r > 0 and _two_sided_count(self.base + r - 1, self.denom) >= alpha:
            r -= 1
        while _two_sided_count(self.base + r, self.denom) < alpha:
            r += 1
        if r == 0 or r > self.w.size:
            return None
        ws = np.sort(self.w)
        return float(ws[r - 1] - self.tol), float(ws[self.w.size - r] + self.tol)


def _tolerance(values: np.ndarray) -> float:
    return _REL_TOL * max(1.0, float(np.abs(values).max()))


@functools.lru_cache(maxsize=8)
def _all_subsets(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every non-empty subset of n seeds as a 0/1 row, and its size."""
    codes = np.arange(1, 2**n)
    rows = ((codes[:, None] >> np.arange(n)) & 1).astype(float)
    sizes = rows.sum(axis=1)
    rows.setflags(write=False)
    sizes.setflags(write=False)
    return rows, sizes


def _sign_flip_null(d: np.ndarray, n_resamples: int, seed: int, max_exact: int) -> _ShiftNull:
    if 2**d.size <= max_exact:
        flipped, sizes = _all_subsets(d.size)
        base, denom = 1, 2**d.size  # the pattern that flips nothing
    else:
        rng = np.random.default_rng(seed)
        draws = rng.integers(0, 2, size=(n_resamples, d.size)).astype(float)
        sizes_all = draws.sum(axis=1)
        moved = sizes_all > 0
        flipped, sizes = draws[moved], sizes_all[moved]
        base, denom = 1 + int(np.count_nonzero(~moved)), n_resamples + 1
    return _ShiftNull((flipped @ d) / sizes, base, denom, _tolerance(d))


@functools.lru_cache(maxsize=4)
def _all_splits(n_arm: int, n_baseline: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every split of the pooled seeds (arm's first) that moves something: which arm values
    leave the arm (0/1 rows), which baseline values join it, and how many are swapped."""
    total = n_arm + n_baseline
    idx = np.array(list(itertools.combinations(range(total), n_arm)), dtype=np.intp)
    member = np.zeros((idx.shape[0], total))
    member[np.arange(idx.shape[0])[:, None], idx] = 1.0
    out_arm, in_base = 1.0 - member[:, :n_arm], member[:, n_arm:]
    swapped = out_arm.sum(axis=1)
    keep = swapped > 0  # drops the split that leaves every value where it is
    parts = (out_arm[keep], in_base[keep], swapped[keep])
    for part in parts:
        part.setflags(write=False)
    return parts


def _permutation_null(
    a: np.ndarray, b: np.ndarray, n_resamples: int, seed: int, max_exact: int
) -> _ShiftNull:
    n_splits = math.comb(a.size + b.size, b.size)
    if n_splits <= max_exact:
        out_arm, in_base, swapped = _all_splits(b.size, a.size)
        base, denom = 1, n_splits
    else:
        total = a.size + b.size
        rng = np.random.default_rng(seed)
        order = rng.permuted(np.tile(np.arange(total), (n_resamples, 1)), axis=1)
        member = np.zeros((n_resamples, total))
        member[np.arange(n_resamples)[:, None], order[:, : b.size]] = 1.0
        out_all, in_all = 1.0 - member[:, : b.size], member[:, b.size :]
        swapped_all = out_all.sum(axis=1)
        moved = swapped_all > 0
        out_arm, in_base, swapped = out_all[moved], in_all[moved], swapped_all[moved]
        base, denom = 1 + int(np.count_nonzero(~moved)), n_resamples + 1
    w = (out_arm @ b - in_base @ a) / swapped
    return _ShiftNull(w, base, denom, _tolerance(np.concatenate([a, b])))


def permutation_pvalue(
    baseline: Values,
    arm: Values,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    max_exact: int = EXACT_LIMIT,
) -> float | None:
    """Two-sided permutation test of the difference of means (labels shuffled between arms).

    Exact (every split of the pooled values enumerated) when there are at most ``max_exact``
    splits (8 + 8 seeds: 12,870); otherwise Monte Carlo with ``n_resamples`` random splits from
    a fixed ``seed``, with the (count + 1) / (n + 1) correction. The two-sided p-value is twice
    the smaller one-sided p-value, capped at 1 (as ``scipy.stats.permutation_test``); ties
    within floating-point error count as "as extreme". ``None`` if an arm is empty.
    """
    a, b = _array(baseline), _array(arm)
    if a.size == 0 or b.size == 0:
        return None
    return _permutation_null(a, b, n_resamples, seed, max_exact).pvalue()


def permutation_ci(
    baseline: Values,
    arm: Values,
    alpha: float = ALPHA,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    max_exact: int = EXACT_LIMIT,
) -> tuple[float, float] | None:
    """The ``1 - alpha`` interval of the arm's shift that inverts :func:`permutation_pvalue`.

    The shifts ``delta`` for which the test of ``arm - delta`` against the baseline is not
    rejected at ``alpha``; it excludes 0 exactly when the permutation p is below ``alpha``.
    ``None`` if an arm is empty, or when no shift can be rejected (the test cannot reach
    ``alpha`` with these seeds).
    """
    a, b = _array(baseline), _array(arm)
    if a.size == 0 or b.size == 0:
        return None
    return _permutation_null(a, b, n_resamples, seed, max_exact).interval(alpha)


def min_permutation_pvalue(n_baseline: int, n_arm: int) -> float:
    """The smallest two-sided p-value an exact permutation test can give at these sample sizes."""
    return min(1.0, 2 / math.comb(n_baseline + n_arm, n_arm))


def bootstrap_diff_ci(
    baseline: Values,
    arm: Values,
    confidence: float = 0.95,
    n_resamples: int = 10000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``mean(arm) - mean(baseline)``.

    Each arm's seeds are resampled with replacement independently (a two-sample bootstrap), from
    a fixed ``seed``. ``None`` when either arm has fewer than 2 seeds (resampling one value
    says nothing about its spread). Not used for verdicts: with few seeds it is much narrower
    than the intervals of the tests (about half the t-interval with 4 seeds).
    """
    a, b = _array(baseline), _array(arm)
    if a.size < 2 or b.size < 2:
        return None
    rng = np.random.default_rng(seed)
    mean_a = a[rng.integers(0, a.size, size=(n_resamples, a.size))].mean(axis=1)
    mean_b = b[rng.integers(0, b.size, size=(n_resamples, b.size))].mean(axis=1)
    diffs = mean_b - mean_a
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(diffs, [tail, 100 - tail])
    return float(low), float(high)


def pooled_std(baseline: Values, arm: Values) -> float | None:
    """Pooled sample standard deviation of two arms (``None`` with fewer than 3 values)."""
    a, b = _array(baseline), _array(arm)
    dof = a.size + b.size - 2
    if dof < 1:
        return None
    ss = ((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum()
    return float(math.sqrt(ss / dof))


def cohens_d(baseline: Values, arm: Values) -> float | None:
    """Cohen's d: ``(mean(arm) - mean(baseline)) / pooled std``.

    ``None`` when the pooled std is undefined or zero (no spread: the effect size is not finite).
    """
    a, b = _array(baseline), _array(arm)
    sd = pooled_std(a, b)
    if sd is None or sd <= _REL_TOL * max(1.0, abs(a.mean()), abs(b.mean())):
        return None
    return float((b.mean() - a.mean()) / sd)


def t_test_power(effect_size: float, n_per_arm: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided two-sample t-test (equal n, equal variance) at ``effect_size`` (d).

    Under the alternative the t statistic follows a noncentral t with ``2n - 2`` degrees of
    freedom and noncentrality ``d * sqrt(n / 2)``.
    """
    if n_per_arm < 2:
        return 0.0
    df = 2 * n_per_arm - 2
    nc = abs(effect_size) * math.sqrt(n_per_arm / 2)
    crit = sps.t.ppf(1 - alpha / 2, df)
    return float(sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc))


def _smallest_n(power_at: Callable[[int], float], power: float, guess: float) -> int:
    """The smallest n >= 2 with ``power_at(n) >= power`` (power grows with n), searched from a
    normal-approximation ``guess``: doubling up, then bisection. Past a million, the guess."""
    if guess > 1e6:
        return math.ceil(guess)
    if power_at(2) >= power:
        return 2
    low, high = 2, max(3, math.ceil(guess))
    while power_at(high) < power:
        low, high = high, high * 2
        if high > 1_000_000:
            return high
    while high - low > 1:
        mid = (low + high) // 2
        if power_at(mid) >= power:
            high = mid
        else:
            low = mid
    return high


def seeds_needed(
    baseline: Values, arm: Values, alpha: float = ALPHA, power: float = POWER
) -> int | None:
    """Seeds per arm a two-sided t-test needs to detect the observed difference.

    The observed Cohen's d is taken as the true effect; the answer is the smallest n per arm
    whose power (noncentral t) reaches ``power`` at level ``alpha`` (the report passes the
    Bonferroni level ``alpha / k`` of its k comparisons). ``None`` when the observed difference
    is 0 or an arm has no seeds; 2 when the difference is non-zero with no spread.
    """
    a, b = _array(baseline), _array(arm)
    if a.size == 0 or b.size == 0:
        return None
    diff = float(b.mean() - a.mean())
    if _close(diff, 0.0, max(abs(a.mean()), abs(b.mean()))):
        return None
    sd = pooled_std(a, b)
    if sd is None:
        return None
    if sd <= _REL_TOL * max(1.0, abs(a.mean()), abs(b.mean())):
        return 2
    d = abs(diff) / sd
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)
    return _smallest_n(lambda n: t_test_power(d, n, alpha), power, 2 * (z / d) ** 2)


# --------------------------------------------------------------------------- paired seeds
# The runner gives every arm the same seeds, and a seed fixes the prompt order and the initial
# weights, so two arms' runs with one seed are a matched pair. Their per-seed differences remove
# what the seed contributes to both (easy or hard prompt orders), which unpaired tests count as
# noise.


def _paired_parts(d: np.ndarray) -> tuple[float, float | None]:
    """Mean of the differences and its standard error (``None`` when there is no spread)."""
    sd = float(d.std(ddof=1))
    mean = float(d.mean())
    if sd <= _REL_TOL * max(1.0, abs(mean)):
        return mean, None
    return mean, sd / math.sqrt(d.size)


def paired_t_pvalue(diffs: Values) -> float | None:
    """Two-sided p-value of the paired t-test (one-sample t-test of the per-seed differences).

    ``None`` with fewer than 2 pairs; with no spread in the differences, 1.0 if they are all
    0 and 0.0 otherwise (as :func:`welch_pvalue`).
    """
    d = _array(diffs)
    if d.size < 2:
        return None
    mean, se = _paired_parts(d)
    if se is None:
        return 1.0 if _close(mean, 0.0) else 0.0
    return _t_two_sided(mean / se, d.size - 1)


def paired_t_ci(diffs: Values, alpha: float = ALPHA) -> tuple[float, float] | None:
    """The ``1 - alpha`` t-interval of the mean per-seed difference (``None`` with < 2 pairs).

    It is the interval of :func:`paired_t_pvalue`: it excludes 0 exactly when that p is below
    ``alpha``; a point when the differences have no spread.
    """
    d = _array(diffs)
    if d.size < 2:
        return None
    mean, se = _paired_parts(d)
    if se is None:
        return mean, mean
    half = _t_crit(alpha, d.size - 1) * se
    return mean - half, mean + half


def sign_flip_pvalue(
    diffs: Values, n_resamples: int = N_RESAMPLES, seed: int = 0, max_exact: int = EXACT_LIMIT
) -> float | None:
    """Two-sided sign-flip permutation test of the mean per-seed difference.

    Under the null each difference is as likely positive as negative; exact over all ``2**n``
    sign patterns when there are at most ``max_exact`` of them (16 seeds), Monte Carlo otherwise
    (``n_resamples`` patterns from a fixed ``seed``, (count + 1) / (n + 1)). Two-sided as twice
    the smaller one-sided p, capped at 1.
    """
    d = _array(diffs)
    if d.size == 0:
        return None
    return _sign_flip_null(d, n_resamples, seed, max_exact).pvalue()


def sign_flip_ci(
    diffs: Values,
    alpha: float = ALPHA,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    max_exact: int = EXACT_LIMIT,
) -> tuple[float, float] | None:
    """The ``1 - alpha`` interval that inverts :func:`sign_flip_pvalue`.

    The shifts ``delta`` for which the sign-flip test of ``diffs - delta`` is not rejected at
    ``alpha``: the ``r``-th smallest to the ``r``-th largest mean of a non-empty subset of the
    differences. It excludes 0 exactly when the sign-flip p is below ``alpha``. ``None`` when
    empty, or when no shift can be rejected (``2 / 2**n`` is not below ``alpha``).
    """
    d = _array(diffs)
    if d.size == 0:
        return None
    return _sign_flip_null(d, n_resamples, seed, max_exact).interval(alpha)


def min_sign_flip_pvalue(n_pairs: int) -> float:
    """The smallest two-sided p-value the exact sign-flip test can give with ``n_pairs``."""
    return min(1.0, 2 / 2**n_pairs)


def bootstrap_mean_ci(
    diffs: Values, confidence: float = 0.95, n_resamples: int = 10000, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean per-seed difference (pairs resampled whole).

    Not used for verdicts (see :func:`bootstrap_diff_ci`).
    """
    d = _array(diffs)
    if d.size < 2:
        return None
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_resamples, d.size))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def paired_effect_size(diffs: Values) -> float | None:
    """d_z: the mean per-seed difference over the standard deviation of the differences."""
    d = _array(diffs)
    if d.size < 2:
        return None
    sd = float(d.std(ddof=1))
    if sd <= _REL_TOL * max(1.0, abs(float(d.mean()))):
        return None
    return float(d.mean()) / sd


def paired_t_power(effect_size: float, n_pairs: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test: noncentral t, ``n - 1`` df, noncentrality d_z sqrt(n)."""
    if n_pairs < 2:
        return 0.0
    df = n_pairs - 1
    nc = abs(effect_size) * math.sqrt(n_pairs)
    crit = sps.t.ppf(1 - alpha / 2, df)
    return float(sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc))


def paired_seeds_needed(diffs: Values, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Seeds (pairs) a paired t-test at level ``alpha`` needs to detect the observed mean
    difference with ``power``.

    ``None`` when the mean difference is 0; 2 when it is non-zero with no spread.
    """
    d = _array(diffs)
    if d.size == 0 or _close(float(d.mean()), 0.0):
        return None
    dz = paired_effect_size(d)
    if dz is None:
        return 2
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)
    return _smallest_n(lambda n: paired_t_power(dz, n, alpha), power, (z / dz) ** 2)


# --------------------------------------------------------------------------- many arms


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm's step-down adjustment of the p-values of one family (the last axis).

    With the k p-values sorted, ``p_(1) <= ... <= p_(k)``, the adjusted ``p_(j)`` is
    ``max_{i <= j} min(1, (k - i + 1) p_(i))``; rejecting where the adjusted p is below
    ``alpha`` is Holm's procedure (reject ``p_(1)`` if below ``alpha / k``, then ``p_(2)`` if
    below ``alpha / (k - 1)``, ..., stopping at the first that is not), which holds the chance
    of any false rejection at ``alpha`` whatever the dependence between the tests. Leading axes
    are independent families.
    """
    p = np.asarray(pvalues, dtype=float)
    k = p.shape[-1]
    if k == 0:
        return p.copy()
    order = np.argsort(p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1)
    adjusted = np.minimum(1.0, np.maximum.accumulate(ranked * (k - np.arange(k)), axis=-1))
    out = np.empty_like(adjusted)
    np.put_along_axis(out, order, adjusted, axis=-1)
    return out


@dataclass(frozen=True)
class DecidingTest:
    """Which test decides one comparison of a family (see the module docstring)."""

    test: str  # the test's name, as the report prints it
    resampling: bool  # True: the exact (or Monte Carlo) sign-flip / permutation test
    paired: bool
    level: float  # alpha / k: Holm's strictest step and the simultaneous intervals' level
    n_comparisons: int
    resampling_min_p: float  # the smallest p the resampling test can give with these seeds

    @property
    def assumption(self) -> str | None:
        """What a t-test verdict rests on (``None`` for the resampling tests)."""
        if self.resampling:
            return None
        if self.paired:
            return "the per-seed differences are roughly normal"
        return "each arm's per-seed values are roughly normal (their variances may differ)"


SIGN_FLIP = "sign-flip test, paired by seed"
PAIRED_T = "paired t-test"
PERMUTATION = "permutation test"
WELCH = "Welch's t-test"


def resampling_min_pvalue(
    n_baseline: int,
    n_arm: int,
    paired: bool,
    n_resamples: int = N_RESAMPLES,
    max_exact: int = EXACT_LIMIT,
) -> float:
    """The smallest p the sign-flip (paired) or permutation test can give with these seeds:
    exact ``2 / 2**n`` or ``2 / C(n_a + n_b, n_a)``; ``2 / (n_resamples + 1)`` beyond
    ``max_exact`` (Monte Carlo)."""
    count = 2**n_arm if paired else math.comb(n_baseline + n_arm, n_arm)
    if count <= max_exact:
        return min(1.0, 2 / count)
    return min(1.0, 2 / (n_resamples + 1))


def choose_test(
    n_baseline: int,
    n_arm: int,
    *,
    paired: bool,
    n_comparisons: int = 1,
    alpha: float = ALPHA,
    n_resamples: int = N_RESAMPLES,
    max_exact: int = EXACT_LIMIT,
) -> DecidingTest | None:
    """The test that decides a comparison in a family of ``n_comparisons``.

    The sign-flip (paired) or permutation (unpaired) test when its smallest possible p is below
    ``alpha / n_comparisons``, Holm's strictest step, so that it can detect a difference on its
    own; otherwise the paired or Welch t-test, whose verdict rests on normality
    (:attr:`DecidingTest.assumption`). ``None`` when an arm has fewer than 2 seeds: no test.
    """
    if n_baseline < 2 or n_arm < 2:
        return None
    if paired and n_baseline != n_arm:
        raise ValueError("a paired comparison needs one value per seed in both arms")
    k = max(1, n_comparisons)
    level = alpha / k
    min_p = resampling_min_pvalue(n_baseline, n_arm, paired, n_resamples, max_exact)
    resampling = min_p < level
    if paired:
        test = SIGN_FLIP if resampling else PAIRED_T
    else:
        test = PERMUTATION if resampling else WELCH
    return DecidingTest(test, resampling, paired, level, k, min_p)


def _deciding_pvalue(choice: DecidingTest, a: np.ndarray, b: np.ndarray, seed: int) -> float:
    if choice.paired:
        if choice.resampling:
            return _sign_flip_null(b - a, N_RESAMPLES, seed, EXACT_LIMIT).pvalue()
        p = paired_t_pvalue(b - a)
    elif choice.resampling:
        return _permutation_null(a, b, N_RESAMPLES, seed, EXACT_LIMIT).pvalue()
    else:
        p = welch_pvalue(a, b)
    assert p is not None  # choose_test returned a test: both arms have 2 or more seeds
    return p


def _deciding_interval(
    choice: DecidingTest, a: np.ndarray, b: np.ndarray, seed: int
) -> tuple[float, float] | None:
    """The interval of the deciding test at its family level ``alpha / k``."""
    if choice.paired:
        if choice.resampling:
            return _sign_flip_null(b - a, N_RESAMPLES, seed, EXACT_LIMIT).interval(choice.level)
        return paired_t_ci(b - a, choice.level)
    if choice.resampling:
        return _permutation_null(a, b, N_RESAMPLES, seed, EXACT_LIMIT).interval(choice.level)
    return welch_ci(a, b, choice.level)


@dataclass(frozen=True)
class Decision:
    """The verdict on one arm of a family, and how it was reached."""

    choice: DecidingTest | None  # None: an arm has fewer than 2 seeds, no test
    difference: float
    p_value: float | None  # raw p of the deciding test
    p_adjusted: float | None  # Holm-adjusted over the family
    holm_rank: int | None  # 1 for the smallest raw p of the family
    holm_level: float | None  # Holm's level at that rank: alpha / (k - rank + 1)
    verdict: Verdict


def decide(
    comparisons: Sequence[tuple[Values, Values, bool]],
    *,
    alpha: float = ALPHA,
    higher_is_better: bool = True,
    seed: int = 0,
) -> list[Decision]:
    """The verdicts on one family: each ``(baseline_values, arm_values, paired)`` an arm.

    The family is the arms with a test (2 or more seeds in both arms), k of them; each gets the
    test :func:`choose_test` picks for k comparisons, Holm's method adjusts the raw p-values,
    and an arm whose adjusted p is below ``alpha`` is "better" or "worse" by the sign of its
    difference. This is all the report decides with; :func:`compare_arms` adds intervals,
    effect sizes and words.
    """
    data = [(_array(a), _array(b), bool(p)) for a, b, p in comparisons]
    for a, b, paired in data:
        if a.size == 0 or b.size == 0:
            raise ValueError("a comparison needs at least one value per arm")
        if paired and a.size != b.size:
            raise ValueError("a paired comparison needs one value per seed in both arms")
    k = sum(a.size >= 2 and b.size >= 2 for a, b, _ in data)
    choices = [
        choose_test(a.size, b.size, paired=paired, n_comparisons=k, alpha=alpha)
        for a, b, paired in data
    ]
    tested = [i for i, c in enumerate(choices) if c is not None]
    raw: list[float | None] = [None] * len(data)
    for i in tested:
        choice = choices[i]
        assert choice is not None
        raw[i] = _deciding_pvalue(choice, data[i][0], data[i][1], seed)
    tested_p = np.array([raw[i] for i in tested], dtype=float)
    adjusted = holm(tested_p)
    ranks = np.empty(len(tested), dtype=int)
    ranks[np.argsort(tested_p, kind="stable")] = np.arange(1, len(tested) + 1)
    out: list[Decision] = []
    for i, (a, b, _) in enumerate(data):
        diff = float(b.mean() - a.mean())
        p_adj = rank = level = None
        verdict: Verdict = "no detectable difference"
        if i in tested:
            j = tested.index(i)
            p_adj, rank = float(adjusted[j]), int(ranks[j])
            level = alpha / (k - rank + 1)
            if p_adj < alpha and not _close(diff, 0.0):
                improved = diff > 0 if higher_is_better else diff < 0
                verdict = "better" if improved else "worse"
        out.append(Decision(choices[i], diff, raw[i], p_adj, rank, level, verdict))
    return out


# --------------------------------------------------------------------------- verdict in words


@dataclass(frozen=True)
class ArmValues:
    """One arm of a family: its per-seed values, the baseline's, and whether they are paired
    (same seeds, same order)."""

    arm: str
    baseline_values: Values
    arm_values: Values
    paired: bool = False


@dataclass(frozen=True)
class Comparison:
    """One arm against the baseline on one metric, with the verdict in plain words.

    ``p_value`` is the raw p of the deciding ``test``, ``p_adjusted`` its Holm adjustment over
    the ``n_comparisons`` arms of the report (the verdict uses it). ``ci`` is the deciding
    test's interval at ``ci_alpha`` (``alpha / n_comparisons``: simultaneous ``1 - alpha``
    intervals), of the kind ``ci_method``. ``p_permutation`` and ``p_welch`` hold the
    resampling and the t-test p (paired: sign-flip and paired t) whichever decided; ``cohens_d``
    is d_z when paired. ``caveat`` says what a t-test verdict rests on and why no exact test
    decided; ``seeds_needed`` is for the t-test at ``ci_alpha``.
    """

    arm: str
    baseline: str
    metric: str
    n_arm: int
    n_baseline: int
    mean_arm: float
    mean_baseline: float
    difference: float
    ci: tuple[float, float] | None
    ci_method: str | None
    ci_alpha: float | None
    p_permutation: float | None
    p_welch: float | None
    p_value: float | None
    p_adjusted: float | None
    n_comparisons: int
    test: str | None
    holm_level: float | None
    cohens_d: float | None
    seeds_needed: int | None
    verdict: Verdict
    sentence: str
    paired: bool
    caveat: str | None


def _fmt(x: float) -> str:
    return f"{x:+.4g}"


def _fmt_p(p: float) -> str:
    return "< 0.0001" if p < 1e-4 else f"= {p:.4f}".rstrip("0").rstrip(".")


def _fmt_level(alpha: float, k: int) -> str:
    """The level Holm's first step (and the simultaneous intervals) use, in words."""
    return f"α = {alpha:g}" if k <= 1 else f"α = {alpha:g}/{k} = {alpha / k:.2g}"


CI_METHODS = {
    SIGN_FLIP: "the shifts the sign-flip test does not reject",
    PERMUTATION: "the shifts the permutation test does not reject",
    PAIRED_T: "paired t-interval",
    WELCH: "Welch t-interval",
}


def compare_arms(
    arms: Sequence[ArmValues],
    *,
    baseline: str = "baseline",
    metric: str = "metric",
    higher_is_better: bool = True,
    alpha: float = ALPHA,
    power: float = POWER,
    seed: int = 0,
) -> list[Comparison]:
    """Compare every arm with the baseline as one family and say what can be concluded.

    The verdicts are :func:`decide`'s (Holm over the arms with a test; the deciding test per
    arm as in the module docstring). Each comparison also gets the deciding test's interval at
    ``alpha / k`` (simultaneous), the effect size (Cohen's d, or d_z when paired) and, when
    nothing is detected, the seeds per arm that would detect the observed difference with the
    t-test at ``alpha / k`` and ``power`` (worded so that it never asks for fewer seeds than
    were run).
    """
    decisions = decide(
        [(x.baseline_values, x.arm_values, x.paired) for x in arms],
        alpha=alpha,
        higher_is_better=higher_is_better,
        seed=seed,
    )
    k = sum(d.choice is not None for d in decisions)
    return [
        _comparison(x, dec, k, baseline, metric, alpha, power, seed)
        for x, dec in zip(arms, decisions, strict=True)
    ]


def compare(
    baseline_values: Values,
    arm_values: Values,
    *,
    arm: str = "arm",
    baseline: str = "baseline",
    metric: str = "metric",
    higher_is_better: bool = True,
    alpha: float = ALPHA,
    power: float = POWER,
    seed: int = 0,
    paired: bool = False,
) -> Comparison:
    """Compare one arm with the baseline: :func:`compare_arms` with a family of one (no
    adjustment for multiple comparisons; the deciding test and its 95% interval as in the
    module docstring).

    ``paired=True``: the two sequences are matched by seed (same order, same length), and the
    analysis is of the per-seed differences.
    """
    return compare_arms(
        [ArmValues(arm, baseline_values, arm_values, paired)],
        baseline=baseline,
        metric=metric,
        higher_is_better=higher_is_better,
        alpha=alpha,
        power=power,
        seed=seed,
    )[0]


def _comparison(
    x: ArmValues,
    dec: Decision,
    k: int,
    baseline: str,
    metric: str,
    alpha: float,
    power: float,
    seed: int,
) -> Comparison:
    a, b = _array(x.baseline_values), _array(x.arm_values)
    paired, choice, diff = x.paired, dec.choice, dec.difference
    level = alpha / max(1, k)
    if paired:
        diffs = b - a
        p_perm = sign_flip_pvalue(diffs, seed=seed)
        p_t = paired_t_pvalue(diffs)
        effect = paired_effect_size(diffs)
        needed = paired_seeds_needed(diffs, alpha=level, power=power)
    else:
        p_perm = permutation_pvalue(a, b, seed=seed)
        p_t = welch_pvalue(a, b)
        effect = cohens_d(a, b)
        needed = seeds_needed(a, b, alpha=level, power=power)
    ci = None if choice is None else _deciding_interval(choice, a, b, seed)
    detected = dec.verdict != "no detectable difference"
    if ci is not None and not detected:
        # The interval excludes 0 exactly when the raw p is below alpha / k, and then Holm
        # detects the difference; an end on the wrong side of 0 by floating-point error only
        # (ties the p-value counts as such) is 0.
        scale = _SNAP_TOL * max(1.0, float(np.abs(np.concatenate([a, b])).max()))
        low, high = ci
        ci = (min(low, 0.0) if low <= scale else low, max(high, 0.0) if high >= -scale else high)
    caveat = _caveat(choice, a.size, b.size, alpha)
    sentence = _sentence(x, dec, k, baseline, metric, ci, effect, caveat, alpha)
    if not detected:
        advice = _seeds_advice(needed, a.size + b.size, min(a.size, b.size), alpha, k, power)
        sentence += f" {advice}" if advice else ""
    return Comparison(
        arm=x.arm,
        baseline=baseline,
        metric=metric,
        n_arm=int(b.size),
        n_baseline=int(a.size),
        mean_arm=float(b.mean()),
        mean_baseline=float(a.mean()),
        difference=diff,
        ci=ci,
        ci_method=None if choice is None else CI_METHODS[choice.test],
        ci_alpha=None if choice is None else choice.level,
        p_permutation=p_perm,
        p_welch=p_t,
        p_value=dec.p_value,
        p_adjusted=dec.p_adjusted,
        n_comparisons=k,
        test=None if choice is None else choice.test,
        holm_level=dec.holm_level,
        cohens_d=effect,
        seeds_needed=needed,
        verdict=dec.verdict,
        sentence=sentence,
        paired=paired,
        caveat=caveat,
    )


def _caveat(choice: DecidingTest | None, n_baseline: int, n_arm: int, alpha: float) -> str | None:
    """Why a t-test decides and what its verdict rests on (``None`` for resampling tests)."""
    if choice is None or choice.assumption is None:
        return None
    k = choice.n_comparisons
    needed = f"p < {choice.level:.2g}" + (
        "" if k <= 1 else f" ({alpha:g}/{k}, Holm's strictest step)"
    )
    if choice.paired:
        seeds, exact, t_test = f"With {n_arm} seeds", "the sign-flip test", "the paired t-test"
    else:
        seeds = f"With {n_arm} and {n_baseline} seeds"
        exact, t_test = "the permutation test", "Welch's t-test"
    return (
        f"{seeds} {exact} cannot go below p = {choice.resampling_min_p:.3g} and a verdict needs "
        f"{needed}, so {t_test} decides, assuming {choice.assumption}."
    )


def _sentence(
    x: ArmValues,
    dec: Decision,
    k: int,
    baseline: str,
    metric: str,
    ci: tuple[float, float] | None,
    effect: float | None,
    caveat: str | None,
    alpha: float,
) -> str:
    n_arm, n_base = len(x.arm_values), len(x.baseline_values)
    seeds = f"{n_arm} seed{'s' if n_arm != 1 else ''}" + (
        " per arm" if n_arm == n_base else f" (baseline {n_base})"
    )
    ci_name = "95% CI" if k <= 1 else "simultaneous 95% CI"
    inside = [] if effect is None else [f"effect size {'d_z' if x.paired else 'd'} {_fmt(effect)}"]
    if ci is not None:
        inside.append(f"{ci_name} {_fmt(ci[0])} to {_fmt(ci[1])}")
    ci_text = f" ({'; '.join(inside)})" if inside else ""
    if dec.p_value is None or dec.choice is None:
        reason = f"with {seeds} there is no spread to test against; run at least 2 seeds per arm"
    else:
        reason = f"p {_fmt_p(dec.p_value)} ({dec.choice.test}, {seeds})"
        if k > 1 and dec.p_adjusted is not None:
            reason += f", Holm-adjusted p {_fmt_p(dec.p_adjusted)} over {k} comparisons"
    diff = _fmt(dec.difference)
    if dec.verdict != "no detectable difference":
        sentence = (
            f"{x.arm} is {dec.verdict} than {baseline} on {metric}: difference {diff}{ci_text}, "
            f"{reason}."
        )
        if ci is not None and ci[0] <= 0 <= ci[1] and dec.holm_rank is not None:
            sentence += f" {_holm_note(dec.holm_rank, k, alpha)}"
    else:
        sentence = (
            f"No detectable difference between {x.arm} and {baseline} on {metric}: "
            f"difference {diff}{ci_text}, {reason}."
        )
    return sentence + (f" {caveat}" if caveat else "")


HOLM_NOTE = "The simultaneous interval includes 0 although Holm's method detects the difference"


def _holm_note(rank: int, k: int, alpha: float) -> str:
    """Why a detected difference can have a simultaneous interval that includes 0."""
    return (
        f"{HOLM_NOTE}: its step-down tested this arm at {alpha:g}/{k - rank + 1} = "
        f"{alpha / (k - rank + 1):.2g}, after detecting the {rank - 1} arm"
        f"{'s' if rank != 2 else ''} with smaller p, while every simultaneous interval is at "
        f"the Bonferroni level {alpha:g}/{k} = {alpha / k:.2g}."
    )


def _seeds_advice(
    needed: int | None, total: int, have: int, alpha: float, k: int, power: float
) -> str:
    """The sentence about seeds that follows a "no detectable difference" verdict.

    ``total`` is the number of values in both arms, ``have`` the smaller arm's seed count,
    ``k`` the comparisons in the family (power is for the t-test at ``alpha / k``).
    """
    if needed is None:
        if total < 3:  # one seed per arm: no spread, and the reason already says so
            return ""
        return "The observed difference is zero, so no number of seeds would detect it."
    level = _fmt_level(alpha, k)
    if needed <= have:
        # Post-hoc power says these seeds should usually suffice, yet the test missed it: do not
        # tell the reader that fewer seeds than they already ran would settle it.
        return (
            f"A t-test at {level} would have {power:.0%} power against a difference this large "
            f"with {needed} seeds per arm, yet it was not detected with {have}: the true "
            "difference is likely smaller than observed, and more seeds would settle it."
        )
    return (
        f"About {needed} seeds per arm would detect a difference this large "
        f"(t-test at {level}, {power:.0%} power)."
    )


higher_is_better = canonical.higher_is_better  # the report's and the engine's default alike
