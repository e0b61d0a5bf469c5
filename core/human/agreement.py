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
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
