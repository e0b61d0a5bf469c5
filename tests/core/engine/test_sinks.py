"""Sinks: metrics.jsonl always, TensorBoard when asked, a clear error when wandb is missing."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from alignzoo.config.schema import WandbConfig
from alignzoo.engine.sinks import Sinks, console_line
from alignzoo.errors import UserError
from alignzoo.plugins.algorithms.dpo import DPO
from alignzoo.plugins.algorithms.ppo import PPO


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
def test_console_line_shows_what_each_algorithms_users_watch() -> None:
    offline_dpo = {
        "batch/prompts": 4.0,
        "batch/responses": 8.0,
        "response_length/mean": 5.0,
        "loss": 0.69,
        "kl/ref": 0.0012,
        "entropy": 0.5,
        "dpo/rewards/accuracy": 0.75,
        "dpo/rewards/margin": 0.03,
        "actor/grad_norm": 0.42,
        "lr": 1e-4,
        "timing/step": 0.1,
    }
    line = console_line(offline_dpo, DPO.watched_metrics)
    assert "reward" not in line.split("│")[1]  # no "reward -" for an arm that is not scored
    assert "dpo/rewards/accuracy 0.75" in line and "dpo/rewards/margin 0.03" in line
    assert "kl/ref 0.0012" in line and "grad 0.42 lr 1.00e-04" in line
    ppo = {**offline_dpo, "reward/mean": 0.3, "reward/std": 0.1, "actor/clipfrac": 0.05}
    ppo["critic/vf_loss"] = 0.2
    line = console_line(ppo, PPO.watched_metrics)
    assert "reward 0.300 ± 0.100" in line
    assert "actor/clipfrac 0.05" in line and "critic/vf_loss 0.2" in line
    assert "kl/ref" not in console_line({k: v for k, v in ppo.items() if k != "kl/ref"})


def test_tensorboard_sink_writes_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {"arm": "grpo", "seed": 1, "arm_spec": {"algorithm": {"name": "grpo", "params":
              {"beta": 0.0}}, "training": {"lr": 0.001}}}  # fmt: skip
    sinks = Sinks(tmp_path, ["jsonl", "tensorboard"], None, "r", config=config)
    sinks.step({"step": 1, "reward/mean": 0.5}, 1)
    sinks.samples([{"step": 1, "prompt": "1+1=", "response": "2 | 3", "score": 1.0}])
    sinks.evaluation({"step": 1, "eval/exact_match": 0.1})
    assert sinks.hparams() == {"arm": "grpo", "seed": 1, "algorithm": "grpo", "labeler": "",
                               "training.lr": 0.001, "params.beta": 0.0}  # fmt: skip
    sinks.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    tags = events.Tags()["tensors"]
    assert "config/text_summary" in tags and "samples/text_summary" in tags
    table = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "1+1=" in table and "2 \\| 3" in table  # a pipe in a response does not break it
    assert list((tmp_path / "tensorboard" / "hparams").glob("events.out.tfevents.*"))
    assert math.isclose(json.loads((tmp_path / "eval.jsonl").read_text())["eval/exact_match"], 0.1)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_missing_is_a_user_error_naming_the_extra(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"pip install alignzoo\[wandb\]"):
        Sinks(tmp_path, ["wandb"], None, "r", WandbConfig())


class _FakeWandbRun:
    def __init__(self, **kwargs: object) -> None:
        self.init_kwargs = kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, data: dict, step: int | None = None) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


def test_wandb_sink_groups_by_experiment_and_logs_config(tmp_path: Path, monkeypatch) -> None:
    """The W&B calls alignzoo makes, checked against a stand-in module (no account needed)."""
    import sys
    import types

    runs: list[_FakeWandbRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_FakeWandbRun(**kw)) or runs[-1]  # type: ignore[attr-defined]
    fake.Table = lambda columns, data: {"columns": columns, "data": data}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = {"arm": "grpo", "seed": 1, "arm_spec": {"algorithm": {"name": "grpo"}}}
    sinks = Sinks(
        tmp_path, ["jsonl", "wandb"], None, "exp/grpo/seed-1", WandbConfig(), "exp", config
    )
    sinks.step({"step": 3, "reward/mean": 0.5, "note": "text is not logged"}, 3)
    sinks.evaluation({"step": 3, "eval/exact_match": 0.25})
    sinks.samples([{"step": 3, "prompt": "p", "response": "r", "score": 0.5}])
    sinks.close()
    (run,) = runs
    tables = [d["samples"] for d, _ in run.logged if "samples" in d]
    assert tables == [{"columns": ["step", "prompt", "response", "score"],
                       "data": [[3, "p", "r", 0.5]]}]  # fmt: skip
    kwargs = run.init_kwargs
    assert kwargs["mode"] == "offline" and kwargs["group"] == "exp" and kwargs["name"] == "grpo-1"
    assert kwargs["config"] == config and kwargs["project"] == "alignzoo"
    assert ({"reward/mean": 0.5}, 3) in run.logged
    assert any(d.get("eval/exact_match") == 0.25 and s == 3 for d, s in run.logged)
    assert run.finished
