"""Sinks: metrics.jsonl always, TensorBoard when asked, a clear error when wandb is missing."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from alignzoo.engine.sinks import Sinks
from alignzoo.errors import UserError
from alignzoo.schema import WandbConfig


def test_jsonl_and_console_line(tmp_path: Path) -> None:
    console = Console(record=True, width=200)
    sinks = Sinks(tmp_path, ["console", "jsonl"], console, "exp/arm/seed-0")
    row = {
        "step": 1,
        "time_s": 0.5,
        "samples": 8,
        "reward/mean": 0.25,
        "reward/std": 0.5,
        "loss": float("nan"),
        "batch/prompts": 2.0,
        "batch/responses": 8.0,
        "response_length/mean": 3.0,
        "timing/step": 0.2,
    }
    sinks.step(row, 1)
    sinks.close()
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written["reward/mean"] == 0.25 and written["loss"] is None  # NaN is not valid JSON
    text = console.export_text()
    assert "step 1" in text and "2 prompts → 8 responses" in text and "reward 0.250 ± 0.500" in text


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard missing")
def test_tensorboard_sink_writes_events(tmp_path: Path) -> None:
    sinks = Sinks(tmp_path, ["jsonl", "tensorboard"], None, "r")
    sinks.step({"step": 1, "reward/mean": 0.5}, 1)
    sinks.evaluation({"step": 1, "eval/exact_match": 0.1})
    sinks.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert math.isclose(json.loads((tmp_path / "eval.jsonl").read_text())["eval/exact_match"], 0.1)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_missing_is_a_user_error_naming_the_extra(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"pip install alignzoo\[wandb\]"):
        Sinks(tmp_path, ["wandb"], None, "r", WandbConfig())
