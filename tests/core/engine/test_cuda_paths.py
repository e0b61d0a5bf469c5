"""The GPU code paths: bf16 autocast, roles split over devices, flash-attn.

Skipped where no CUDA device exists (every CPU machine, CI included); a session lent a GPU runs
them with `pytest -q tests/core/engine/test_cuda_paths.py` (about a minute).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from tests.core.engine.conftest import read_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _finite_run(write_experiment, tmp_path, arm: str, **overrides) -> list[dict]:
    loaded = load_experiment(write_experiment(budget={"steps": 4}, **overrides))
    summary = run_one(loaded, arm, 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(math.isfinite(r["loss"]) for r in rows)
    return rows


def test_bf16_autocast_on_one_gpu(write_experiment, tmp_path) -> None:
    rows = _finite_run(
        write_experiment,
        tmp_path,
        "ppo",
        model={"dtype": "bfloat16"},
        arms={
            "ppo": {
                "algorithm": "ppo",
                "devices": {"name": "single", "params": {"device": "cuda:0"}},
            }
        },
    )
    assert rows[-1]["step"] == 4


def test_roles_split_over_devices(write_experiment, tmp_path) -> None:
    last = f"cuda:{torch.cuda.device_count() - 1}"
    devices = {"name": "split", "params": {"default": "cuda:0", "ref": last, "critic": last}}
    _finite_run(
        write_experiment, tmp_path, "ppo", arms={"ppo": {"algorithm": "ppo", "devices": devices}}
    )


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn missing")
def test_flash_attention(write_experiment, tmp_path) -> None:
    _finite_run(
        write_experiment,
        tmp_path,
        "grpo",
        model={"attn_implementation": "flash_attention_2", "dtype": "bfloat16"},
        arms={
            "grpo": {
                "algorithm": "grpo",
                "devices": {"name": "single", "params": {"device": "cuda:0"}},
            }
        },
    )
