"""The Slurm launchers of examples/slurm, run as a user would with sbatch, on a one-node Slurm
cluster this test starts (Debian's slurm-wlm: slurmctld and slurmd on 127.0.0.1, no munge).
torchrun.sbatch trains a run on two processes and, submitted again, keeps what finished;
ray.sbatch starts a Ray cluster in the job and trains every arm x seed as a Ray task. Skipped,
saying why, where slurm-wlm is not installed (``make slurm`` installs it) or its daemons
cannot start."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .conftest import tiny_experiment

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "slurm"
DAEMONS = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def _port(below: int | None = None) -> int:
    """A free port; ``below``: one under that number (Ray keeps 10002-19999 for workers)."""
    for port in range(6380, below) if below else [0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError(f"no free port below {below}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster; yields the environment its commands need (SLURM_CONF)."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"slurm-wlm is not installed ({', '.join(missing)} missing; make slurm)")
    root = tmp_path_factory.mktemp("slurm")
    host, user = socket.gethostname().split(".")[0], getpass.getuser()
    (root / "state").mkdir()
    (root / "spool").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=alignzoo-test",
                f"SlurmctldHost={host}(127.0.0.1)",
                "AuthType=auth/none",
                "CredType=cred/none",
                f"SlurmUser={user}",
                f"SlurmdUser={user}",
                f"SlurmctldPort={_port()}",
                f"SlurmdPort={_port()}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "MpiDefault=none",
                "ReturnToService=2",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN",
                f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            ]
        )
        + "\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started = [
        subprocess.run([daemon, "-f", str(conf), *flags], env=env, capture_output=True, text=True)
        for daemon, flags in (("slurmctld", ["-i"]), ("slurmd", []))
    ]
    try:
        for _ in range(60):
            state = subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True
            ).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            logs = " | ".join(
                (root / name).read_text()[-300:] if (root / name).exists() else "no log"
                for name in ("slurmctld.log", "slurmd.log")
            )
            said = " ".join(r.stderr.strip() for r in started)
            pytest.skip(f"the one-node Slurm did not start here ({said}; {logs})")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", user], env=env, capture_output=True)
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)
        time.sleep(1)
        for pid in _started_with(conf):  # what did not shut down: by its config file
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


def _started_with(conf: Path) -> list[int]:
    """The processes whose command line or environment names ``conf``: this test's daemons
    and the step daemons (slurmstepd) of its jobs."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                seen = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
                if str(conf).encode() in seen:
                    found.append(int(entry.name))
    return found


def _submit(script: str, env: dict[str, str], folder: Path, **exports: str) -> str:
    """``sbatch --wait`` the example on one node; its output file's text (asserting exit 0)."""
    exported = ",".join(["ALL", *(f"{key}={value}" for key, value in exports.items())])
    output = folder / f"{script}-%j.out"
    command = ["sbatch", "--wait", "--nodes=1", f"--cpus-per-task={os.cpu_count() or 1}",
               f"--chdir={folder}", f"--output={output}", f"--export={exported}",
               str(EXAMPLES / script)]  # fmt: skip
    done = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    logs = "\n".join(p.read_text() for p in sorted(folder.glob(f"{script}-*.out")))
    assert done.returncode == 0, done.stdout + done.stderr + logs[-4000:]
    return logs


def _experiment(folder: Path, arms: dict[str, dict[str, str]]) -> Path:
    spec = tiny_experiment(
        budget={"steps": 2},
        training={"prompts_per_step": 4, "samples_per_prompt": 2, "checkpoint_every": 2},
        evaluation={"every": 2, "num_prompts": 4},
        arms=arms,
    )
    path = folder / "exp.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return path


def _finished(run_dir: Path) -> bool:
    return json.loads((run_dir / "status.json").read_text())["status"] == "finished"


def test_torchrun_sbatch_trains_on_two_processes_and_resubmitted_keeps_it(
    slurm: dict[str, str], tmp_path: Path, engine_cache: Path
) -> None:
    env = {**slurm, "OMP_NUM_THREADS": "1"}
    path = _experiment(tmp_path, {"grpo": {"algorithm": "grpo"}})
    out = tmp_path / "runs"
    exports = {"EXPERIMENT": str(path), "OUT": str(out), "PYTHON": sys.executable,
               "NPROC_PER_NODE": "2", "PORT": str(_port())}  # fmt: skip
    logs = _submit("torchrun.sbatch", env, tmp_path, **exports)
    assert "each run on 2 processes" in logs, logs[-3000:]
    assert _finished(out / "grpo" / "seed-0") and (out / "report.md").is_file()
    again = _submit("torchrun.sbatch", env, tmp_path, **{**exports, "PORT": str(_port())})
    assert "1 finished runs kept" in again, again[-3000:]


def test_ray_sbatch_starts_a_ray_cluster_in_the_job_and_trains_every_run(
    slurm: dict[str, str], tmp_path: Path, engine_cache: Path
) -> None:
    pytest.importorskip("ray")
    env = {**slurm, "OMP_NUM_THREADS": "1"}
    path = _experiment(tmp_path, {"grpo": {"algorithm": "grpo"}, "rloo": {"algorithm": "rloo"}})
    out = tmp_path / "runs"
    logs = _submit(
        "ray.sbatch", env, tmp_path, EXPERIMENT=str(path), OUT=str(out), PYTHON=sys.executable,
        RAY_PORT=str(_port(below=10000)),
    )  # fmt: skip
    assert "ray: 2 runs, each asking 1 CPU(s)" in logs, logs[-3000:]
    assert _finished(out / "grpo" / "seed-0") and _finished(out / "rloo" / "seed-0")
    assert (out / "report.md").is_file()
