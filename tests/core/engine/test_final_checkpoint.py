"""The final checkpoint's pointer: a run SIGKILLed at any moment of writing a checkpoint (inside
its temporary folder, after the rename and before ``latest``, after ``latest``) and resumed ends
with ``latest`` naming the step status.json reports, and its history, status and exported
weights equal an uninterrupted run's; the same at a checkpoint in the middle of the run, for a
multi-turn (environment) arm, and with a checkpoint mirror. ``alignzoo export`` takes the final
step, says which, and refuses (exit 2, nothing written) when a finished run has no checkpoint
of it."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from alignzoo.cli import main
from alignzoo.engine.checkpoint import pointed_name

from .conftest import KillWorkers, read_jsonl, tiny_experiment

VOLATILE = ("time_s", "timing/", "throughput/", "labeler/", "memory/")
STREAMS = ("metrics.jsonl", "eval.jsonl", "samples.jsonl")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _status(out: Path) -> dict[str, Any]:
    status = json.loads((out / "status.json").read_text())
    return {k: status[k] for k in ("status", "step", "samples", "error", "stopped_early")}


def _exported(run: Path, out: Path) -> tuple[dict[str, Any], str]:
    """The weights ``alignzoo export`` writes of ``run`` (into ``out``) and its model card."""
    assert main(["export", str(run), "--out", str(out)]) == 0
    return load_file(str(out / "model.safetensors")), (out / "README.md").read_text()


def _assert_same_run(full: Path, resumed: Path, final: int, tmp: Path, why: str) -> None:
    for name in STREAMS:
        assert _stable(read_jsonl(resumed / name)) == _stable(read_jsonl(full / name)), (
            f"{name} after {why}"
        )
    assert _status(resumed) == _status(full) == {
        "status": "finished", "step": final, "samples": _status(full)["samples"],
        "error": None, "stopped_early": None,
    }, why  # fmt: skip
    assert pointed_name(resumed / "checkpoints") == f"step-{final:06d}", why
    expected, _ = _exported(full, tmp / f"export-full-{why}")
    got, card = _exported(resumed, tmp / f"export-{why}")
    assert f"{final} steps" in card and f"step {final}, the run's final step" in card, card
    assert set(got) == set(expected)
    different = [k for k in expected if not bool((got[k] == expected[k]).all())]
    assert not different, f"exported weights differ after {why}: {different[:3]}"


def _chain(workers: KillWorkers, exp: Path, out: Path, points: list[str]) -> None:
    """Kill at each point in turn (each after a resume), then resume to the end."""
    for i, point in enumerate(points):
        code, output = workers.run(exp, out, resume=i > 0, kill_at=point)
        assert code == -signal.SIGKILL, f"kill at {point}: exit {code}\n{output}"
    code, output = workers.run(exp, out, resume=True, kill_at=None)
    assert code == 0, output


# Seven steps, checkpoints every 3 and evaluations every 2: the final step (7) is checkpointed
# and evaluated after the loop, not on either cadence.
STEPS, EVERY = 7, 3
CHAINS = {
    "final-in-temp-folder-after-weights": ["3:ckpt-latest", "7:ckpt-actor"],
    "final-in-temp-folder-after-trainer": ["6:ckpt-saved", "7:ckpt-trainer"],
    "final-renamed-before-latest": ["7:ckpt-latest"],
    "final-after-latest": ["7:ckpt-saved"],
    "middle-renamed-before-latest": ["6:ckpt-latest"],
}


@pytest.mark.slow
def test_a_kill_at_any_moment_of_a_checkpoint_resumes_to_the_uninterrupted_run(
    write_experiment, tmp_path, kill_workers
) -> None:
    spec = tiny_experiment(
        budget={"steps": STEPS},
        training={"checkpoint_every": EVERY},
        evaluation={"every": 2, "num_prompts": 8},
    )
    exp = write_experiment(spec)
    full = tmp_path / "full"
    code, output = kill_workers.run(exp, full, resume=False, kill_at=None)
    assert code == 0, output
    assert pointed_name(full / "checkpoints") == f"step-{STEPS:06d}"

    for why, points in CHAINS.items():
        out = tmp_path / why
        _chain(kill_workers, exp, out, points)
        _assert_same_run(full, out, STEPS, tmp_path, why)


@pytest.mark.slow
def test_a_multi_turn_arm_killed_before_its_final_pointer_resumes_exactly(
    write_experiment, tmp_path, kill_workers
) -> None:
    """experiments/tool_use.yaml's calculator arm at a tiny size (the issue's own case)."""
    from ..experiment.test_tool_use import tiny_tool_use

    spec = tiny_tool_use([0], 5)
    spec["arms"] = {"grpo": spec["arms"]["tool"]}
    spec.pop("baseline", None)
    spec["evaluation"]["num_prompts"] = 4
    spec["logging"] = {"sinks": ["jsonl"]}
    exp = write_experiment(spec)
    full = tmp_path / "full"
    code, output = kill_workers.run(exp, full, resume=False, kill_at=None)
    assert code == 0, output
    assert all("env/turns" in row for row in read_jsonl(full / "metrics.jsonl"))
    out = tmp_path / "killed"
    _chain(kill_workers, exp, out, ["4:ckpt-latest", "5:ckpt-latest"])
    _assert_same_run(full, out, 5, tmp_path, "multi-turn")


@pytest.mark.slow
def test_a_run_killed_before_its_final_checkpoint_was_mirrored_mirrors_it_on_resume(
    s3, write_experiment, tmp_path, kill_workers
) -> None:
    from alignzoo.engine.mirror import mirror_for

    runs = {}
    for name in ("full", "killed"):
        spec = tiny_experiment(
            budget={"steps": 5},
            training={"checkpoint_every": 2, "checkpoint_mirror": f"{s3}/{name}"},
            evaluation={"every": 2, "num_prompts": 8},
        )
        runs[name] = write_experiment(spec, name=f"{name}.yaml")
    full, out = tmp_path / "full", tmp_path / "killed"
    code, output = kill_workers.run(runs["full"], full, resume=False, kill_at=None)
    assert code == 0, output
    # killed after the final checkpoint's pointer, before its copy went up
    _chain(kill_workers, runs["killed"], out, ["5:ckpt-saved"])
    mirrors = {name: mirror_for(f"{s3}/{name}", "tiny", "grpo", 0) for name in runs}
    complete = {name: mirror.complete() for name, mirror in mirrors.items() if mirror is not None}
    assert 5 in complete["killed"] and complete["killed"] == complete["full"]
    _assert_same_run(full, out, 5, tmp_path, "mirror")


def test_export_takes_the_final_step_and_refuses_without_its_checkpoint(
    write_experiment, tmp_path, engine_cache
) -> None:
    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.loop import run_one

    spec = tiny_experiment(budget={"steps": 3}, training={"checkpoint_every": 2})
    out = tmp_path / "run"
    assert run_one(load_experiment(write_experiment(spec)), "grpo", 0, out).status == "finished"
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-000002", "step-000003"]

    # ``latest`` one behind (a folder from before the pointer was kept right): the final step
    (ckpts / "latest").write_text("step-000002\n")
    assert main(["export", str(out), "--out", str(tmp_path / "a")]) == 0
    card = (tmp_path / "a" / "README.md").read_text()
    assert "3 steps" in card and "checkpoints/latest names step-000002" in card
    assert str(engine_cache) not in card and str(tmp_path) not in card  # no path of this machine
    assert "the embedded warm start " in card

    # A resume puts the pointer right first, and says so in the run's log.
    import io

    from rich.console import Console

    status = json.loads((out / "status.json").read_text())
    (out / "status.json").write_text(json.dumps({**status, "status": "running"}))
    log = io.StringIO()
    again = run_one(load_experiment(write_experiment(spec)), "grpo", 0, out, resume=True,
                    console=Console(file=log, width=300))  # fmt: skip
    assert again.status == "finished" and again.steps == 3
    assert "checkpoints/latest named step-000002; it now names step-000003" in log.getvalue()
    assert pointed_name(ckpts) == "step-000003"

    # A finished run with no checkpoint of its final step: refused, nothing written.
    import shutil

    shutil.rmtree(ckpts / "step-000003")
    target = tmp_path / "b"
    assert main(["export", str(out), "--out", str(target)]) == 2
    assert not target.exists()
    # --step names a kept one explicitly
    assert main(["export", str(out), "--out", str(target), "--step", "2"]) == 0
    assert "2 steps" in (target / "README.md").read_text()

    # A run that did not finish: its newest usable checkpoint, said so.
    status = json.loads((out / "status.json").read_text())
    (out / "status.json").write_text(json.dumps({**status, "status": "running"}))
    assert main(["export", str(out), "--out", str(tmp_path / "c")]) == 0
    card = (tmp_path / "c" / "README.md").read_text()
    assert "the run is running, not finished" in card and "2 steps" in card
