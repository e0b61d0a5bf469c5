"""Agreement between annotators, and the filter that keeps only what they agree on.

- :func:`krippendorff_alpha`: Krippendorff's alpha, ``1 - D_o / D_e``, for any number of
  annotators per item and missing judgements, with the interval metric ``(a - b)^2`` for
  ratings or the nominal metric ``a != b`` for choices (Krippendorff, "Computing Krippendorff's
  Alpha-Reliability", 2011). Computed from the coincidences of the values: items with fewer
  than two values are not pairable and are left out.
- :func:`pair_agreement`: for "which is better" judgements, the raw agreement (the share of
  annotator pairs on one item that chose alike) and the chance-corrected agreement (alpha with
  the nominal metric over the choices A, B and tie).
- :func:`consensus`: the filter of the common practice for reward-model data: keep an item
  when at least ``min_agree`` annotators differ by less than ``tolerance`` on the scale
  normalised to [0, 1] (default 2 annotators, 0.3); their mean is the item's value.
- :class:`AgreementTracker`: the same figures as ``alignzoo.human.export.agreement``, kept up
  to date one judgement at a time (adding or taking back one costs the same whatever the size
  of the queue), for the annotation app.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

Metric = Literal["interval", "nominal"]


def _distance(a: float, b: float, metric: Metric) -> float:
    if metric == "interval":
        return (a - b) ** 2
    return 0.0 if a == b else 1.0


def krippendorff_alpha(
    items: Sequence[Sequence[float | None]], metric: Metric = "interval"
) -> float:
    """Krippendorff's alpha of ``items`` (per item, the values its annotators gave; None for
    "cannot judge", which is left out). NaN when no item is pairable (two values or more) or
    every pairable value is the same (no variation to agree on)."""
    units = [Counter(v for v in values if v is not None) for values in items]
    units = [u for u in units if sum(u.values()) >= 2]
    total: Counter[float] = Counter()
    for unit in units:
        total.update(unit)
    n = sum(total.values())
    if len(units) < 1 or n < 2:
        return math.nan
    observed = 0.0
    for unit in units:
        m = sum(unit.values())
        pairs = sum(
            unit[a] * unit[b] * _distance(a, b, metric) for a in unit for b in unit if a != b
        )
        observed += pairs / (m - 1)
    observed /= n
    expected = sum(
        total[a] * total[b] * _distance(a, b, metric) for a in total for b in total if a != b
    ) / (n * (n - 1))
    if expected == 0:
        return math.nan
    return 1.0 - observed / expected


def pair_agreement(items: Sequence[Sequence[float | None]]) -> dict[str, float]:
    """Agreement on pairwise choices (per item, each annotator's choice: 1 for A, 0 for B, 0.5
    for a tie, None for "cannot judge"): ``raw`` is the share of annotator pairs (on one item)
    that chose alike, ``alpha`` Krippendorff's nominal alpha, ``pairs`` how many annotator
    pairs there were. NaN where nothing is pairable."""
    agreeing = pairs = 0
    for values in items:
        chosen = [v for v in values if v is not None]
        for i in range(len(chosen)):
            for j in range(i + 1, len(chosen)):
                pairs += 1
                agreeing += chosen[i] == chosen[j]
    return {
        "raw": agreeing / pairs if pairs else math.nan,
        "alpha": krippendorff_alpha(items, "nominal"),
        "pairs": float(pairs),
    }


@dataclass
class Consensus:
    """What the agreement filter made of one item's judgements."""

    kept: bool
    value: float | None  # the agreeing annotators' mean, normalised to [0, 1]
    agreeing: int  # annotators in the largest group within the tolerance
    judged: int  # judgements with a value
    reason: str = ""  # why an item was filtered out: "too few judgements" or "disagreement"


def normalise(value: float, low: float, high: float) -> float:
    """``value`` on the scale [low, high] mapped to [0, 1]."""
    return (value - low) / (high - low)


def largest_agreeing(
    values: Sequence[float], within: float, low: float = 0.0, high: float = 1.0, strict: bool = True
) -> list[float]:
    """The largest group of ``values`` (on [low, high]) whose spread, on the scale mapped to
    [0, 1], is below ``within`` (at most ``within`` when not ``strict``); sorted, the first such
    group on a tie."""
    span = (high - low) or 1.0
    ordered = sorted(values)
    best: list[float] = []
    for i, first in enumerate(ordered):
        group = [
            v
            for v in ordered[i:]
            if ((v - first) / span < within if strict else (v - first) / span <= within + 1e-12)
        ]
        if len(group) > len(best):
            best = group
    return best


def consensus(
    values: Sequence[float | None],
    low: float,
    high: float,
    min_agree: int = 2,
    tolerance: float = 0.3,
) -> Consensus:
    """Whether at least ``min_agree`` of ``values`` (on [low, high]; None: "cannot judge")
    agree, i.e. lie within less than ``tolerance`` of one another once normalised to [0, 1];
    the largest such group is the consensus and its mean the item's value (normalised)."""
    if tolerance <= 0:
        raise ValueError(
            f"tolerance must be above 0 (values agree when closer than it), got {tolerance}"
        )
    given = [v for v in values if v is not None]
    if len(given) < min_agree:
        return Consensus(False, None, 0, len(given), "too few judgements")
    best = [normalise(v, low, high) for v in largest_agreeing(given, tolerance, low, high)]
    if len(best) < min_agree:
        return Consensus(False, None, len(best), len(given), "disagreement")
    return Consensus(True, sum(best) / len(best), len(best), len(given))


@dataclass
class FilterCounts:
    """How many items the agreement filter kept, and why the others went."""

    kept: int = 0
    too_few: int = 0  # fewer than min_agree judgements with a value
    disagreed: int = 0  # enough judgements, but not min_agree of them within the tolerance

    def add(self, verdict: Consensus) -> None:
        if verdict.kept:
            self.kept += 1
        elif verdict.reason == "too few judgements":
            self.too_few += 1
        else:
            self.disagreed += 1


@dataclass
class _Unit:
    """One item's values (None left out) and what it adds to the sums below while pairable."""

    values: list[float] = field(default_factory=list)
    observed: Fraction = Fraction(0)  # sum over ordered value pairs of the distance, / (m - 1)


class AgreementTracker:
    """Krippendorff's alpha over the ratings (interval metric, values normalised to [0, 1]),
    and raw agreement and nominal alpha over the pairs, kept as running sums: :meth:`add` and
    :meth:`remove` of one judgement cost O(annotators of that item), whatever the number of
    items, and :meth:`summary` O(1). The sums are exact (fractions), so the figures equal
    :func:`krippendorff_alpha` and :func:`pair_agreement` over the same judgements up to the
    rounding of those float computations.

    The sums, over pairable items (two values or more): n values; for ratings the sum and the
    sum of squares of the values (the expected disagreement is ``2 (n S2 - S1^2)``) and of
    each item's ``2 (m s2 - s1^2) / (m - 1)`` (the observed one); for pairs the count of each
    choice, each item's ``(m^2 - sum c^2) / (m - 1)`` and its agreeing and all annotator
    pairs."""

    def __init__(self) -> None:
        self.units: dict[tuple[str, int], _Unit] = {}
        self.items = {"rating": 0, "pair": 0}
        self.n = {"rating": 0, "pair": 0}
        self.observed = {"rating": Fraction(0), "pair": Fraction(0)}
        self.sum1 = Fraction(0)  # ratings
        self.sum2 = Fraction(0)
        self.choices: Counter[float] = Counter()  # pairs
        self.choices_sq = 0
        self.agreeing = 0
        self.pairs = 0

    def add(self, item: int, kind: str, value: float | None) -> None:
        """One more judgement of ``item`` (a rating's value normalised to [0, 1]; a pair's
        choice 1, 0 or 0.5); None ("cannot judge") changes nothing."""
        if value is not None:
            self._change(item, kind, float(value), +1)

    def remove(self, item: int, kind: str, value: float | None) -> None:
        """A judgement :meth:`add` counted, taken back."""
        if value is not None:
            self._change(item, kind, float(value), -1)

    def _change(self, item: int, kind: str, value: float, sign: int) -> None:
        group = "pair" if kind == "pair" else "rating"
        unit = self.units.setdefault((group, item), _Unit())
        if len(unit.values) >= 2:
            self._count(group, unit, -1)
        if sign > 0:
            unit.values.append(value)
        else:
            unit.values.remove(value)
        if len(unit.values) >= 2:
            unit.observed = self._observed(group, unit.values)
            self._count(group, unit, +1)
        elif not unit.values:
            del self.units[(group, item)]

    @staticmethod
    def _observed(group: str, values: list[float]) -> Fraction:
        m = len(values)
        if group == "rating":
            s1 = sum((Fraction(v) for v in values), Fraction(0))
            s2 = sum((Fraction(v) ** 2 for v in values), Fraction(0))
            return 2 * (m * s2 - s1 * s1) / (m - 1)
        counts = Counter(values)
        return Fraction(m * m - sum(c * c for c in counts.values()), m - 1)

    def _count(self, group: str, unit: _Unit, sign: int) -> None:
        """Add (``sign`` 1) or take out (-1) a pairable unit's share of the sums."""
        self.items[group] += sign
        self.n[group] += sign * len(unit.values)
        self.observed[group] += sign * unit.observed
        if group == "rating":
            for v in unit.values:
                self.sum1 += sign * Fraction(v)
                self.sum2 += sign * Fraction(v) ** 2
            return
        counts = Counter(unit.values)
        for v, c in counts.items():
            before = self.choices[v]
            self.choices[v] = before + sign * c
            self.choices_sq += self.choices[v] ** 2 - before**2
            self.agreeing += sign * (c * (c - 1) // 2)
        m = len(unit.values)
        self.pairs += sign * (m * (m - 1) // 2)

    def _alpha(self, group: str) -> float:
        n = self.n[group]
        if self.items[group] < 1 or n < 2:
            return math.nan
        if group == "rating":
            expected = 2 * (n * self.sum2 - self.sum1 * self.sum1)
        else:
            expected = Fraction(n * n - self.choices_sq)
        if expected == 0:
            return math.nan
        return float(1 - (n - 1) * self.observed[group] / expected)

    def summary(self) -> dict[str, Any]:
        """The figures, shaped like ``alignzoo.human.export.agreement``'s (None where
        nothing is pairable yet)."""

        def clean(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 6)

        return {
            "ratings": {
                "items": self.items["rating"],
                "krippendorff_alpha": clean(self._alpha("rating")),
            },
            "pairs": {
                "items": self.items["pair"],
                "raw_agreement": clean(self.agreeing / self.pairs if self.pairs else math.nan),
                "krippendorff_alpha": clean(self._alpha("pair")),
                "annotator_pairs": self.pairs,
            },
        }
