"""The Ray executor on a local Ray instance: jobs are (file, arm, seed, resources), the report
equals the local executor's, a task whose worker is killed is retried (and resumes) or reported
failed like a killed local worker; the ray_pool labeler scores like the labeler it replicates."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import LoadedExperiment, load_experiment
from alignzoo.experiment.executors import LocalExecutor, RayExecutor
from alignzoo.experiment.runner import run_experiment, run_resources
from tests.core.experiment.fake_engine import DIE_ONCE_ENV, LOG_ENV, fake_run_one, make_spec

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


def _report(folder: Path) -> str:
    """report.md without what differs between any two executions: the provenance section
    (commands, times, hosts) and columns of seconds."""
    text = (folder / "report.md").read_text(encoding="utf-8").split("## Provenance")[0]
    return "\n".join(line for line in text.splitlines() if " s " not in line and "/s" not in line)


def test_the_ray_report_equals_the_local_one(tmp_path: Path, monkeypatch) -> None:
    from tests.core.engine.conftest import tiny_experiment

    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    spec = tiny_experiment(
        budget={"steps": 2},
        evaluation={"every": 2, "num_prompts": 8},
        arms={
            "grpo": {"algorithm": "grpo"},
            "rloo": {"algorithm": "rloo"},
            # training.async in a Ray task: its producer is a Ray actor of the run's placement
            "grpo_k0": {"algorithm": "grpo", "training": {"async": {"max_staleness": 0}}},
        },
    )
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    loaded = load_experiment(path)
    # Both executors give each run one thread (the numbers depend on the thread count).
    local = run_experiment(
        loaded, out_dir=tmp_path / "local", executor=LocalExecutor(jobs=2), jobs=2
    )
    on_ray = run_experiment(
        load_experiment(path), out_dir=tmp_path / "ray", executor=RayExecutor(), jobs=2
    )
    assert not local.failed and not on_ray.failed, [r.error for r in on_ray.runs + local.runs]
    volatile = (
        "time",
        "timing/",
        "throughput/",
        "memory/",
        "async/",
        "rollout/staleness",
        "rollout/kl_behaviour",
    )
    for arm in ("grpo", "rloo", "grpo_k0"):
        rows = [
            [
                {k: v for k, v in json.loads(line).items() if not k.startswith(volatile)}
                for line in (tmp_path / where / arm / "seed-0" / "metrics.jsonl")
                .read_text()
                .splitlines()
            ]
            for where in ("local", "ray")
        ]
        assert rows[0] == rows[1], arm
        if arm == "grpo_k0":  # the producers' run is the synchronous one, on Ray as locally
            grpo = (tmp_path / "ray" / "grpo" / "seed-0" / "metrics.jsonl").read_text()
            assert rows[1] == [
                {k: v for k, v in json.loads(line).items() if not k.startswith(volatile)}
                for line in grpo.splitlines()
            ]
    compared = _report(tmp_path / "local")
    assert "## Against the baseline" in compared and "| rloo" in compared, compared
    assert compared == _report(tmp_path / "ray")


def test_an_agent_arm_runs_its_gateway_inside_the_ray_task(tmp_path: Path, monkeypatch) -> None:
    """An arm whose environment is an agent program, under --executor ray: the gateway and
    the agents' programs live in the run's Ray task, and every episode's agent calls it."""
    from tests.core.engine.conftest import tiny_experiment

    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    agent = Path(__file__).resolve().parents[3] / "examples/agents/calculator_agent.py"
    environment = {"name": "agent", "params": {"command": ["python", str(agent)]}}
    spec = tiny_experiment(
        budget={"steps": 2},
        training={"prompts_per_step": 2, "samples_per_prompt": 2},
        evaluation={"every": 2, "num_prompts": 2},
        arms={
            "grpo": {
                "algorithm": "grpo",
                "environment": environment,
                "episodes": {"codec": "brackets", "max_tokens": 32},
            }
        },
    )
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    result = run_experiment(
        load_experiment(path), out_dir=tmp_path / "ray", executor=RayExecutor(), jobs=1
    )
    assert not result.failed, [r.error for r in result.runs]
    rows = [
        json.loads(line) for line in (tmp_path / "ray" / "grpo" / "seed-0" / "metrics.jsonl").open()
    ]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/episodes"] == 4.0 and row["env/agent/calls"] >= 1
        assert row["env/error_frac"] == 0.0 and row["env/timeout_frac"] == 0.0


def test_producers_of_a_ray_run_are_ray_actors_in_its_placement_group(
    tmp_path: Path, monkeypatch
) -> None:
    """An async arm under --executor ray: its two producers label in Ray actors (the labeler
    notes where it runs), the run trains its steps, and the placement groups reserved for
    the run and its producers are gone afterwards."""
    from tests.core.engine.conftest import tiny_experiment

    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    notes = tmp_path / "where.txt"
    monkeypatch.setenv("ALIGNZOO_TEST_WHERE", str(notes))
    labeler = {
        "name": "python",
        "params": {"function": "tests.core.engine._labelers:notes_where_it_labels"},
    }
    settings = {"max_staleness": 1, "producers": 2, "producer_threads": 1}
    spec = tiny_experiment(
        budget={"steps": 3},
        evaluation={"every": 3, "num_prompts": 4, "labeler": "arithmetic"},
        arms={"k1": {"algorithm": "grpo", "labeler": labeler, "training": {"async": settings}}},
    )
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    paths = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the tests' labeler
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": paths},
    )
    try:
        result = run_experiment(
            load_experiment(path), out_dir=tmp_path / "out", executor=RayExecutor(), jobs=1
        )
        groups = list(ray.util.placement_group_table().values())
    finally:
        ray.shutdown()
    assert not result.failed, [r.error for r in result.runs]
    rows = (tmp_path / "out" / "k1" / "seed-0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]
    # Every batch labeled by a producer, in a Ray actor; the one call elsewhere is the
    # experiment's check of the labeler on the first row, before any run starts.
    where = notes.read_text().splitlines()
    assert where.count("ray actor") >= 3 and where.count("MainProcess") == 1, where
    # One placement group: the run's bundle and one per producer (1 CPU each), removed after.
    assert [(len(g["bundles"]), g["state"]) for g in groups] == [(3, "REMOVED")], groups
    assert groups[0]["bundles"][1] == groups[0]["bundles"][2] == {"CPU": 1.0}, groups


def test_a_killed_task_is_retried_and_resumes_or_fails_like_a_killed_worker(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "calls.log"))
    flag = tmp_path / "die-once"
    monkeypatch.setenv(DIE_ONCE_ENV, f"lr0:0:3:{flag}")
    arms = {"grpo": 1e-4, "lr0": 0.0}

    def loaded() -> LoadedExperiment:
        return LoadedExperiment(
            spec=make_spec(arms=arms, seeds=(0,)), source="<test>", components={}
        )

    straight = run_experiment(loaded(), out_dir=tmp_path / "straight", run_fn=fake_run_one)
    assert not straight.failed
    flag.touch()
    retried = run_experiment(
        loaded(),
        out_dir=tmp_path / "retried",
        run_fn=fake_run_one,
        executor=RayExecutor(retries=1),
        jobs=2,
    )
    assert not retried.failed, [r.error for r in retried.runs]
    assert not flag.exists(), "premise: the first attempt was killed"
    calls = [line.split()[:3] for line in (tmp_path / "calls.log").read_text().splitlines()]
    assert ["lr0", "0", "1"] in calls  # the retry resumed the killed run
    for name in ("metrics.jsonl", "eval.jsonl"):
        for arm in arms:
            got = (tmp_path / "retried" / arm / "seed-0" / name).read_text()
            assert got == (tmp_path / "straight" / arm / "seed-0" / name).read_text(), (arm, name)
    flag.touch()
    failed = run_experiment(
        loaded(),
        out_dir=tmp_path / "failed",
        run_fn=fake_run_one,
        executor=RayExecutor(retries=0),
        jobs=2,
    )
    status = {(r.arm, r.seed): r for r in failed.runs}
    assert failed.failed and status[("grpo", 0)].status == "finished"
    assert status[("lr0", 0)].status == "failed" and "ray task died" in status[("lr0", 0)].error
    on_disk = json.loads((tmp_path / "failed" / "lr0" / "seed-0" / "status.json").read_text())
    assert on_disk["status"] == "failed" and "ray task died" in on_disk["error"]


def test_the_ray_pool_scores_like_the_labeler_it_replicates() -> None:
    from alignzoo.plugins.labelers.arithmetic import ArithmeticLabeler
    from alignzoo.plugins.labelers.ray_pool import RayPoolLabeler
    from alignzoo.types import LabelRequest

    requests = [
        LabelRequest(
            prompt=f"{a}+{b}=", response=str(a + b + (a % 2)), extra={"answer": str(a + b)}
        )
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4)]
    ]
    expected = ArithmeticLabeler().score_batch(requests)
    assert {s.value for s in expected} == {0.0, 1.0}, "premise: right and wrong answers"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in __import__("sys").path if p)}})  # fmt: skip
    try:
        pool = RayPoolLabeler({"labeler": {"name": "arithmetic"}, "replicas": 2, "num_cpus": 0.5})
        pool.on_run_start(type("Run", (), {"seed": 0})())
        got = pool.score_batch(requests)
        pids = pool.pids()
        pool.on_run_end(None, "finished")
    finally:
        ray.shutdown()
    assert [(s.value, s.valid) for s in got] == [(s.value, s.valid) for s in expected]
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_a_run_asks_for_the_gpus_its_mapper_places_it_on(tmp_path: Path, monkeypatch) -> None:
    from tests.core.engine.conftest import tiny_experiment

    spec = tiny_experiment(
        arms={
            "cpu": {"algorithm": "grpo"},
            "sharded": {
                "algorithm": "grpo",
                "devices": {
                    "name": "split",
                    "params": {
                        "actor": "cuda:0",
                        "rollout": {"device": "cuda:1", "tensor_parallel_size": 2},
                    },
                },
            },
        }
    )
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    monkeypatch.setattr(
        "alignzoo.devices.available_devices", lambda: ["cpu", "cuda:0", "cuda:1", "cuda:2"]
    )
    loaded = load_experiment(path)
    assert run_resources(loaded, "cpu", 2, placed=True) == {"cpus": 2.0, "gpus": 0.0}
    assert run_resources(loaded, "sharded", 1, placed=True) == {"cpus": 1.0, "gpus": 3.0}
