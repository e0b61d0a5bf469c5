"""A LoRA arm's checkpoints hold its adapters only (not the base weights), and a run resumed
from one continues exactly as the uninterrupted run."""

from __future__ import annotations

from safetensors import safe_open

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

VOLATILE = ("time_s", "timing/", "throughput/", "labeler/")


def _stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def test_lora_checkpoints_hold_adapters_only_and_resume_exactly(write_experiment, tmp_path):
    odd = {"name": "regex", "params": {"pattern": "[13579]"}}  # rewards that vary from step 1
    spec = tiny_experiment(
        budget={"steps": 4},
        model={"lora": {"r": 2, "alpha": 4}},
        training={"lr": 1e-2},
        arms={"grpo": {"algorithm": "grpo", "labeler": odd}},
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    reference = _stable(read_jsonl(out / "metrics.jsonl"))
    with safe_open(str(out / "checkpoints" / "step-000004" / "actor.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert f.metadata()["format"] == "adapters"
    assert keys and all("lora_" in k for k in keys)

    with safe_open(str(out / "checkpoints" / "step-000002" / "actor.safetensors"), "pt") as f:
        moved = max(float(f.get_tensor(k).abs().max()) for k in f.keys() if "lora_B" in k)  # noqa: SIM118
    assert moved > 0, "premise: the adapters trained by step 2 (else resume proves nothing)"
    back_to_checkpoint(out, 2)
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    assert _stable(read_jsonl(out / "metrics.jsonl")) == reference
