"""Statistics for comparing arms over seeds: confidence intervals, tests, effect size, power.

Every function takes the per-seed values of a metric (one number per seed, for example each
seed's final evaluation accuracy) and is honest about small samples: where a quantity is
undefined (a confidence interval from one seed) it returns ``None`` rather than a number, and
the report prints "n/a". Randomised procedures (Monte Carlo permutation test, bootstrap) use a
fixed seed so that the same inputs always give the same report.

Conventions: a *difference* is ``arm - baseline``; ``higher_is_better`` says which direction of
the metric is an improvement.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats as sps

Values = Sequence[float] | np.ndarray
Verdict = Literal["better", "worse", "no detectable difference"]

ALPHA = 0.05
POWER = 0.8
_REL_TOL = 1e-12


def _array(values: Values) -> np.ndarray:
    arr = np.asarray(list(values), dtype=float)
    if arr.ndim != 1:
        raise ValueError("expected a flat sequence of numbers (one per seed)")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"values must be finite, got {arr.tolist()}")
    return arr


def _close(x: float, y: float, scale: float = 1.0) -> bool:
    return abs(x - y) <= _REL_TOL * max(1.0, abs(scale))


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
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    diff = float(b.mean() - a.mean())
    se2 = va + vb
    if se2 <= 0 or math.sqrt(se2) <= _REL_TOL * max(1.0, abs(a.mean()), abs(b.mean())):
        return 1.0 if _close(diff, 0.0, max(abs(a.mean()), abs(b.mean()))) else 0.0
    t = diff / math.sqrt(se2)
    # Welch–Satterthwaite degrees of freedom.
    df = se2**2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    return float(min(1.0, 2 * sps.t.sf(abs(t), df)))


def permutation_pvalue(
    baseline: Values, arm: Values, n_resamples: int = 9999, seed: int = 0
) -> float | None:
    """Two-sided permutation test of the difference of means (labels shuffled between arms).

    Exact (every split of the pooled values enumerated) when there are at most ``n_resamples``
    splits; otherwise Monte Carlo with ``n_resamples`` random splits from a fixed ``seed``, with
    the (count + 1) / (n + 1) correction. The two-sided p-value is twice the smaller one-sided
    p-value, capped at 1 (as ``scipy.stats.permutation_test``). ``None`` if an arm is empty.
    """
    a, b = _array(baseline), _array(arm)
    if a.size == 0 or b.size == 0:
        return None
    pooled = np.concatenate([b, a])
    n_arm, total = b.size, pooled.size
    observed = float(b.mean() - a.mean())
    pooled_sum = pooled.sum()

    def diffs(arm_sums: np.ndarray) -> np.ndarray:
        return arm_sums / n_arm - (pooled_sum - arm_sums) / (total - n_arm)

    n_splits = math.comb(total, n_arm)
    if n_splits <= n_resamples:
        idx = np.array(list(itertools.combinations(range(total), n_arm)), dtype=int)
        null = diffs(pooled[idx].sum(axis=1))
        exact = True
    else:
        rng = np.random.default_rng(seed)
        order = rng.permuted(np.tile(np.arange(total), (n_resamples, 1)), axis=1)
        null = diffs(pooled[order[:, :n_arm]].sum(axis=1))
        exact = False
    return _two_sided_pvalue(null, observed, float(np.abs(pooled).max()), exact)


def _two_sided_pvalue(null: np.ndarray, observed: float, scale: float, exact: bool) -> float:
    """Twice the smaller one-sided p of ``observed`` in the ``null`` statistics, capped at 1.

    Ties within floating-point error count as "as extreme"; a Monte Carlo null (``exact``
    False) gets the (count + 1) / (n + 1) correction.
    """
    tol = max(1e-14, abs(observed) * 1e-14) + 1e-12 * max(1.0, scale)
    less = np.count_nonzero(null <= observed + tol)
    greater = np.count_nonzero(null >= observed - tol)
    if exact:
        p_less, p_greater = less / null.size, greater / null.size
    else:
        p_less, p_greater = (less + 1) / (null.size + 1), (greater + 1) / (null.size + 1)
    return float(min(1.0, 2 * min(p_less, p_greater)))


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
    says nothing about its spread).
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


def seeds_needed(
    baseline: Values, arm: Values, alpha: float = ALPHA, power: float = POWER
) -> int | None:
    """Seeds per arm a two-sided t-test needs to detect the observed difference.

    The observed Cohen's d is taken as the true effect; the answer is the smallest n per arm
    whose power (noncentral t) reaches ``power`` at level ``alpha``. ``None`` when the observed
    difference is 0 or an arm has no seeds; 2 when the difference is non-zero with no spread.
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
    # Normal approximation as a starting point, then the exact noncentral-t answer.
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)
    approx = 2 * (z / d) ** 2
    if approx > 1e6:
        return math.ceil(approx)
    n = max(2, math.floor(approx) - 2)
    while n > 2 and t_test_power(d, n - 1, alpha) >= power:
        n -= 1
    while t_test_power(d, n, alpha) < power:
        n += 1
    return n


# --------------------------------------------------------------------------- paired seeds
# The runner gives every arm the same seeds, and a seed fixes the prompt order and the initial
# weights, so two arms' runs with one seed are a matched pair. Their per-seed differences remove
# what the seed contributes to both (easy or hard prompt orders), which unpaired tests count as
# noise.


def paired_t_pvalue(diffs: Values) -> float | None:
    """Two-sided p-value of the paired t-test (one-sample t-test of the per-seed differences).

    ``None`` with fewer than 2 pairs; with no spread in the differences, 1.0 if they are all
    0 and 0.0 otherwise (as :func:`welch_pvalue`).
    """
    d = _array(diffs)
    if d.size < 2:
        return None
    sd = float(d.std(ddof=1))
    mean = float(d.mean())
    if sd <= _REL_TOL * max(1.0, abs(mean)):
        return 1.0 if _close(mean, 0.0) else 0.0
    t = mean / (sd / math.sqrt(d.size))
    return float(min(1.0, 2 * sps.t.sf(abs(t), d.size - 1)))


def sign_flip_pvalue(diffs: Values, n_resamples: int = 9999, seed: int = 0) -> float | None:
    """Two-sided sign-flip permutation test of the mean per-seed difference.

    Under the null each difference is as likely positive as negative; exact over all ``2**n``
    sign patterns when there are at most ``n_resamples`` of them, Monte Carlo otherwise (fixed
    ``seed``, (count + 1) / (n + 1)). Two-sided as twice the smaller one-sided p, capped at 1.
    """
    d = _array(diffs)
    if d.size == 0:
        return None
    observed = float(d.mean())
    if 2**d.size <= n_resamples:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
        exact = True
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(n_resamples, d.size))
        exact = False
    null = (signs * d).mean(axis=1)
    return _two_sided_pvalue(null, observed, float(np.abs(d).max()), exact)


def min_sign_flip_pvalue(n_pairs: int) -> float:
    """The smallest two-sided p-value the exact sign-flip test can give with ``n_pairs``."""
    return min(1.0, 2 / 2**n_pairs)


def bootstrap_mean_ci(
    diffs: Values, confidence: float = 0.95, n_resamples: int = 10000, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean per-seed difference (pairs resampled whole)."""
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
    """Seeds (pairs) a paired t-test needs to detect the observed mean difference at ``power``.

    ``None`` when the mean difference is 0; 2 when it is non-zero with no spread.
    """
    d = _array(diffs)
    if d.size == 0 or _close(float(d.mean()), 0.0):
        return None
    dz = paired_effect_size(d)
    if dz is None:
        return 2
    n = 2
    while paired_t_power(dz, n, alpha) < power:
        n += 1
        if n > 1_000_000:
            break
    return n


# --------------------------------------------------------------------------- verdict


@dataclass(frozen=True)
class Comparison:
    """One arm against the baseline on one metric, with the verdict in plain words."""

    arm: str
    baseline: str
    metric: str
    n_arm: int
    n_baseline: int
    mean_arm: float
    mean_baseline: float
    difference: float
    ci: tuple[float, float] | None
    p_permutation: float | None
    p_welch: float | None
    p_value: float | None
    test: str | None
    cohens_d: float | None
    seeds_needed: int | None
    verdict: Verdict
    sentence: str
    paired: bool = False


def _fmt(x: float) -> str:
    return f"{x:+.4g}"


def _fmt_p(p: float) -> str:
    return "< 0.0001" if p < 1e-4 else f"= {p:.4f}".rstrip("0").rstrip(".")


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
    """Compare one arm with the baseline and say, in plain words, what can be concluded.

    The deciding test is the permutation test when it can reach ``alpha`` at these sample sizes
    (it assumes nothing about the distribution; exact up to 9,999 splits, Monte Carlo beyond),
    and Welch's t-test otherwise (with 2 or 3 seeds per arm no permutation can reach 0.05).
    The difference is detected when that p-value is below ``alpha``; its sign and
    ``higher_is_better`` then give "better" or "worse". Otherwise the verdict is "no detectable
    difference", with the number of seeds per arm that would detect the observed difference at
    80% power (worded so that it never asks for fewer seeds than were run).

    ``paired=True``: the two sequences are matched by seed (same order, same length), and the
    analysis is of the per-seed differences: sign-flip permutation test when it can reach
    ``alpha`` (6 or more pairs), the paired t-test otherwise; a bootstrap over pairs; d_z as
    effect size; seeds needed for a paired t-test. ``p_permutation``, ``p_welch`` and
    ``cohens_d`` then hold the sign-flip p, the paired-t p and d_z.
    """
    a, b = _array(baseline_values), _array(arm_values)
    if a.size == 0 or b.size == 0:
        raise ValueError("compare needs at least one value per arm")
    if paired and a.size != b.size:
        raise ValueError("a paired comparison needs one value per seed in both arms")
    diff = float(b.mean() - a.mean())
    if paired:
        diffs = b - a
        ci = bootstrap_mean_ci(diffs, seed=seed)
        p_perm = sign_flip_pvalue(diffs, seed=seed)
        p_welch = paired_t_pvalue(diffs)
        d = paired_effect_size(diffs)
        needed = paired_seeds_needed(diffs, alpha=alpha, power=power)
        can_permute = min_sign_flip_pvalue(a.size) < alpha
        tests = ("sign-flip test, paired by seed", "paired t-test")
    else:
        ci = bootstrap_diff_ci(a, b, seed=seed)
        p_perm = permutation_pvalue(a, b, seed=seed)
        p_welch = welch_pvalue(a, b)
        d = cohens_d(a, b)
        needed = seeds_needed(a, b, alpha=alpha, power=power)
        can_permute = min_permutation_pvalue(a.size, b.size) < alpha
        tests = ("permutation test", "Welch's t-test")
    if a.size < 2 or b.size < 2:
        p_value, test = None, None
    elif can_permute:
        p_value, test = p_perm, tests[0]
    else:
        p_value, test = p_welch, tests[1]
    seeds = f"{b.size} seed{'s' if b.size != 1 else ''}" + (
        " per arm" if a.size == b.size else f" (baseline {a.size})"
    )
    ci_text = f" (95% CI {_fmt(ci[0])} to {_fmt(ci[1])})" if ci is not None else ""

    verdict: Verdict
    if p_value is not None and p_value < alpha and not _close(diff, 0.0):
        improved = diff > 0 if higher_is_better else diff < 0
        verdict = "better" if improved else "worse"
        sentence = (
            f"{arm} is {verdict} than {baseline} on {metric}: difference {_fmt(diff)}{ci_text}, "
            f"p {_fmt_p(p_value)} ({test}, {seeds})."
        )
    else:
        verdict = "no detectable difference"
        if p_value is None:
            reason = (
                f"with {seeds} there is no spread to test against; run at least 2 seeds per arm"
            )
        else:
            reason = f"p {_fmt_p(p_value)} ({test}, {seeds})"
        sentence = (
            f"No detectable difference between {arm} and {baseline} on {metric}: "
            f"difference {_fmt(diff)}{ci_text}, {reason}."
        )
        advice = _seeds_advice(needed, a.size + b.size, min(a.size, b.size), alpha, power)
        sentence += f" {advice}" if advice else ""
    return Comparison(
        arm=arm,
        baseline=baseline,
        metric=metric,
        n_arm=int(b.size),
        n_baseline=int(a.size),
        mean_arm=float(b.mean()),
        mean_baseline=float(a.mean()),
        difference=diff,
        ci=ci,
        p_permutation=p_perm,
        p_welch=p_welch,
        p_value=p_value,
        test=test,
        cohens_d=d,
        seeds_needed=needed,
        verdict=verdict,
        sentence=sentence,
        paired=paired,
    )


def _seeds_advice(needed: int | None, total: int, have: int, alpha: float, power: float) -> str:
    """The sentence about seeds that follows a "no detectable difference" verdict.

    ``total`` is the number of values in both arms, ``have`` the smaller arm's seed count.
    """
    if needed is None:
        if total < 3:  # one seed per arm: no spread, and the reason already says so
            return ""
        return "The observed difference is zero, so no number of seeds would detect it."
    if needed <= have:
        # Post-hoc power says these seeds should usually suffice, yet the test missed it: do not
        # tell the reader that fewer seeds than they already ran would settle it.
        return (
            f"A t-test would have {power:.0%} power against a difference this large with "
            f"{needed} seeds per arm, yet it was not detected with {have}: the true difference "
            "is likely smaller than observed, and more seeds would settle it."
        )
    return (
        f"About {needed} seeds per arm would detect a difference this large "
        f"(α = {alpha:g}, {power:.0%} power)."
    )


_LOWER_IS_BETTER = ("loss", "error", "perplexity", "ppl", "wall_clock", "memory", "length")


def higher_is_better(metric: str) -> bool:
    """Default direction of a metric: lower is better for losses, errors, time and memory."""
    name = metric.lower()
    return not any(word in name for word in _LOWER_IS_BETTER)
