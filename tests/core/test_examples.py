"""The cluster examples hold together without a cluster: the KubeRay RayJob has the fields
KubeRay 1.x requires (no CRD schema can be fetched offline, so its required fields are checked
here as the ray.io/v1 API documents them) and an entrypoint that parses as an alignzoo command
line; the Slurm scripts are valid bash that fail fast on a missing setting (they are run on a
real one-node Slurm in tests/core/engine/test_slurm.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["template"]["spec"]["containers"]


def test_the_rayjob_is_a_complete_kuberay_rayjob_running_alignzoo_on_ray() -> None:
    job = yaml.safe_load((EXAMPLES / "kuberay" / "rayjob.yaml").read_text(encoding="utf-8"))
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"]["name"]
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        assert isinstance(group["rayStartParams"], dict)
        for container in _containers(group):
            assert container["name"] and container["image"]
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            volumes = {v["name"] for v in group["template"]["spec"]["volumes"]}
            assert mounts.get("/shared") in volumes  # every pod sees the runs' folder
    for worker in cluster["workerGroupSpecs"]:
        assert worker["groupName"] and worker["minReplicas"] <= worker["replicas"]
        assert worker["replicas"] <= worker["maxReplicas"]

    words = shlex.split(spec["entrypoint"])
    assert words[:2] == ["alignzoo", "run"]
    import typer

    from alignzoo.cli import app

    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    options = {opt for param in run.params for opt in param.opts}
    given = [w for w in words if w.startswith("--")]
    assert set(given) <= options, set(given) - options
    assert words[words.index("--executor") + 1] == "ray" and "--address" in words
    assert words[words.index("--out") + 1].startswith("/shared/")


@pytest.mark.parametrize("script", ["torchrun.sbatch", "ray.sbatch"])
def test_the_slurm_scripts_are_bash_that_stop_at_a_missing_setting(script: str) -> None:
    path = EXAMPLES / "slurm" / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("EXPERIMENT", "OUT")}
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "set EXPERIMENT to the experiment YAML" in done.stderr
