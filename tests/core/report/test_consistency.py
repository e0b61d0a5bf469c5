"""The interval printed beside a verdict never contradicts it, over many random families.

An interval that excludes 0 always comes with "better" or "worse"; "better" or "worse" with an
interval that includes 0 only with the sentence that says why (a later step of Holm's method).
Checked on the statistics (``compare_arms``) and on the report's table as printed.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from alignzoo.report import sections, stats

ALPHA = stats.ALPHA

# Values like accuracies (ties, zeros, repeats) and arbitrary floats.
value = st.one_of(
    st.sampled_from([0.0, 0.05, 0.25, 0.3, 0.35, 0.5, 1.0]),
    st.floats(min_value=-2.0, max_value=2.0, allow_nan=False, allow_infinity=False),
)
shift = st.sampled_from([0.0, 0.0, 0.01, -0.2, 0.5, 3.0])


@st.composite
def families(draw: st.DrawFn) -> tuple[list[stats.ArmValues], bool]:
    n_base = draw(st.integers(1, 8))
    base = draw(st.lists(value, min_size=n_base, max_size=n_base))
    arms = []
    for i in range(draw(st.integers(1, 6))):
        paired = n_base >= 2 and draw(st.booleans())
        n = n_base if paired else draw(st.integers(1, 8))
        if paired and draw(st.booleans()):  # tracks the baseline seed by seed
            noise = draw(st.lists(value, min_size=n, max_size=n))
            values = [b + 0.05 * e for b, e in zip(base, noise, strict=True)]
        else:
            values = draw(st.lists(value, min_size=n, max_size=n))
        moved = draw(shift)
        arms.append(stats.ArmValues(f"arm{i}", base, [v + moved for v in values], paired))
    return arms, draw(st.booleans())


def check(comparisons: list[stats.Comparison], higher: bool) -> None:
    k = sum(c.p_value is not None for c in comparisons)
    for c in comparisons:
        detected = c.verdict != "no detectable difference"
        assert c.n_comparisons == k
        if c.ci is None:
            assert c.p_value is None and not detected
            continue
        low, high = c.ci
        assert low <= high
        assert c.p_value is not None and c.p_adjusted is not None
        assert c.p_adjusted >= c.p_value
        assert c.ci_alpha == ALPHA / k
        if low > 0 or high < 0:
            assert detected, c.sentence
        if detected:
            assert c.p_adjusted < ALPHA
            assert (c.verdict == "better") == ((c.difference > 0) == higher)
            if low <= 0 <= high:
                # Only a later Holm step detects what the Bonferroni interval does not.
                assert c.p_value >= ALPHA / k
                assert stats.HOLM_NOTE in c.sentence, c.sentence
        else:
            assert stats.HOLM_NOTE not in c.sentence
        if c.test in (stats.PAIRED_T, stats.WELCH):
            assert c.caveat is not None and c.caveat in c.sentence
            assert "roughly normal" in c.caveat


@given(families())
def test_interval_and_verdict_agree(family: tuple[list[stats.ArmValues], bool]) -> None:
    arms, higher = family
    check(stats.compare_arms(arms, higher_is_better=higher), higher)


def test_interval_and_verdict_agree_on_a_seeded_sweep() -> None:
    """Many more random families than hypothesis draws, with real detections among them."""
    rng = np.random.default_rng(2024)
    detected = discordant = 0
    for _ in range(300):
        n_base = int(rng.integers(2, 9))
        base = np.round(rng.normal(0.35, 0.05, n_base), int(rng.integers(2, 5)))
        arms = []
        for i in range(int(rng.integers(1, 7))):
            paired = bool(rng.integers(0, 2))
            n = n_base if paired else int(rng.integers(2, 9))
            moved = rng.choice([0.0, 0.0, 0.02, -0.05, 0.1])
            if paired:
                values = base + moved + rng.normal(0, 0.01, n)
            else:
                values = rng.normal(0.35 + moved, 0.05, n)
            arms.append(stats.ArmValues(f"arm{i}", base, np.round(values, 3), paired))
        comparisons = stats.compare_arms(arms)
        check(comparisons, True)
        for c in comparisons:
            detected += c.verdict != "no detectable difference"
            discordant += stats.HOLM_NOTE in c.sentence
    assert detected > 100  # the sweep exercises verdicts, not only "no detectable difference"
    assert discordant >= 1  # ... and the Holm-but-not-Bonferroni case


def rows_of(arms: list[stats.ArmValues]) -> tuple[sections._Experiment, dict]:
    """An experiment (no files) with these arms: paired arms share the baseline's seeds."""
    base = arms[0].baseline_values
    rows = {"base": row("base", dict(enumerate(base)))}
    for i, a in enumerate(arms):
        first = 0 if a.paired else 100 * (i + 1)
        rows[a.arm] = row(a.arm, {first + s: v for s, v in enumerate(a.arm_values)})
    exp = sections._Experiment(
        run_dir=Path("."),
        spec=None,
        name="x",
        arms=list(rows),
        baseline="base",
        key="eval/exact_match",
        higher=True,
        runs=[],
    )
    return exp, rows


def row(arm: str, by_seed: dict[int, float]) -> sections.ArmRow:
    return sections.ArmRow(
        arm=arm,
        finished=len(by_seed),
        total=len(by_seed),
        final=list(by_seed.values()),
        final_by_seed=by_seed,
        start_by_seed={},
        summary=None,
        start_value=None,
        best_step=None,
        best_value=None,
        samples=None,
        tokens_per_s=None,
        wall_clock_s=None,
        peak_memory_mb=None,
    )


@given(families())
def test_the_printed_table_agrees_with_its_verdicts(
    family: tuple[list[stats.ArmValues], bool],
) -> None:
    arms, _ = family
    exp, rows = rows_of(arms)
    blocks = sections._comparisons(exp, rows)
    table = next((b for b in blocks if b.kind == "table"), None)
    sentences = next(b for b in blocks if b.kind == "ul").items
    if table is None:
        return
    for cells in table.rows:
        arm, ci, verdict = cells[0], cells[2], cells[6]
        sentence = next(s for s in sentences if s.startswith(arm + " ") or f" {arm} and " in s)
        if ci == "n/a":
            assert verdict == "no detectable difference"
            continue
        low, high = (float(x) for x in re.fullmatch(r"(\S+) to (\S+)", ci).groups())  # type: ignore[union-attr]
        if low > 0 or high < 0:
            assert verdict != "no detectable difference", (cells, sentence)
        if verdict != "no detectable difference" and low <= 0 <= high:
            assert stats.HOLM_NOTE in sentence, (cells, sentence)
