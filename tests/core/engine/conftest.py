"""Engine fixtures: a tiny embedded world (cached per test session) and experiment writers."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from alignzoo.config.overrides import deep_merge

ROOT = Path(__file__).resolve().parents[3]

# A tiny policy on 1-digit addition: warm-starts in a few seconds on one core.
TINY_MODEL = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "sft_steps": 60,
    "sft_batch_size": 64,
}
TINY_TASK = {"digits": 1, "operations": ["+"], "train_size": 80, "eval_size": 20}


def tiny_experiment(**overrides: Any) -> dict[str, Any]:
    """A small GRPO experiment dict; ``overrides`` are deep-merged on top."""
    base: dict[str, Any] = {
        "name": "tiny",
        "seeds": [0],
        "budget": {"steps": 4},
        "model": {"embedded": dict(TINY_MODEL)},
        "data": {"task": dict(TINY_TASK)},
        "training": {
            "lr": 1e-3,
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "micro_batch_size": 8,
            "checkpoint_every": 2,
            "sampling": {"max_new_tokens": 4},
        },
        "evaluation": {"every": 2, "num_prompts": 8},
        "logging": {"sinks": ["jsonl"]},
        "arms": {"grpo": {"algorithm": "grpo", "labeler": "arithmetic"}},
    }
    return deep_merge(base, overrides)


def episode_experiment(
    policy: Any, arm: str, environment: dict[str, Any], steps: int = 2, **episodes: Any
) -> dict[str, Any]:
    """A tiny experiment whose one GRPO arm ``arm`` plays ``environment`` with the chat
    ``policy`` folder, rewarded by the environment (``episode_reward``, 0 when it gives none);
    ``episodes`` override the episode limits (hermes calls, 3 turns)."""
    return tiny_experiment(
        budget={"steps": steps},
        model={"policy": str(policy)},
        training={
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "checkpoint_every": 2,
            "sampling": {"max_new_tokens": 6},
        },
        evaluation={"every": steps, "num_prompts": 2},
        arms={
            arm: {
                "algorithm": "grpo",
                "labeler": {"name": "episode_reward", "params": {"missing": 0.0}},
                "environment": environment,
                "episodes": {"codec": "hermes", "max_turns": 3, **episodes},
            }
        },
    )


@pytest.fixture(scope="session")
def engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """ALIGNZOO_CACHE pointed at a session folder (so warm starts are built once per session)."""
    cache = tmp_path_factory.mktemp("alignzoo-cache")
    old = os.environ.get("ALIGNZOO_CACHE")
    os.environ["ALIGNZOO_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("ALIGNZOO_CACHE", None)
    else:
        os.environ["ALIGNZOO_CACHE"] = old


@pytest.fixture
def write_experiment(tmp_path: Path, engine_cache: Path) -> Callable[..., Path]:
    """Write ``tiny_experiment(**overrides)`` (or a given dict) to a YAML file; return its path."""

    def write(spec: dict[str, Any] | None = None, name: str = "exp.yaml", **overrides: Any) -> Path:
        data = spec if spec is not None else tiny_experiment(**overrides)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
        return path

    return write


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a jsonl file."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def back_to_checkpoint(out: Path, step: int) -> None:
    """Make a finished run folder look like one killed after its checkpoint of ``step``:
    newer checkpoints removed, ``latest`` pointing there, status running."""
    import shutil

    for folder in (out / "checkpoints").glob("step-*"):
        if int(folder.name.split("-")[1]) > step:
            shutil.rmtree(folder)
    (out / "checkpoints" / "latest").write_text(f"step-{step:06d}\n")
    mark_running(out)


def mark_running(out: Path) -> None:
    """status.json says running (as after a SIGKILL), the rest as it was."""
    status = json.loads((out / "status.json").read_text())
    (out / "status.json").write_text(json.dumps({**status, "status": "running"}))


S3_BUCKET = "alignzoo-test"


@pytest.fixture(scope="session")
def s3() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with one bucket; the environment points s3fs at it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("s3fs", reason="s3fs (the s3 extra) is not installed")
    from alignzoo.engine.mirror import open_mirror

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fs, _ = open_mirror(f"s3://{S3_BUCKET}")
    fs.mkdir(S3_BUCKET)
    try:
        yield f"s3://{S3_BUCKET}"
    finally:
        server.stop()
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class KillWorkers:
    """Runs of one arm in children of one forked-from process (tests.core.engine._kill_worker):
    each run is a process of its own, killed by SIGKILL at its point, without paying for
    Python's and torch's imports every time."""

    def __init__(self, logs: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.logs, self.count = logs, 0
        logs.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.core.engine._kill_worker"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, exp: Path, out: Path, resume: bool, kill_at: str | None) -> tuple[int, str]:
        """One run (killed at ``kill_at``, or to the end): its exit code and its output."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.count += 1
        log = self.logs / f"run-{self.count}.log"
        job = {"experiment": str(exp), "arm": "grpo", "seed": 0, "out": str(out)}
        job.update(resume=resume, kill_at=kill_at, log=str(log))
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        status = self.proc.stdout.readline()
        output = log.read_text() if log.exists() else ""
        assert status, f"the kill worker itself died\n{output}"
        return int(status), output

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture
def kill_workers(tmp_path: Path) -> Iterator[KillWorkers]:
    workers = KillWorkers(tmp_path / "worker-logs")
    yield workers
    workers.close()


# Keys whose values are clocks or depend on the machine's load, not on what was trained; and
# the labelers' call counts, which depend on what the label store held (a resumed run finds its
# labels stored). Their values and drift (labeler/<name>/value_*, /drift) are compared.
TIMED = ("time_s", "wall_clock_s", "tokens_per_s", "peak_memory_mb", "timing/", "throughput/",
         "memory/", "created", "seconds", "elapsed", "_at")  # fmt: skip
LABELER_KEPT = ("/drift", "/value_mean", "/value_p10", "/value_p50", "/value_p90")
# Files whose bytes hold clocks or per-attempt records (compared elsewhere, or not at all):
# labels_slowest.jsonl names the labeler calls that took longest, a matter of timing.
UNCOMPARED = ("provenance.json", "error.log", "labels_slowest.jsonl", ".sqlite", ".sqlite-wal",
              ".sqlite-shm", ".lock")  # fmt: skip


# A labeler request's id: the clock when it was made and a random tail (two runs that make the
# same request at the same step give it two ids).
REQUEST_ID = re.compile(r"\b\d{9,}\.\d{6}-[0-9a-f]{8}\b")


def _timed(key: str) -> bool:
    if key.startswith("labeler/"):
        return not key.endswith(LABELER_KEPT)
    return key.startswith(TIMED) or key.endswith(TIMED)


def _normalised(value: Any, roots: tuple[str, ...]) -> Any:
    """``value`` without timed keys, with each run folder's own path written as ``RUN``."""
    if isinstance(value, dict):
        return {k: _normalised(v, roots) for k, v in value.items() if not _timed(str(k))}
    if isinstance(value, list):
        return [_normalised(v, roots) for v in value]
    if isinstance(value, str):
        for root in roots:
            value = value.replace(root, "RUN")
        return REQUEST_ID.sub("REQUEST", value)
    return value


def run_files(root: Path) -> dict[str, Path]:
    """Every file a run wrote into ``root`` (relative name -> path), without the earlier
    attempts' copies and the files :data:`UNCOMPARED` names."""
    found = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_file() and not name.startswith("attempts/") and not name.endswith(UNCOMPARED):
            found[name] = path
    return found


def assert_same_run_files(expected: Path, got: Path, why: str = "") -> None:
    """Every file of the run folder ``got`` equals ``expected``'s: the same names, JSON lines
    and JSON equal but for clocks and the folders' own paths, safetensors tensor for tensor,
    anything else byte for byte."""
    import torch
    from safetensors.torch import load_file

    want, have = run_files(expected), run_files(got)
    assert sorted(have) == sorted(want), f"{why}: files differ: {sorted(set(have) ^ set(want))}"
    roots_want = (str(expected.resolve()), str(expected))
    roots_have = (str(got.resolve()), str(got))
    for name, path in want.items():
        other = have[name]
        if name.endswith(".jsonl"):
            a = _normalised(read_jsonl(path), roots_want)
            b = _normalised(read_jsonl(other), roots_have)
        elif name.endswith(".json"):
            a = _normalised(json.loads(path.read_text()), roots_want)
            b = _normalised(json.loads(other.read_text()), roots_have)
        elif name.endswith(".yaml"):
            a = _normalised(yaml.safe_load(path.read_text()), roots_want)
            b = _normalised(yaml.safe_load(other.read_text()), roots_have)
        elif name.endswith(".safetensors"):
            a, b = load_file(str(path)), load_file(str(other))
            assert sorted(a) == sorted(b), f"{why}: {name}: other tensors"
            same = [k for k in a if torch.equal(a[k], b[k])]
            assert len(same) == len(a), f"{why}: {name}: {len(a) - len(same)} tensors differ"
            continue
        elif name.endswith(".pt"):
            a = torch.load(path, weights_only=True)
            b = torch.load(other, weights_only=True)
            assert repr(a) == repr(b), f"{why}: {name} differs"
            continue
        else:
            a, b = path.read_bytes(), other.read_bytes()
        assert a == b, f"{why}: {name} differs"
