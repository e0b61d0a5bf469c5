"""Where a training step's time goes, stage by stage, per algorithm, on this machine.

The stages: generate, label, prepare (the behaviour policy's and the mode's no-grad passes,
batch transforms, advantages), update (the optimizer steps alone) and sync. Runs a short
experiment per algorithm on the embedded world (cached warm start) and prints the median of
each timing metric from metrics.jsonl, plus response tokens per second. The baseline for the
later side-by-side benchmark against TRL on the same work.

    .venv/bin/python benchmarks/engine_step.py [--steps 20] [--algorithms grpo,ppo,dpo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

TIMINGS = (
    "timing/generate",
    "timing/label",
    "timing/prepare",
    "timing/update",
    "timing/sync",
    "timing/step",
)


def experiment(algorithms: list[str], steps: int) -> dict:
    return {
        "name": "bench",
        "seeds": [0],
        "budget": {"steps": steps},
        "training": {
            "lr": 3.0e-5,
            "prompts_per_step": 16,
            "samples_per_prompt": 8,
            "micro_batch_size": 128,
            "checkpoint_every": steps,
            "sampling": {"temperature": 1.0, "max_new_tokens": 6},
        },
        "evaluation": {"every": steps, "num_prompts": 16},
        "logging": {"sinks": ["jsonl"]},
        "arms": {name: {"algorithm": name} for name in algorithms},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--algorithms", default="grpo,ppo,rloo,dpo,kto")
    args = parser.parse_args()
    algorithms = args.algorithms.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(experiment(algorithms, args.steps)))
        loaded = load_experiment(path)
        print(
            f"{'algorithm':10s} "
            + " ".join(f"{t.split('/')[1]:>9s}" for t in TIMINGS)
            + "  tokens/s"
        )
        for name in algorithms:
            out = Path(tmp) / name
            summary = run_one(loaded, name, 0, out)
            if summary.status != "finished":
                print(f"{name:10s} failed: {summary.error}")
                continue
            rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
            rows = rows[1:] or rows  # the first step pays one-off costs
            medians = [statistics.median(r.get(t, 0.0) for r in rows) for t in TIMINGS]
            tokens = statistics.median(r["throughput/tokens_per_s"] for r in rows)
            cells = " ".join(f"{m * 1000:8.0f}ms" for m in medians)
            print(f"{name:10s} {cells}  {tokens:8.0f}")


if __name__ == "__main__":
    main()
