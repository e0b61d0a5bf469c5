"""Calibration of the report's decisions: A/A experiments rarely report a difference, and a real
shift is found.

Each simulated experiment has a baseline and six arms; ``stats.decide`` (what the report decides
with: the test per arm, Holm over the six, the verdict) judges them. When every arm is drawn
from the baseline's distribution, any "better" or "worse" is a false positive, and Holm's method
should keep the share of experiments with one at or below 5%, up to Monte Carlo error.

Paired experiments give every seed an effect shared by all arms (as a seed fixes the prompt
order and the initial weights for every arm), so the arms' values are strongly correlated while
their per-seed differences are not. Unpaired experiments draw every value independently.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from alignzoo.report import stats

N_ARMS = 6
N_EXPERIMENTS = 2000
N_POWER = 400
SEED_SD = 1.0  # the seed's effect, shared by every arm of a paired experiment
NOISE_SD = 0.5  # each run's own noise
DIFF_SD = math.sqrt(2) * NOISE_SD  # SD of one paired per-seed difference
# At most 5% plus three Monte Carlo standard errors of a 5% rate.
BOUND = stats.ALPHA + 3 * math.sqrt(stats.ALPHA * (1 - stats.ALPHA) / N_EXPERIMENTS)


def simulate(
    n_seeds: int, paired: bool, n_experiments: int, shift: float = 0.0, seed: int = 0
) -> tuple[float, float]:
    """Share of experiments with any "better"/"worse", and share where arm 1 (shifted up by
    ``shift``) is "better"."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0.0, NOISE_SD, size=(n_experiments, N_ARMS + 1, n_seeds))
    if paired:
        values += rng.normal(0.0, SEED_SD, size=(n_experiments, 1, n_seeds))
    values[:, 1] += shift
    any_verdict = found = 0
    for experiment in values:
        decisions = stats.decide(
            [(experiment[0], experiment[arm], paired) for arm in range(1, N_ARMS + 1)]
        )
        any_verdict += any(d.verdict != "no detectable difference" for d in decisions)
        found += decisions[0].verdict == "better"
    return any_verdict / n_experiments, found / n_experiments


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "unpaired"])
@pytest.mark.parametrize("n_seeds", [4, 8])
def test_aa_experiments_report_a_difference_at_most_5_percent_of_the_time(
    n_seeds: int, paired: bool
) -> None:
    choice = stats.choose_test(n_seeds, n_seeds, paired=paired, n_comparisons=N_ARMS)
    assert choice is not None
    rate, _ = simulate(n_seeds, paired, N_EXPERIMENTS, seed=n_seeds + 10 * paired)
    print(
        f"\nA/A, {'paired' if paired else 'unpaired'}, {n_seeds} seeds, {N_ARMS} arms "
        f"({choice.test} + Holm): any better/worse in {rate:.2%} of {N_EXPERIMENTS} experiments "
        f"(bound {BOUND:.2%})"
    )
    assert rate <= BOUND


def test_which_test_the_calibrated_designs_use() -> None:
    """The four designs above cover both branches of the rule for six arms."""
    tests = {
        (n, paired): stats.choose_test(n, n, paired=paired, n_comparisons=N_ARMS)
        for n in (4, 8)
        for paired in (True, False)
    }
    assert {key: c.test for key, c in tests.items() if c is not None} == {
        (4, True): stats.PAIRED_T,  # 2/2^4 = 0.125: the sign-flip test cannot reach 0.05/6
        (8, True): stats.SIGN_FLIP,  # 2/2^8 = 0.0078 < 0.0083
        (4, False): stats.WELCH,  # 2/C(8, 4) = 0.029
        (8, False): stats.PERMUTATION,  # 2/C(16, 8) = 0.00016, exact over 12,870 splits
    }


def test_power_against_a_two_sd_shift() -> None:
    """One arm shifted by 2 SD of the per-seed differences: with 8 paired seeds the sign-flip
    test finds it whenever all 8 differences are positive (about Φ(2)^8 = 83%)."""
    shift = 2 * DIFF_SD
    found = {}
    for n_seeds in (4, 8):
        _, found[n_seeds] = simulate(n_seeds, True, N_POWER, shift=shift, seed=100 + n_seeds)
    _, unpaired = simulate(8, False, N_POWER, shift=2 * NOISE_SD, seed=200)
    print(
        f"\npower, one of {N_ARMS} arms shifted by 2 SD (Holm): paired 8 seeds {found[8]:.1%}, "
        f"paired 4 seeds {found[4]:.1%}, unpaired 8 seeds (2 SD of the values) {unpaired:.1%}"
    )
    assert found[8] >= 0.6
    assert found[8] > found[4]
    assert unpaired >= 0.2
