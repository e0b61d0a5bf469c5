"""How well PPO's adaptive KL controller held its target in an experiment's runs.

For every run of every arm whose steps log ``kl/target`` (``kl_controller: adaptive``), from
``metrics.jsonl``: the share of steps from ``--from-step`` on whose trailing ``--window``-step
mean of ``kl/measured`` lies within [0.5, 1.5] x the target, the first step where that mean
enters the band, and the coefficient's range. Arms with a fixed coefficient are shown for
comparison (their measured KL against the adaptive arms' target, when there is one).

    .venv/bin/python benchmarks/kl_control.py runs/rlhf_pipeline/ab [--window 10] [--from-step 20]
        [--json docs/results/rlhf-kl.json]

``--json`` also writes every run's figures and the runs' provenance settings (commit, lock, CPU
and its kernels, threads) as one JSON file, what the documentation's figures are checked against.

Reads run folders only; trains nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

BAND = (0.5, 1.5)


def read_metrics(run: Path) -> list[dict[str, float]]:
    rows = []
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def held(rows: list[dict[str, float]], target: float, window: int, start: int) -> dict[str, float]:
    """The share of steps >= ``start`` whose trailing mean KL is within the band of ``target``,
    the first step it is, and the measured KL's and coefficient's ranges."""
    measured = [(int(r["step"]), float(r["kl/measured"])) for r in rows if "kl/measured" in r]
    inside, total, first = 0, 0, None
    for i, (step, _) in enumerate(measured):
        if i + 1 < window:
            continue
        mean = statistics.fmean(v for _, v in measured[i + 1 - window : i + 1])
        ok = BAND[0] * target <= mean <= BAND[1] * target
        if ok and first is None:
            first = step
        if step >= start:
            total += 1
            inside += ok
    coefs = [float(r["kl/coef"]) for r in rows if "kl/coef" in r]
    values = [v for _, v in measured]
    return {
        "share_in_band": inside / total if total else float("nan"),
        "first_step_in_band": float(first) if first is not None else float("nan"),
        "kl_median": statistics.median(values) if values else float("nan"),
        "coef_min": min(coefs) if coefs else float("nan"),
        "coef_max": max(coefs) if coefs else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", type=Path, help="An experiment's output folder.")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--from-step", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    document: dict[str, Any] = {
        "window": args.window,
        "from_step": args.from_step,
        "band": list(BAND),
        "arms": {},
    }
    runs = sorted(p.parent for p in args.experiment.glob("*/seed-*/metrics.jsonl"))
    by_arm: dict[str, list[tuple[Path, list[dict[str, float]]]]] = {}
    for run in runs:
        by_arm.setdefault(run.parent.name, []).append((run, read_metrics(run)))
    targets = [
        float(r["kl/target"]) for runs_ in by_arm.values() for _, rows in runs_ for r in rows[:1]
        if "kl/target" in r
    ]  # fmt: skip
    reference = targets[0] if targets else None
    for arm, arm_runs in by_arm.items():
        target = next((float(r["kl/target"]) for r in arm_runs[0][1] if "kl/target" in r), None)
        kind = "adaptive" if target is not None else "fixed"
        target = target if target is not None else reference
        if target is None:
            continue
        stats = [held(rows, target, args.window, args.from_step) for _, rows in arm_runs]
        shares = [s["share_in_band"] for s in stats]
        firsts = [s["first_step_in_band"] for s in stats]
        summary = {
            "share_in_band": [min(shares), max(shares)],
            "first_step_in_band": [min(firsts), max(firsts)],
            "kl_median": statistics.median(s["kl_median"] for s in stats),
            "coef": [min(s["coef_min"] for s in stats), max(s["coef_max"] for s in stats)],
        }
        document["arms"][arm] = {
            "kind": kind,
            "target": target,
            "summary": summary,
            "runs": {f"{arm}/{run.name}": s for (run, _), s in zip(arm_runs, stats, strict=True)},
        }
        print(
            f"{arm} ({kind}, target {target:g}, {len(stats)} runs): steps >= {args.from_step} "
            f"with the {args.window}-step mean KL in [{BAND[0]}, {BAND[1]}] x target: "
            f"{min(shares):.0%} to {max(shares):.0%}; first in the band at step "
            f"{min(firsts):.0f} to {max(firsts):.0f}; median KL {summary['kl_median']:.3g}; "
            f"coefficient {summary['coef'][0]:.3g} to {summary['coef'][1]:.3g}"
        )
    if args.json is not None:
        from alignzoo.provenance import distinct_settings

        named = {f"{run.parent.name}/{run.name}": run for run in runs}
        document["provenance"] = {"settings": distinct_settings(named)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(finite(document), indent=1, sort_keys=True, allow_nan=False)
        args.json.write_text(text + "\n")


def finite(value: Any) -> Any:
    """``value`` with NaN (a run never in the band) as null: strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


if __name__ == "__main__":
    main()
