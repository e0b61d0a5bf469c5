"""A non-finite loss stops the run with a clear message and leaves the last checkpoint intact."""

from __future__ import annotations

import json
from importlib import metadata

import torch

from alignzoo.config.loader import load_experiment
from alignzoo.engine.checkpoint import latest_checkpoint
from alignzoo.engine.loop import run_one
from alignzoo.plugin import hookimpl
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.registry import ENTRY_POINT_GROUP, Registry

from .conftest import read_jsonl, tiny_experiment


class NaNAfterThree(GRPO):
    """GRPO whose loss turns NaN from the third optimizer step on (a test plugin)."""

    calls = 0

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        result = super().compute_loss(batch, outputs, context)
        NaNAfterThree.calls += 1
        if NaNAfterThree.calls >= 3:  # one micro-batch per step in this experiment
            result.loss = result.loss + torch.tensor(float("nan"))
        return result


def test_nan_loss_fails_the_run_naming_step_and_algorithm(write_experiment, tmp_path) -> None:
    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(NaNAfterThree, "nan_grpo")
    spec = tiny_experiment(
        budget={"steps": 6},
        training={"micro_batch_size": 16, "checkpoint_every": 2},
        arms={"broken": {"algorithm": "nan_grpo"}},
    )
    loaded = load_experiment(write_experiment(spec), registry=registry)
    out = tmp_path / "run"
    NaNAfterThree.calls = 0
    summary = run_one(loaded, "broken", 0, out)

    assert summary.status == "failed"
    assert "step 3" in summary.error and "nan_grpo" in summary.error
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed" and "step 3" in status["error"]
    # The checkpoint of step 2 is the latest and complete; step 3 was never written anywhere.
    folder = latest_checkpoint(out / "checkpoints")
    assert folder is not None and folder.name == "step-000002"
    assert json.loads((folder / "state.json").read_text())["step"] == 2
    assert (folder / "actor.safetensors").stat().st_size > 0
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert "RunError" in (out / "error.log").read_text()


GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed"


class GlooLikeFailure(GRPO):
    """GRPO whose loss raises with text in square brackets, as a gloo error reads (test plugin)."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        raise RuntimeError(GLOO + " [/tmp/x] [bold]")


def test_an_error_in_square_brackets_reaches_the_console_and_status_as_written(
    write_experiment, tmp_path
) -> None:
    from rich.console import Console

    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(GlooLikeFailure, "gloo_grpo")
    spec = tiny_experiment(budget={"steps": 2}, arms={"broken": {"algorithm": "gloo_grpo"}})
    loaded = load_experiment(write_experiment(spec), registry=registry)
    console = Console(record=True, width=400)
    summary = run_one(loaded, "broken", 0, tmp_path / "run", console=console)
    expected = f"RuntimeError: {GLOO} [/tmp/x] [bold]"
    assert summary.status == "failed" and expected in summary.error  # not a MarkupError
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert expected in status["error"]
    assert expected in console.export_text()


def test_the_runs_log_lines_print_outside_text_as_written() -> None:
    """Log lines carry outside text (a checkpoint's reason, a labeler's spec, a file name):
    brackets in it are text, not rich markup (a closing tag raised MarkupError)."""
    from rich.console import Console

    from alignzoo.engine.loop import literal_log

    console = Console(record=True, width=400)
    log = literal_log(console)
    log("checkpoint /runs/[x]/step-2 is unusable ([/tmp/x] [bold] not closed)")
    assert "checkpoint /runs/[x]/step-2 is unusable ([/tmp/x] [bold] not closed)" in (
        console.export_text()
    )
    literal_log(None)("nowhere to go")  # without a console: nothing, no error
