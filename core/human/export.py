"""Judgements from the human queue as training data: the agreement filter, then a `datasets`
folder that DPO, KTO and reward-model training read directly (``data.train: DIR``).

- ``preference`` (prompt / chosen / rejected): each kept pair judged A or B better; and, from
  kept ratings, every two responses to one prompt whose consensus values differ by at least the
  tolerance (the better-rated one is chosen). Ties are left out.
- ``unpaired`` (prompt / completion / label): each kept rating, labelled desirable when its
  consensus value (normalised to [0, 1]) is at least ``threshold``; each kept pair gives its
  winner (True) and its loser (False).

Every row carries ``agreeing`` and ``judged`` (annotators in the consensus, judgements with a
value). Beside the data, ``alignzoo_export.json`` holds the agreement (Krippendorff's alpha
for ratings; raw and chance-corrected agreement for pairs), the filter's counts and settings.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from alignzoo.human.agreement import (
    Consensus,
    FilterCounts,
    consensus,
    krippendorff_alpha,
    normalise,
    pair_agreement,
)
from alignzoo.human.queue import HumanQueue, Item, read_source

SUMMARY_FILE = "alignzoo_export.json"
Kind = Literal["preference", "unpaired"]


def agreement(queue: HumanQueue) -> dict[str, Any]:
    """Agreement over the whole queue: for ratings, Krippendorff's alpha (interval metric, on
    the normalised scale); for pairs, raw and chance-corrected agreement; each with the items
    it rests on (those with two values or more). NaN values (nothing pairable yet) are given
    as None."""
    ratings, pairs = [], []
    for item, given in queue.items():
        values = [v for _, v in given]
        if sum(v is not None for v in values) < 2:
            continue  # not pairable: agreement rests on items with two values or more
        if item.kind == "pair":
            pairs.append(values)
        else:
            ratings.append(
                [None if v is None else normalise(v, item.low, item.high) for v in values]
            )
    pair = pair_agreement(pairs)

    def clean(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 6)

    return {
        "ratings": {
            "items": len(ratings),
            "krippendorff_alpha": clean(krippendorff_alpha(ratings, "interval")),
        },
        "pairs": {
            "items": len(pairs),
            "raw_agreement": clean(pair["raw"]),
            "krippendorff_alpha": clean(pair["alpha"]),
            "annotator_pairs": int(pair["pairs"]),
        },
    }


@dataclass
class ExportSummary:
    """What :func:`export` wrote, and what the agreement filter did."""

    rows: int
    kind: str
    min_agree: int
    tolerance: float
    ratings: FilterCounts = field(default_factory=FilterCounts)
    pairs: FilterCounts = field(default_factory=FilterCounts)
    ties: int = 0
    agreement: dict[str, Any] = field(default_factory=dict)
    experiment: str | None = None  # the experiment whose arm sampled the items (if recorded)
    arm: str | None = None


def _verdicts(
    queue: HumanQueue, min_agree: int, tolerance: float, summary: ExportSummary
) -> list[tuple[Item, Consensus]]:
    kept = []
    for item, given in queue.items():
        verdict = consensus([v for _, v in given], item.low, item.high, min_agree, tolerance)
        (summary.pairs if item.kind == "pair" else summary.ratings).add(verdict)
        if verdict.kept:
            kept.append((item, verdict))
    return kept


def export(
    queue_dir: str | Path,
    out: str | Path,
    kind: Kind = "preference",
    min_agree: int = 2,
    tolerance: float = 0.3,
    threshold: float = 0.5,
) -> ExportSummary:
    """Write the queue's agreed judgements to ``out`` (``Dataset.save_to_disk``) as ``kind``
    data; returns the counts (also written to ``out/alignzoo_export.json``)."""
    import datasets

    if kind not in ("preference", "unpaired"):
        raise ValueError(f"kind must be 'preference' or 'unpaired', got {kind!r}")
    queue = HumanQueue(queue_dir)
    try:
        summary = ExportSummary(rows=0, kind=kind, min_agree=min_agree, tolerance=tolerance)
        kept = _verdicts(queue, min_agree, tolerance, summary)
        summary.agreement = agreement(queue)
        source = read_source(queue_dir)
        summary.experiment, summary.arm = source.get("experiment"), source.get("arm")
    finally:
        queue.close()
    rows: list[dict[str, Any]] = []
    by_prompt: dict[str, list[tuple[Item, Consensus]]] = {}
    for item, verdict in kept:
        assert verdict.value is not None
        tags = {"agreeing": verdict.agreeing, "judged": verdict.judged}
        if item.kind == "pair":
            assert item.other is not None
            if verdict.value == 0.5:
                summary.ties += 1
                continue
            better, worse = (
                (item.response, item.other) if verdict.value > 0.5 else (item.other, item.response)
            )
            if kind == "preference":
                rows.append({"prompt": item.prompt, "chosen": better, "rejected": worse, **tags})
            else:
                rows.append({"prompt": item.prompt, "completion": better, "label": True, **tags})
                rows.append({"prompt": item.prompt, "completion": worse, "label": False, **tags})
        elif kind == "unpaired":
            label = verdict.value >= threshold
            rows.append(
                {"prompt": item.prompt, "completion": item.response, "label": label, **tags}
            )
        else:
            by_prompt.setdefault(item.prompt, []).append((item, verdict))
    for prompt, rated in by_prompt.items():
        for a, va in rated:
            for b, vb in rated:
                assert va.value is not None and vb.value is not None
                if a is not b and va.value - vb.value >= tolerance:
                    rows.append(
                        {
                            "prompt": prompt,
                            "chosen": a.response,
                            "rejected": b.response,
                            "agreeing": min(va.agreeing, vb.agreeing),
                            "judged": min(va.judged, vb.judged),
                        }
                    )
    summary.rows = len(rows)
    out = Path(out)
    columns = (
        ["prompt", "chosen", "rejected", "agreeing", "judged"]
        if kind == "preference"
        else ["prompt", "completion", "label", "agreeing", "judged"]
    )
    data = {c: [r[c] for r in rows] for c in columns}
    datasets.Dataset.from_dict(data).save_to_disk(str(out))
    (out / SUMMARY_FILE).write_text(json.dumps(asdict(summary), indent=2), encoding="utf-8")
    return summary
