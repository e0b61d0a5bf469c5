"""``alignzoo relabel``: score a run's stored rollouts with another labeler, offline.

Every distinct request in the run folders' label stores (``labels.sqlite``) is scored with the
labeler a YAML file names (``{name: ..., params: {...}}``), through the same labeling stage a
run uses (so its labels are stored too, and a second relabel with the same labeler scores
nothing again). The new values are compared, per labeler found in the store, on the requests
both gave a value: Pearson and Spearman correlation and the share that disagree (values more
than ``tolerance`` apart). The comparison is printed and written to ``relabel.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from alignzoo.config.schema import LabelingConfig
from alignzoo.errors import UserError
from alignzoo.types import Outcome


@dataclass
class Agreement:
    """The new labeler against one labeler found in the store."""

    labeler: str
    pairs: int
    pearson: float | None
    spearman: float | None
    disagree: float


def stores_under(folder: Path) -> list[Path]:
    """``labels.sqlite`` of a run folder, or of every run folder below an experiment folder."""
    from alignzoo.labeling.store import STORE_FILE

    direct = folder / STORE_FILE
    if direct.is_file():
        return [direct]
    return sorted(folder.glob(f"*/seed-*/{STORE_FILE}"))


def _corr(a: list[float], b: list[float]) -> tuple[float | None, float | None]:
    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return None, None
    from scipy import stats

    return float(stats.pearsonr(a, b).statistic), float(stats.spearmanr(a, b).statistic)


def relabel(folder: Path, labeler_file: Path, tolerance: float = 1e-6) -> dict[str, Any]:
    """Relabel the stored rollouts under ``folder``; returns (and writes) the comparison."""
    from alignzoo.engine.hooks import Hooks
    from alignzoo.labeling import LabelingStage, start_labeler
    from alignzoo.labeling.store import LabelStore, labeler_identity, stored_requests
    from alignzoo.labeling.swap import build_labeler, read_ref
    from alignzoo.registry import build_plugin_manager

    if not folder.is_dir():
        raise UserError(f"run folder not found: {folder}")
    stores = stores_under(folder)
    if not stores:
        raise UserError(f"{folder}: no label store (labels.sqlite) in it or in its run folders")
    ref = read_ref(labeler_file)
    component = build_labeler(ref)
    identity = labeler_identity(component)
    start_labeler(build_plugin_manager([component]))
    new: dict[str, float] = {}
    old: dict[str, dict[str, float]] = {}
    total = 0
    for path in stores:
        rows = stored_requests(path)
        total += len(rows)
        cfg = LabelingConfig(on={"abstain": "drop_sample", "exhausted": "drop_sample"})
        stage = LabelingStage.build(
            cfg,
            [(ref.name, component, Hooks(build_plugin_manager([component])))],
            store=LabelStore(path),
        )
        try:
            report = stage.label([request for _, request, _ in rows])
        finally:
            stage.close()
        for (key, _, scores), score in zip(rows, report.scores, strict=True):
            if score.outcome == Outcome.VALUE:
                new[key] = float(score.value)
            for other, s in scores.items():
                if other != identity and s.outcome == Outcome.VALUE:
                    old.setdefault(other, {})[key] = float(s.value)
    results = []
    for other, values in sorted(old.items()):
        keys = [k for k in values if k in new]
        a, b = [values[k] for k in keys], [new[k] for k in keys]
        pearson, spearman = _corr(a, b)
        disagree = sum(abs(x - y) > tolerance for x, y in zip(a, b, strict=True)) / max(
            len(keys), 1
        )
        results.append(Agreement(other, len(keys), pearson, spearman, disagree))
    out = {
        "labeler": identity,
        "requests": total,
        "valued": len(new),
        "stores": [str(p) for p in stores],
        "agreement": [asdict(r) for r in results],
    }
    (folder / "relabel.json").write_text(json.dumps(out, indent=2), encoding="utf-8")
    return out


def describe(result: dict[str, Any]) -> list[str]:
    """Plain lines for the console."""
    lines = [
        f"relabelled {result['requests']} stored requests with {result['labeler']}: "
        f"{result['valued']} got a value"
    ]
    for row in result["agreement"]:

        def fmt(v: float | None) -> str:
            return "n/a" if v is None or math.isnan(v) else f"{v:+.3f}"

        lines.append(
            f"  vs {row['labeler']}: {row['pairs']} pairs, Pearson {fmt(row['pearson'])}, "
            f"Spearman {fmt(row['spearman'])}, disagree {row['disagree']:.1%}"
        )
    return lines
