"""Data-parallel training with torch.distributed: 2 processes (gloo, CPU, launched by torchrun)
train exactly as 1 process with the same global batch: the same losses, rewards, KL, entropy,
evaluations and final weights (within 1e-5), for GRPO, PPO and offline DPO; only rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from .conftest import read_jsonl, tiny_experiment

pytestmark = pytest.mark.slow

# A reward that varies within groups from the first step (the tiny warm start is rarely right).
ODD = {"name": "regex", "params": {"pattern": "[13579]"}}
ARMS = {
    "grpo": {"algorithm": "grpo", "labeler": ODD},  # beta 0.04: a reference model too
    "ppo": {"algorithm": "ppo", "labeler": ODD},  # a critic, whitened advantages, adaptive KL
    "dpo": {"algorithm": "dpo", "online": False},
}
COMPARED = ("loss", "reward/mean", "reward/std", "kl/ref", "entropy", "actor/grad_norm",
            "critic/grad_norm", "response_length/mean", "label/generated", "batch/responses")  # fmt: skip


def _run(args: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return load_file(str(latest / "actor.safetensors"))


def test_two_processes_train_as_one(tmp_path: Path, engine_cache: Path) -> None:
    spec = tiny_experiment(
        budget={"steps": 3},
        training={
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "micro_batch_size": 8,
            "checkpoint_every": 3,
        },
        evaluation={"every": 3, "num_prompts": 8},
        arms=ARMS,
    )
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNZOO_CACHE": str(engine_cache)}
    cli = [sys.executable, "-m", "alignzoo"]
    _run([*cli, "run", "exp.yaml", "--out", "one"], env, tmp_path)  # also builds the warm start
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    _run([*launcher, "-m", "alignzoo", "run", "exp.yaml", "--out", "two"], env, tmp_path)

    assert not (tmp_path / "two" / ".ranks").exists()  # the other rank's scratch is gone
    assert (tmp_path / "two" / "report.md").is_file()
    for arm in ARMS:
        one, two = tmp_path / "one" / arm / "seed-0", tmp_path / "two" / arm / "seed-0"
        assert json.loads((two / "status.json").read_text())["status"] == "finished", arm
        rows_one, rows_two = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
        assert len(rows_one) == len(rows_two) == 3, arm
        for step, (a, b) in enumerate(zip(rows_one, rows_two, strict=True), start=1):
            for key in COMPARED:
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (arm, step, key)
        evals_one, evals_two = read_jsonl(one / "eval.jsonl"), read_jsonl(two / "eval.jsonl")
        assert [e["step"] for e in evals_one] == [e["step"] for e in evals_two], arm
        for a, b in zip(evals_one, evals_two, strict=True):
            for key, value in a.items():
                if key.startswith("eval/"):
                    assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (arm, key)
        w1, w2 = _weights(one), _weights(two)
        assert set(w1) == set(w2), arm
        for name in w1:
            if name.endswith("k_proj.bias"):
                # Softmax ignores a shift shared by all keys of a query: this bias's gradient
                # is rounding noise, which Adam scales up to steps of about lr either way.
                continue
            torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6)
        assert max(r["actor/grad_norm"] for r in rows_one) > 0, f"premise: {arm} trains"
