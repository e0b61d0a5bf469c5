"""Peak memory of a LoRA arm with a reference: one copy of the base weights (the reference is
the actor with its adapters off) against what a second, separately loaded copy costs.

A Qwen2 policy of 33.7M parameters (hidden 512, 8 layers, the embedded byte tokenizer)
is saved to a temporary folder; each measurement runs in a fresh process that assembles a GRPO
arm (beta 0.04, so it has a reference) with LoRA r=8 and trains 3 steps, and reports its peak
RSS. "second copy" also loads the reference the way a full-weight arm does.

    .venv/bin/python benchmarks/lora_memory.py [--json results.json]

``--json`` also writes both peaks with the provenance of the run (commit, lock, CPU, threads).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

CHILD = r"""
import json, resource, sys
from pathlib import Path
from alignzoo.config.loader import load_experiment
from alignzoo.engine import models as model_loading
from alignzoo.engine.assemble import assemble
from alignzoo.engine.step import train_step

exp, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
run = assemble(load_experiment(exp), "lora", 0, out, log=lambda *_: None)
if mode == "second copy":
    run.models.reference = model_loading.load_reference(
        run.models.policy_path, run.arm.model, "cpu")
for step in (1, 2, 3):
    run.context.step = step
    train_step(run, step)
kind = type(run.models.reference).__name__
print(json.dumps({"mode": mode, "reference": kind,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    from alignzoo.config.schema import EmbeddedModelConfig
    from alignzoo.world.model import build_model
    from alignzoo.world.tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "policy"
        tokenizer = build_tokenizer()
        cfg = EmbeddedModelConfig(
            hidden_size=512, num_layers=8, num_heads=8, intermediate_size=2048
        )
        model = build_model(cfg, tokenizer)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        spec = {
            "name": "lora-memory",
            "seeds": [0],
            "budget": {"steps": 3},
            "model": {"policy": str(folder), "lora": {"r": 8, "alpha": 16}},
            "data": {"task": {"digits": 2, "train_size": 64, "eval_size": 8}},
            "training": {"prompts_per_step": 8, "samples_per_prompt": 4,
                         "sampling": {"max_new_tokens": 6}},
            "evaluation": {"every": 100, "num_prompts": 8},
            "logging": {"sinks": ["jsonl"]},
            "arms": {"lora": {"algorithm": {"name": "grpo", "params": {"beta": 0.04}}}},
        }  # fmt: skip
        exp = Path(tmp) / "exp.yaml"
        exp.write_text(yaml.safe_dump(spec))
        print(f"policy: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MB in fp32)")
        rows = []
        for mode in ("one copy", "second copy"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(exp), str(Path(tmp) / mode), mode],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{row['mode']:>12}: peak RSS {row['peak_rss_mb']:.0f} MB "
                  f"(reference: {row['reference']})")  # fmt: skip
        if args.json is not None:
            from alignzoo.report.results import write_measurement

            document = {
                "parameters": params,
                "weights_mb": params * 4 / 2**20,
                "rows": rows,
                "difference_mb": rows[1]["peak_rss_mb"] - rows[0]["peak_rss_mb"],
            }
            write_measurement(args.json, document)


if __name__ == "__main__":
    main()
