"""Synchronous against asynchronous GRPO (training.async): samples per second on the same work.

    .venv/bin/python benchmarks/async_throughput.py [--model 25m|embedded] [--steps 6]
        [--new-tokens 128] [--latency auto|SECONDS] [--json results.json]

Two workloads on the same model folder and prompts (the embedded task's, 8 prompts x 8
samples a step, temperature 1, beta 0, one update per batch):

(a) decode-bound: 128 new tokens (the 25.8M model is random: no row stops early), a labeler
    that answers at once;
(b) the same with a labeler that waits ``--latency`` seconds per call (``auto``: the
    synchronous arm's measured update time per step, so labeling costs about one update), as a
    remote reward service or a judge would.

Arms, each a fresh run in this process (its producers in processes of their own): ``sync``;
``k1``, one producer one step ahead; ``k1x2``, two producers one step ahead. Producers run
``--producer-threads`` torch threads (default 1) beside the trainer's. The figure per arm is
samples per second over the steps from the third on (the first steps load the producers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
PROMPTS, SAMPLES = 8, 8


def run_arm(
    name: str,
    folder: Path,
    data: Path,
    steps: int,
    new_tokens: int,
    latency: float,
    settings: dict[str, Any] | None,
    out: Path,
) -> dict[str, Any]:
    """Train one arm; its steps' end times and metrics."""
    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.loop import run_one

    arm: dict[str, Any] = {"algorithm": {"name": "grpo", "params": {"beta": 0.0}}}
    if settings is not None:
        arm["training"] = {"async": settings}
    spec = {
        "name": "async-throughput",
        "seeds": [0],
        "budget": {"steps": steps},
        "model": {"policy": str(folder)},
        "data": {"train": str(data), "eval": str(data)},
        "training": {
            "lr": 1e-5,
            "prompts_per_step": PROMPTS,
            "samples_per_prompt": SAMPLES,
            "micro_batch_size": 128,
            "checkpoint_every": steps,
            "sampling": {"temperature": 1.0, "max_new_tokens": new_tokens},
        },
        "evaluation": {"every": 10 * steps, "num_prompts": 1, "labeler": "arithmetic"},
        "logging": {"sinks": ["jsonl"]},
        "defaults": {
            "labeler": {
                "name": "python",
                "params": {
                    "function": "alignzoo.world.rewards:exact_match",
                    "kwargs": {"latency_s": latency},
                    "validate_call": False,
                },
            }
        },
        "arms": {name: arm},
    }
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    summary = run_one(load_experiment(path), name, 0, out / name)
    if summary.status != "finished":
        raise SystemExit(f"{name} failed: {summary.error}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").open()]
    ends = [r["time_s"] for r in rows]
    gaps = [b - a for a, b in itertools.pairwise(ends[1:])]  # from the third step on
    seconds = statistics.median(gaps)
    keys = ("timing/generate", "timing/label", "timing/update", "async/trainer_wait_s")
    phases = {k: statistics.median(r[k] for r in rows[2:]) for k in keys if k in rows[-1]}
    return {
        "arm": name,
        "s_per_step": seconds,
        "samples_per_s": PROMPTS * SAMPLES / seconds,
        "step_ends_s": ends,
        "phases": phases,
        "staleness": [r.get("rollout/staleness", 0.0) for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("25m", "embedded"), default="25m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--latency", default="auto")
    parser.add_argument("--producer-threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import vs_trl  # the 25.8M model and the data files of the TRL comparison

    arms = {
        "sync": None,
        "k1": {"max_staleness": 1, "producer_threads": args.producer_threads},
        "k1x2": {"max_staleness": 1, "producers": 2, "producer_threads": args.producer_threads},
    }
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        folder = vs_trl.prepare_models(tmp, [args.model])[args.model]
        data = vs_trl.prepare_data(tmp)["online"]
        for workload in ("a", "b"):
            latency = 0.0
            if workload == "b":
                latency = (
                    results["a"][0]["phases"]["timing/update"]
                    if args.latency == "auto"
                    else float(args.latency)
                )
            rows = results[workload] = []
            for name, settings in arms.items():
                out = tmp / f"{workload}-{name}"
                out.mkdir()
                row = run_arm(
                    name, folder, data, args.steps, args.new_tokens, latency, settings, out
                )
                row["latency_s"] = latency
                rows.append(row)
                base = rows[0]["samples_per_s"]
                print(
                    f"({workload}) latency {latency:.2f} s  {name:5s} {row['s_per_step']:7.2f} "
                    f"s/step  {row['samples_per_s']:6.2f} samples/s  x{row['samples_per_s'] / base:.2f}"
                    f"  phases {json.dumps({k: round(v, 2) for k, v in row['phases'].items()})}",
                    flush=True,
                )
    if args.json is not None:
        from alignzoo.report.results import write_measurement

        document = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "workloads": results,
        }
        write_measurement(args.json, document)


if __name__ == "__main__":
    main()
