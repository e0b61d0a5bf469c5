"""The A/B runner with a fake engine: fairness of inputs, failures, resume, parallel workers."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from alignzoo.config.loader import LoadedExperiment
from alignzoo.config.schema import AsyncConfig
from alignzoo.errors import UserError
from alignzoo.experiment import runner
from alignzoo.experiment.runner import run_experiment
from tests.core.experiment.fake_engine import (
    DIE_ENV,
    KILL_ENV,
    LOG_ENV,
    FakeSummary,
    fake_run_one,
    make_spec,
)


def loaded_of(**kwargs: object) -> LoadedExperiment:
    return LoadedExperiment(spec=make_spec(**kwargs), source="<test>", components={})  # type: ignore[arg-type]


def calls(log: Path) -> list[tuple[str, int, bool, str]]:
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(r[0], int(r[1]), r[2] == "1", r[3] if len(r) > 4 else "") for r in rows]


def verdict(md: str, arm: str) -> str:
    part = md[md.index("## Against the baseline") :]
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == arm:
            return cells[6]
    raise AssertionError(arm)


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls.log"
    monkeypatch.setenv(LOG_ENV, str(path))
    monkeypatch.delenv(KILL_ENV, raising=False)
    return path


def test_every_arm_and_seed_runs_with_the_same_seeds(tmp_path: Path, log: Path) -> None:
    loaded = loaded_of(arms={"grpo": 1e-4, "grpo_copy": 1e-4, "lr0": 0.0}, seeds=(3, 1, 2))
    console = Console(file=io.StringIO(), width=200, color_system=None)
    result = run_experiment(loaded, out_dir=tmp_path / "out", console=console, run_fn=fake_run_one)
    assert not result.failed
    assert [(r.arm, r.seed, r.status) for r in result.runs] == [
        (arm, seed, "finished") for arm in ("grpo", "grpo_copy", "lr0") for seed in (3, 1, 2)
    ]
    # Each arm got exactly the experiment's seeds, unchanged, fresh (not resumed).
    got = calls(log)
    assert sorted((a, s) for a, s, _, _ in got) == sorted(
        (a, s) for a in ("grpo", "grpo_copy", "lr0") for s in (1, 2, 3)
    )
    assert not any(resumed for _, _, resumed, _ in got)
    out = tmp_path / "out"
    assert (out / "grpo" / "seed-3" / "eval.jsonl").exists()
    spec = yaml.safe_load((out / "experiment.yaml").read_text())
    assert spec["seeds"] == [3, 1, 2] and list(spec["arms"]) == ["grpo", "grpo_copy", "lr0"]
    assert result.report_paths == [out / "report.md", out / "report.html"]
    md = (out / "report.md").read_text()
    assert verdict(md, "grpo_copy") == "no detectable difference"  # A/A
    assert verdict(md, "lr0") == "worse"  # learning rate 0
    text = console.file.getvalue()
    assert "lr0 seed 2" in text and "finished" in text and "report:" in text


def test_default_out_dir_and_engine_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: Path
) -> None:
    monkeypatch.setattr(runner, "run_engine", fake_run_one)
    loaded = loaded_of(arms={"a": 1e-4}, seeds=(0,), output_dir=str(tmp_path / "runs"))
    result = run_experiment(loaded)
    assert result.out_dir == tmp_path / "runs" / "exp"
    assert (result.out_dir / "a" / "seed-0" / "status.json").exists()


def test_a_failing_arm_does_not_stop_the_others(tmp_path: Path, log: Path) -> None:
    loaded = loaded_of(arms={"good": 1e-4, "bad": 1e-4, "other": 0.0}, seeds=(0, 1), fail=("bad",))
    console = Console(file=io.StringIO(), width=200, color_system=None)
    result = run_experiment(loaded, out_dir=tmp_path / "out", console=console, run_fn=fake_run_one)
    assert result.failed
    status = {(r.arm, r.seed): r.status for r in result.runs}
    assert status == {
        ("good", 0): "finished",
        ("good", 1): "finished",
        ("bad", 0): "failed",
        ("bad", 1): "failed",
        ("other", 0): "finished",
        ("other", 1): "finished",
    }
    bad = next(r for r in result.runs if r.arm == "bad")
    assert bad.error == "RunError: loss is NaN at step 1 (bad)"
    on_disk = json.loads((tmp_path / "out" / "bad" / "seed-0" / "status.json").read_text())
    assert on_disk["status"] == "failed" and "loss is NaN" in on_disk["error"]
    assert "RunError: loss is NaN at step 1 (bad)" in console.file.getvalue()
    md = (tmp_path / "out" / "report.md").read_text()
    assert "bad/seed-1: RunError: loss is NaN at step 1 (bad)" in md


def test_a_run_reported_failed_without_raising(tmp_path: Path) -> None:
    def returns_failed(loaded, arm, seed, out_dir, resume=False, console=None):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return FakeSummary("failed", "ValueError: bad reward", 0, 0.0, 0.0, 0.0)

    result = run_experiment(
        loaded_of(arms={"a": 1e-4}, seeds=(0,)), out_dir=tmp_path / "o", run_fn=returns_failed
    )
    assert result.failed and result.runs[0].error == "ValueError: bad reward"
    status = json.loads((tmp_path / "o" / "a" / "seed-0" / "status.json").read_text())
    assert status == {"status": "failed", "error": "ValueError: bad reward"}


def test_existing_folder_needs_resume_and_is_not_touched(tmp_path: Path, log: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="--resume"):
        run_experiment(loaded_of(arms={"a": 1e-4}), out_dir=out, run_fn=fake_run_one)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert calls(log) == []


def test_resume_refuses_a_different_budget(tmp_path: Path, log: Path) -> None:
    out = tmp_path / "out"
    run_experiment(loaded_of(arms={"a": 1e-4}, seeds=(0,)), out_dir=out, run_fn=fake_run_one)
    with pytest.raises(UserError, match="budget"):
        run_experiment(
            loaded_of(arms={"a": 1e-4}, seeds=(0,), steps=9),
            out_dir=out,
            resume=True,
            run_fn=fake_run_one,
        )


def test_resume_adds_arms_and_keeps_the_old_ones(tmp_path: Path, log: Path) -> None:
    out = tmp_path / "out"
    run_experiment(loaded_of(arms={"a": 1e-4}, seeds=(0, 1)), out_dir=out, run_fn=fake_run_one)
    run_experiment(
        loaded_of(arms={"b": 0.0}, seeds=(0, 1)), out_dir=out, resume=True, run_fn=fake_run_one
    )
    spec = yaml.safe_load((out / "experiment.yaml").read_text())
    assert list(spec["arms"]) == ["a", "b"]
    assert verdict((out / "report.md").read_text(), "b") == "worse"


def test_killed_then_resumed_gives_the_same_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: Path
) -> None:
    arms = {"grpo": 1e-4, "lr0": 0.0}
    straight = run_experiment(
        loaded_of(arms=arms), out_dir=tmp_path / "straight", run_fn=fake_run_one
    )
    assert not straight.failed

    monkeypatch.setenv(KILL_ENV, "grpo:1:4")
    with pytest.raises(KeyboardInterrupt):
        run_experiment(loaded_of(arms=arms), out_dir=tmp_path / "killed", run_fn=fake_run_one)
    interrupted = json.loads((tmp_path / "killed/grpo/seed-1/status.json").read_text())
    assert interrupted["status"] == "running"
    monkeypatch.delenv(KILL_ENV)
    log.unlink()

    resumed = run_experiment(
        loaded_of(arms=arms), out_dir=tmp_path / "killed", resume=True, run_fn=fake_run_one
    )
    assert not resumed.failed
    # grpo seed 0 was finished and skipped; seed 1 continued; the rest ran fresh.
    assert [r.skipped for r in resumed.runs] == [True, False, False, False, False, False]
    assert calls(log)[0][:3] == ("grpo", 1, True)
    assert all(not c[2] for c in calls(log)[1:])
    for name, heading in (("report.md", "## Provenance"), ("report.html", "<h2>Provenance</h2>")):
        # the same report, but for the provenance section (its own command and time per run)
        killed = (tmp_path / "killed" / name).read_text().split(heading)[0]
        straight = (tmp_path / "straight" / name).read_text().split(heading)[0]
        assert killed == straight


@pytest.mark.slow
def test_parallel_workers(tmp_path: Path, log: Path) -> None:
    loaded = loaded_of(arms={"grpo": 1e-4, "lr0": 0.0}, seeds=(0, 1))
    result = run_experiment(loaded, out_dir=tmp_path / "out", jobs=2, run_fn=fake_run_one)
    assert not result.failed
    assert [(r.arm, r.seed) for r in result.runs] == [
        ("grpo", 0),
        ("grpo", 1),
        ("lr0", 0),
        ("lr0", 1),
    ]
    got = calls(log)
    assert len(got) == 4
    expected_threads = str(max(1, (os.cpu_count() or 1) // 2))
    assert all(threads == expected_threads for *_, threads in got)
    pids = {line.split()[4] for line in log.read_text().splitlines()}
    assert str(os.getpid()) not in pids  # the runs happened in worker processes
    assert verdict((tmp_path / "out" / "report.md").read_text(), "lr0") == "worse"


def test_a_killed_worker_fails_only_its_own_run(
    tmp_path: Path, log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DIE_ENV, "lr0:0:2")  # that worker process is SIGKILLed mid-run
    loaded = loaded_of(arms={"grpo": 1e-4, "lr0": 0.0}, seeds=(0, 1))
    result = run_experiment(loaded, out_dir=tmp_path / "out", jobs=2, run_fn=fake_run_one)
    status = {(r.arm, r.seed): (r.status, r.error) for r in result.runs}
    assert result.failed
    assert status[("lr0", 0)][0] == "failed" and "died (exit code -9)" in status[("lr0", 0)][1]
    assert all(s == "finished" for key, (s, _) in status.items() if key != ("lr0", 0))
    on_disk = json.loads((tmp_path / "out" / "lr0" / "seed-0" / "status.json").read_text())
    assert on_disk["status"] == "failed" and "died" in on_disk["error"]
    monkeypatch.delenv(DIE_ENV)
    again = run_experiment(
        loaded, out_dir=tmp_path / "out", jobs=2, resume=True, run_fn=fake_run_one
    )
    assert not again.failed
    assert [r.skipped for r in again.runs] == [True, True, False, True]


def test_parallel_workers_announce_evaluations_and_end_with_a_summary(
    tmp_path: Path, log: Path
) -> None:
    console = Console(file=io.StringIO(), width=160, record=True)
    loaded = loaded_of(arms={"grpo": 1e-4, "lr0": 0.0}, seeds=(0, 1))
    result = run_experiment(
        loaded, out_dir=tmp_path / "out", jobs=2, run_fn=fake_run_one, console=console
    )
    assert not result.failed
    text = console.export_text()
    metric = "eval/exact_match"  # the compared metric (the default, exact match)
    for arm in ("grpo", "lr0"):
        for seed in (0, 1):  # the last evaluation of every run is announced
            steps = loaded.spec.budget.steps
            line = f"{arm} seed {seed} eval @ step {steps}: {metric}"
            shown = text[text.index(line) + len(line) :].split()[0]
            assert float(shown) >= 0.0, text  # the compared metric's value, not "n/a"
    summary = text[text.index("verdict vs baseline") :]
    assert "grpo" in summary and "baseline" in summary
    assert "worse" in summary  # lr0's verdict, as in the report


def test_ray_runs_ask_one_cpu_each_unless_jobs_says_otherwise(monkeypatch, tmp_path) -> None:
    """--executor ray without --jobs: one CPU per run, so a cluster runs them in parallel (each
    asked for every CPU before and they went one at a time); locally one run at a time."""
    from alignzoo.cli.experiments import Executors, run_jobs
    from alignzoo.experiment.executors import RunJob, ray_plan

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert run_jobs(Executors.ray, None) == 8  # threads = cpu_count // jobs = 1 per run
    assert run_jobs(Executors.local, None) == 1
    assert run_jobs(Executors.ray, 2) == 2
    spec = make_spec(arms={"a": 1e-3, "b": 1e-3}, seeds=(0, 1))
    jobs = [
        RunJob("x.yaml", spec, arm, seed, tmp_path, False, 1, {"cpus": 1.0, "gpus": 0.0})
        for arm in ("a", "b")
        for seed in (0, 1)
    ]
    assert ray_plan(jobs, {"CPU": 2.0}) == (
        "ray: 4 runs, each asking 1 CPU(s) and 0 GPU(s); the cluster has 2 CPUs and 0 GPUs: "
        "up to 2 at a time"
    )
    placed = [dataclasses.replace(j, resources={"cpus": 1.0, "gpus": 1.0}) for j in jobs]
    assert ray_plan(placed, {"CPU": 16.0, "GPU": 3.0}).endswith("up to 3 at a time")
    assert "none fits" in ray_plan(placed, {"CPU": 16.0})
    # An arm with two rollout producers of one thread each: its runs ask 1 + 2 CPUs.
    arms = dict(spec.arms)
    training = arms["a"].training.model_copy(update={"async_": AsyncConfig(producers=2)})
    arms["a"] = arms["a"].model_copy(update={"training": training})
    producing = dataclasses.replace(jobs[0], spec=spec.model_copy(update={"arms": arms}))
    plan = ray_plan([producing, *jobs[1:]], {"CPU": 6.0})
    assert plan.startswith("ray: 4 runs, each asking 3 CPU(s)") and plan.endswith(
        "up to 2 at a time"
    )
