"""Resume never loses history: unusable checkpoints are named and passed over (or stop the
run with the folder untouched), a run with no checkpoint yet keeps its earlier attempt, and a
plugin's own stream is cut back to the checkpoint like the engine's."""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib import metadata
from pathlib import Path

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.checkpoint import CheckpointError, check_checkpoint, find_resume_point
from alignzoo.engine.loop import run_one
from alignzoo.errors import UserError
from alignzoo.plugin import Modifier, hookimpl
from alignzoo.registry import ENTRY_POINT_GROUP, Registry
from alignzoo.report.sections import _attempts
from alignzoo.runfolder.runfiles import read_run

from .conftest import mark_running, read_jsonl, tiny_experiment

VOLATILE = ("time_s", "timing/", "throughput/", "labeler/")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Probe(Modifier):
    """Records one row per step in the run's own ``probe`` stream (a test plugin)."""

    @hookimpl
    def on_step_end(self, run, step, metrics):
        run.record("probe", {"reward": metrics.get("reward/mean")})


@pytest.fixture
def finished(write_experiment, tmp_path):
    """A finished 6-step run (checkpoints at 4 and 6 kept) and a way to run it again."""
    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(Probe, "probe")
    spec = tiny_experiment(
        budget={"steps": 6},
        training={"checkpoint_every": 2},
        evaluation={"every": 3, "num_prompts": 8},
        arms={"grpo": {"algorithm": "grpo", "labeler": "arithmetic", "modifiers": ["probe"]}},
    )
    loaded = load_experiment(write_experiment(spec), registry=registry)
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    reference = tmp_path / "reference"
    shutil.copytree(out, reference)

    def again(resume: bool = True):
        return run_one(loaded, "grpo", 0, out, resume=resume)

    return out, reference, again


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one(finished) -> None:
    out, reference, again = finished
    newest = out / "checkpoints" / "step-000006"
    weights = newest / "actor.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match=r"actor\.safetensors"):
        check_checkpoint(newest, critic=False)
    point = find_resume_point(out / "checkpoints", critic=False)
    assert point.folder == out / "checkpoints" / "step-000004"
    assert [f.name for f, _ in point.unusable] == ["step-000006"]
    mark_running(out)

    summary = again()

    assert summary.status == "finished", summary.error
    for name in ("metrics.jsonl", "eval.jsonl", "samples.jsonl", "probe.jsonl"):
        assert _stable(read_jsonl(out / name)) == _stable(read_jsonl(reference / name)), name
    # Steps 5 and 6 were trained again from step 4 and the damaged folder was replaced.
    check_checkpoint(newest, critic=False)
    # The lines the resume cut (steps 5 and 6 of the first attempt) are kept, whole.
    kept = out / "attempts" / "1"
    for name in ("metrics.jsonl", "eval.jsonl", "probe.jsonl"):
        assert (kept / name).read_bytes() == (reference / name).read_bytes(), name
    note = json.loads((kept / "attempt.json").read_text())
    assert note["kind"] == "resumed" and note["resumed_from_step"] == 4
    assert "step-000006 unusable" in note["reason"] and "actor.safetensors" in note["reason"]
    # The report shows it as an earlier attempt of the run.
    [attempt] = read_run("grpo", 0, out).attempts
    assert attempt["steps"] == (1, 6) and attempt["folder"] == "attempts/1"
    [heading, _, table] = _attempts([read_run("grpo", 0, out)])
    assert heading.text == "Earlier attempts"
    assert table.rows[0][:5] == ["grpo/seed-0", "1", "resumed", "1-6", "4"]


def test_no_usable_checkpoint_stops_with_the_folder_untouched(finished) -> None:
    out, _, again = finished
    for folder in (out / "checkpoints").glob("step-*"):
        (folder / "state.json").write_bytes(b"\x00\xff binary")
    mark_running(out)
    before = _snapshot(out)

    with pytest.raises(UserError) as caught:
        again()

    message = str(caught.value)
    assert "step-000006" in message and "step-000004" in message and "state.json" in message
    assert "Nothing was changed" in message
    assert _snapshot(out) == before


def test_a_run_with_no_checkpoint_yet_keeps_its_earlier_attempt(finished) -> None:
    out, reference, again = finished
    shutil.rmtree(out / "checkpoints")  # as if killed before the first checkpoint
    old = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "probe.jsonl")}
    mark_running(out)

    summary = again()

    assert summary.status == "finished", summary.error
    kept = out / "attempts" / "1"
    for name, content in old.items():
        assert (kept / name).read_bytes() == content  # nothing lost
    assert json.loads((kept / "attempt.json").read_text())["kind"] == "restarted"
    assert _stable(read_jsonl(out / "metrics.jsonl")) == _stable(
        read_jsonl(reference / "metrics.jsonl")
    )


def test_a_plugin_stream_is_cut_back_to_the_checkpoint(finished) -> None:
    out, reference, again = finished
    shutil.rmtree(out / "checkpoints" / "step-000006")
    (out / "checkpoints" / "latest").write_text("step-000004\n")
    mark_running(out)

    assert again().status == "finished"

    rows = read_jsonl(out / "probe.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 once, not twice
    assert _stable(rows) == _stable(read_jsonl(reference / "probe.jsonl"))
    cut = read_jsonl(out / "attempts" / "1" / "probe.jsonl")  # the first attempt's, kept
    assert [r["step"] for r in cut] == [1, 2, 3, 4, 5, 6]


def test_a_clean_resume_from_the_last_step_keeps_no_attempt(finished) -> None:
    out, _, again = finished
    mark_running(out)  # nothing after the newest checkpoint: nothing to cut, nothing kept
    assert again().status == "finished"
    assert not (out / "attempts").exists()


def test_record_refuses_engine_streams_and_paths(finished) -> None:
    from alignzoo.engine.context import RunContext

    out, _, _ = finished
    context = RunContext.__new__(RunContext)
    context.out_dir, context.step = out, 3
    for bad in ("metrics", "eval", "../x", "a/b", "", "x" * 65):
        with pytest.raises(ValueError, match="plain name"):
            context.record(bad, {})
    assert context.record("mine", {"a": 1}) == out / "mine.jsonl"
    assert read_jsonl(out / "mine.jsonl") == [{"a": 1, "step": 3}]
