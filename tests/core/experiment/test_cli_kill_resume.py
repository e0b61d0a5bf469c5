"""`alignzoo run` with the real engine: killed mid-experiment and rerun with --resume, the report
equals an uninterrupted run's (timing columns aside); a failing arm makes the command exit 1."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

TINY = {
    "name": "killme",
    "seeds": [0, 1],
    "budget": {"steps": 24},
    "model": {
        "embedded": {
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "intermediate_size": 64,
            "sft_steps": 200,
            "sft_batch_size": 64,
        }
    },
    "data": {"task": {"digits": 1, "operations": ["+"], "train_size": 80, "eval_size": 20}},
    "training": {
        "lr": 5.0e-4,
        "prompts_per_step": 8,
        "samples_per_prompt": 4,
        "micro_batch_size": 32,
        "checkpoint_every": 4,
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
    },
    "evaluation": {"every": 8},
    "logging": {"sinks": ["jsonl"]},
    "arms": {"grpo": {"algorithm": "grpo"}, "rloo": {"algorithm": "rloo"}},
}
TIMING_COLUMNS = {"samples/s", "tokens/s", "wall-clock", "peak memory (MB)"}


def alignzoo(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "alignzoo.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def without_timing(report: str) -> list[str]:
    """The report's lines, with the timing columns of its tables and timing sentences removed,
    and without the provenance section (each invocation records its own command and time)."""
    lines, header = [], None
    for line in report.split("\n## Provenance", 1)[0].splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None or len(cells) != len(header):
                header = cells
            keep = [c for c, name in zip(cells, header, strict=True) if name not in TIMING_COLUMNS]
            lines.append("|".join(keep))
        else:
            header = None
            lines.append(re.sub(r"\d+(\.\d+)? ?s\b", "<time>", line))
    return lines


@pytest.mark.slow
def test_killed_experiment_resumes_to_the_same_report(tmp_path: Path) -> None:
    env = {**os.environ, "ALIGNZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(TINY, sort_keys=False))

    straight = alignzoo("run", str(exp), "--out", str(tmp_path / "straight"), env=env)
    assert straight.wait(timeout=600) == 0, straight.stdout.read() if straight.stdout else ""

    out = tmp_path / "killed"
    victim = alignzoo("run", str(exp), "--out", str(out), env=env)
    # Kill once the second run has written a checkpoint: one run finished, one half done.
    deadline = time.monotonic() + 300
    second = out / "grpo" / "seed-1" / "checkpoints"
    while not (second.exists() and any(second.iterdir())):
        assert victim.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint of the second run appeared"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()

    again = alignzoo("run", str(exp), "--out", str(out), env=env)
    assert again.wait(timeout=600) == 2  # an existing folder needs --resume
    resumed = alignzoo("run", str(exp), "--out", str(out), "--resume", env=env)
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read() if resumed.stdout else ""

    expected = (tmp_path / "straight" / "report.md").read_text()
    got = (out / "report.md").read_text()
    # Lines the killed run wrote after its checkpoint (if the kill came after any) were kept:
    # the report lists that attempt, and is otherwise the uninterrupted run's. (The kill can
    # also land while the first checkpoint is still being written: then the run has no
    # complete checkpoint and starts over, and its first attempt is listed as restarted.)
    if "\n## Earlier attempts" in got:
        head, attempts = got.split("\n## Earlier attempts", 1)
        assert re.search(r"grpo/seed-1 \| 1 \| (resumed|restarted) \|", attempts), attempts
        got = head + "\n## " + attempts.split("\n## ", 1)[1]
    assert without_timing(got) == without_timing(expected)
    assert "| grpo (baseline) | 2/2 |" in got
    assert "2 invocation(s) of this folder" in got  # the killed run and its resumption


@pytest.mark.slow
def test_a_failing_arm_exits_1_and_the_others_finish(tmp_path: Path) -> None:
    env = {**os.environ, "ALIGNZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    spec = {**TINY, "seeds": [0], "budget": {"steps": 2}}
    spec["arms"] = {
        "grpo": {"algorithm": "grpo"},
        # A folder that passes validation but holds no model: the run fails, not validate.
        "broken": {"algorithm": "grpo", "model": {"policy": str(tmp_path / "no-such-model")}},
    }
    (tmp_path / "no-such-model").mkdir()
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(spec, sort_keys=False))
    proc = alignzoo("run", str(exp), "--out", str(tmp_path / "out"), env=env)
    assert proc.wait(timeout=600) == 1
    output = (proc.stdout.read() if proc.stdout else "").replace("\n", "")
    assert "broken" in output and "no-such-model" in output and "Traceback" not in output
    assert (tmp_path / "out" / "grpo" / "seed-0" / "status.json").read_text().count("finished")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "broken/seed-0 | failed" in report


VOLATILE = ("time_s", "timing/", "throughput/", "labeler/", "memory/")
"""Keys that differ between any two sessions: wall-clock, speed, and how labels were obtained
(a resumed step finds the labels its killed attempt stored; the labels are the same)."""


def numbers(path: Path) -> list[dict[str, object]]:
    """A jsonl stream's rows without the :data:`VOLATILE` keys."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


@pytest.mark.slow
def test_a_run_resumed_alone_keeps_its_thread_count(tmp_path: Path) -> None:
    # --jobs 2 trains both runs in workers with cpu_count // 2 threads each; killed when one
    # run is left, `--resume --jobs 2` trains that one alone, in the main process, whose own
    # count (OMP_NUM_THREADS here) differs. The run must keep the count it started with.
    worker = max(1, (os.cpu_count() or 1) // 2)
    env = {**os.environ, "ALIGNZOO_CACHE": str(tmp_path / "cache")}
    env["OMP_NUM_THREADS"] = str(worker + 1)
    spec = {**TINY, "seeds": [0], "budget": {"steps": 16}}
    spec["training"] = {**TINY["training"], "prompts_per_step": 16, "samples_per_prompt": 8}
    spec["arms"] = {  # "quick" finishes long before "long"
        "quick": {
            "algorithm": "grpo",
            "training": {"prompts_per_step": 2, "samples_per_prompt": 2},
        },
        "long": {"algorithm": "grpo"},
    }
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(spec, sort_keys=False))

    straight = alignzoo(
        "run", str(exp), "--jobs", "2", "--out", str(tmp_path / "straight"), env=env
    )
    assert straight.wait(timeout=600) == 0, straight.stdout.read() if straight.stdout else ""

    out = tmp_path / "killed"
    victim = alignzoo("run", str(exp), "--jobs", "2", "--out", str(out), env=env)
    deadline = time.monotonic() + 300
    checkpoints = out / "long" / "seed-0" / "checkpoints"
    while not (
        "finished" in read_text(out / "quick" / "seed-0" / "status.json")
        and checkpoints.is_dir()
        and any(checkpoints.glob("step-*"))
    ):
        assert victim.poll() is None, "the experiment ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint of the long run appeared"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert "finished" not in read_text(out / "long" / "seed-0" / "status.json")

    resumed = alignzoo("run", str(exp), "--resume", "--jobs", "2", "--out", str(out), env=env)
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read() if resumed.stdout else ""

    run, reference = out / "long" / "seed-0", tmp_path / "straight" / "long" / "seed-0"
    sessions = json.loads((run / "provenance.json").read_text())["sessions"]
    assert len(sessions) == 2  # the killed attempt and its resumption
    assert [s["threads"] for s in sessions] == [worker, worker]
    for stream in ("metrics.jsonl", "eval.jsonl"):
        assert numbers(run / stream) == numbers(reference / stream), stream
    assert "Every run session shares one setting" in (out / "report.md").read_text()


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
