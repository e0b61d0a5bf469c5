"""The code labeler: verdicts apart, and a sandbox that ends loops, fork bombs and hogs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignzoo import LabelRequest
from alignzoo.plugins.labelers import code as code_labeler
from alignzoo.plugins.labelers.code import CodeLabeler, extract_code
from alignzoo.types import Outcome

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def label(code: str, **params) -> tuple[float, dict]:
    labeler = CodeLabeler(CodeLabeler.Params(timeout_s=params.pop("timeout_s", 3.0), **params))
    score = labeler.score(LabelRequest(prompt="add", response=code, extra={"tests": TESTS}))
    return score.value, score.info


def test_verdicts_are_reported_apart() -> None:
    assert label("```python\ndef add(a, b):\n    return a + b\n```")[1]["verdict"] == "passed"
    value, info = label("def add(a, b):\n    return 3\n")  # right on one test of two
    assert info["verdict"] == "wrong_answer" and value == 0.5 and info["correct"] is False
    assert label("def add(a, b) return a")[1]["verdict"] == "compile_error"
    assert label("raise ValueError('boom')")[1]["verdict"] == "runtime_error"
    assert label("x = 1")[1]["verdict"] == "runtime_error"  # NameError in the tests
    abstain = CodeLabeler().score(LabelRequest(prompt="p", response="x", extra={}))
    assert abstain.outcome == Outcome.ABSTAIN


def test_an_infinite_loop_is_killed_on_time() -> None:
    start = time.monotonic()
    value, info = label("while True:\n    pass\n", timeout_s=1.0)
    assert info["verdict"] == "timeout" and value == 0.0
    assert time.monotonic() - start < 5


def _left_behind() -> list[str]:
    """Sandbox processes whose run is over (its scratch folder is gone) but which still run:
    counted by what they are, not by the machine's process count, which other tests change."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().split(b"\0")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if b"harness.py" in command and "alignzoo-code-" in cwd and cwd.endswith("(deleted)"):
            found.append(pid)
    return found


def test_a_fork_bomb_is_contained() -> None:
    start = time.monotonic()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    value, info = label(bomb, timeout_s=2.0, max_processes=8)
    assert value == 0.0 and info["verdict"] in ("timeout", "runtime_error")
    assert time.monotonic() - start < 10
    time.sleep(0.5)
    assert _left_behind() == []  # nothing left running


def test_processes_started_past_the_guard_die_with_the_group() -> None:
    raw = (  # 2**6 processes through libc, each sleeping past the timeout
        "import ctypes, time\nlibc = ctypes.CDLL(None)\n"
        "for _ in range(6):\n    libc.fork()\ntime.sleep(60)\n"
    )
    value, info = label(raw, timeout_s=1.0, max_processes=8)
    assert value == 0.0 and info["verdict"] == "timeout"
    time.sleep(0.5)
    assert _left_behind() == []  # the whole group was killed


def test_memory_and_network_are_limited() -> None:
    value, info = label("x = bytearray(2_000_000_000)\n", memory_mb=256)
    assert info["verdict"] in ("memory", "runtime_error") and value == 0.0
    _, info = label(
        "import socket\nsocket.create_connection(('127.0.0.1', 9))\n"
        "def add(a, b):\n    return a + b\n"
    )
    assert info["verdict"] == "runtime_error"


def test_extract_code() -> None:
    assert extract_code("text\n```python\nprint(1)\n```\nmore") == "print(1)\n"
    assert extract_code("print(2)") == "print(2)"


@pytest.mark.parametrize("timeout_s", [0])
def test_params_are_checked(timeout_s) -> None:
    with pytest.raises(ValueError):
        CodeLabeler.Params(timeout_s=timeout_s)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads prctl's subreaper flag")
def test_the_sandbox_runs_the_harness_module_as_read_when_the_labeler_was_imported(
    tmp_path,
) -> None:
    """The harness is a module of its own (ruff checks it): the labeler runs its text, read
    once, and importing it (as the labeler does, for its result mark) starts nothing."""
    harness = Path(code_labeler.__file__).with_name("_code_harness.py")
    assert harness.read_text(encoding="utf-8") == code_labeler._HARNESS
    probe = (  # the harness's import would make this process a subreaper, or fork, or print
        "import ctypes, os\n"
        "import alignzoo.plugins.labelers._code_harness\n"
        "flag = ctypes.c_int(-1)\n"
        "libc = ctypes.CDLL(None)\n"
        "assert libc.prctl(37, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value == 0\n"
        "print(os.getpid())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    assert out.stdout.split() == [out.stdout.strip()] and out.stderr == ""  # one process, quiet
