"""A CPU run keeps the memory its tensors free: the next step's large activations reuse it
instead of being page-faulted in afresh (glibc's malloc)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine import loop
from alignzoo.engine.loop import run_one

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the setting is glibc's (Linux)",
)

# 64 MB: above glibc's largest dynamic mmap threshold (32 MB), so by default it is a fresh
# mmap every time, unmapped at free: every 4 KB page of it faults in when written.
ROUNDS = """
import json, resource, sys, torch
from alignzoo.engine.malloc import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(16 << 20)  # 64 MB of float32, every page written
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"took": took, "faults": faults}))
"""
PAGES = (64 << 20) // 4096


def _rounds(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_process_that_keeps_freed_memory_allocates_a_large_tensor_again_without_faults() -> None:
    default = _rounds("default")["faults"]
    assert min(default) >= PAGES * 0.9, (
        f"premise broken: without the setting, glibc should map a fresh 64 MB block each "
        f"time (about {PAGES} page faults per round), got {default}"
    )
    kept = _rounds("keep")
    assert kept["took"] is True
    # The first rounds grow the heap (each aligned allocation a little larger than the block
    # freed before it, until the freed blocks merge); from then on the block is reused. How
    # many rounds the merging takes varies between machines (1 to 5 seen): the second half of
    # the 16 rounds is past it.
    settled = kept["faults"][len(kept["faults"]) // 2 :]
    assert max(settled) < PAGES * 0.05, (
        f"the heap did not settle to reusing the freed block within 8 rounds: {kept['faults']}"
    )


def test_a_cpu_run_keeps_freed_memory_unless_told_not_to(
    write_experiment, tmp_path, monkeypatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: calls.append(1) or True)
    on = load_experiment(write_experiment(budget={"steps": 1}, name="on.yaml"))
    assert run_one(on, "grpo", 0, tmp_path / "on").status == "finished"
    assert calls == [1]
    off = load_experiment(
        write_experiment(budget={"steps": 1}, training={"reuse_cpu_memory": False}, name="off.yaml")
    )
    assert run_one(off, "grpo", 0, tmp_path / "off").status == "finished"
    assert calls == [1]


# ---------------------------------------------------------------- huge pages

from alignzoo.cli import common as cli_common  # noqa: E402
from alignzoo.engine import malloc  # noqa: E402
from alignzoo.provenance import collect, transparent_hugepage_mode  # noqa: E402

GLIBC = ("glibc", "2.36")


def test_the_restart_environment_adds_the_tunable_only_where_it_changes_something(tmp_path):
    # the kernel's file as Linux writes it, in each mode; none at all off Linux
    modes = {None: tmp_path / "missing"}
    for mode, text in (
        ("always", "[always] madvise never"),
        ("madvise", "always [madvise] never"),
        ("never", "always madvise [never]"),
    ):
        modes[mode] = tmp_path / mode
        modes[mode].write_text(text + "\n")

    env = malloc.huge_pages_environment({"PATH": "/bin"}, modes["madvise"], GLIBC)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # the user's other tunables are kept, and the new one is appended to them
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert malloc.huge_pages_environment(other, modes["madvise"], GLIBC)["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    )
    assert malloc.huge_pages_environment({}, modes["madvise"], ("glibc", "2.35")) is not None
    nothing = [
        ({"ALIGNZOO_HUGE_PAGES": "0"}, "madvise", GLIBC),  # the opt-out
        ({"ALIGNZOO_HUGE_PAGES": " 0 "}, "madvise", GLIBC),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC),  # the user's choice
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", GLIBC),  # restarted already
        ({}, "always", GLIBC),  # huge pages without asking
        ({}, "never", GLIBC),  # refused anyway
        ({}, None, GLIBC),  # no such kernel setting (not Linux)
        ({}, "madvise", ("glibc", "2.34")),  # the tunable is newer
        ({}, "madvise", ("", "")),  # musl, macOS
    ]
    for environ, mode, libc in nothing:
        assert malloc.huge_pages_environment(environ, modes[mode], libc) is None, (
            environ,
            mode,
            libc,
        )
    assert malloc.huge_pages_environment({"ALIGNZOO_HUGE_PAGES": "1"}, modes["madvise"], GLIBC)


def test_the_kernel_mode_is_the_bracketed_word(tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert transparent_hugepage_mode(mode) == "madvise"
    mode.write_text("[always] madvise never\n")
    assert transparent_hugepage_mode(mode) == "always"
    mode.write_text("nothing chosen\n")
    assert transparent_hugepage_mode(mode) is None
    assert transparent_hugepage_mode(tmp_path / "missing") is None


def test_provenance_records_the_pages_a_run_had(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    entry = collect()
    assert entry["glibc_tunables"] == "glibc.malloc.hugetlb=1"
    assert entry["transparent_hugepage"] == transparent_hugepage_mode()
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert collect()["glibc_tunables"] is None


class _Exec:
    """os.execve's stand-in: records the call and fails, as an exec that cannot run does."""

    def __init__(self):
        self.calls = []

    def __call__(self, path, argv, env):
        self.calls.append((path, list(argv), env))
        raise OSError("recorded, not run")


@pytest.fixture
def cli_restart(monkeypatch):
    """`alignzoo run smoke` in this process up to the runner (stubbed), on a machine where a
    restart would help (stubbed: any kernel and libc), with exec recorded."""
    from types import SimpleNamespace

    from alignzoo.experiment import runner

    recorded = _Exec()
    monkeypatch.setattr(malloc.os, "execve", recorded)
    monkeypatch.setattr(malloc, "huge_pages_environment", lambda: {"GLIBC_TUNABLES": "x=1"})
    monkeypatch.setattr(malloc, "_started_as_itself", lambda: True)
    ran = []
    monkeypatch.setattr(
        runner,
        "run_experiment",
        lambda loaded, **_: ran.append(loaded) or SimpleNamespace(failed=False),
    )
    return recorded, ran


def test_the_program_restarts_before_the_run_and_main_with_arguments_never(
    cli_restart, monkeypatch
):
    from alignzoo.cli import main

    recorded, ran = cli_restart
    # main([...]) from Python: never, whatever the machine
    assert main(["run", "smoke"]) == 0 and len(ran) == 1
    assert recorded.calls == []
    assert cli_common.state["restart_for_huge_pages"] is False
    # the program itself (main() reads sys.argv): once, with the new environment, before the
    # runner; the failed exec leaves the run going on as it was
    monkeypatch.setattr(sys, "argv", ["alignzoo", "run", "smoke"])
    assert main() == 0 and len(ran) == 2
    assert len(recorded.calls) == 1 and recorded.calls[0][2] == {"GLIBC_TUNABLES": "x=1"}
    assert cli_common.state["restart_for_huge_pages"] is False  # not left for a later call
    # an experiment whose every arm hands freed memory back gains nothing from it
    monkeypatch.setattr(
        sys, "argv", ["alignzoo", "run", "smoke", "--set", "training.reuse_cpu_memory=false"]
    )
    assert main() == 0 and len(ran) == 3 and len(recorded.calls) == 1
    # a command that does not train
    monkeypatch.setattr(sys, "argv", ["alignzoo", "validate", "smoke"])
    assert main() == 0 and len(recorded.calls) == 1


def test_only_a_program_that_exec_can_start_again_restarts(monkeypatch):
    monkeypatch.setattr(sys, "gettrace", lambda: None)
    monkeypatch.setattr(sys, "getprofile", lambda: None)
    cases = [
        (
            ["/venv/bin/python", "/venv/bin/alignzoo", "run", "x.yaml"],
            ["/venv/bin/alignzoo", "run", "x.yaml"],
            True,
        ),
        (
            ["python", "-X", "dev", "-m", "alignzoo", "run", "x.yaml"],
            ["/src/alignzoo/__main__.py", "run", "x.yaml"],
            True,
        ),
        (["python", "-m", "alignzoo"], ["/src/alignzoo/__main__.py"], True),
        (["python", "-c", "..."], ["-c", "run", "x.yaml"], False),  # nothing to run again
        (["python", "-", "run", "x.yaml"], ["-", "run", "x.yaml"], False),  # stdin is spent
        (["python", "wrapper.py"], ["alignzoo", "run", "x.yaml"], False),  # sys.argv rewritten
        ([], ["alignzoo"], False),
    ]
    for orig, argv, expected in cases:
        monkeypatch.setattr(sys, "orig_argv", orig)
        monkeypatch.setattr(sys, "argv", argv)
        assert malloc._started_as_itself() is expected, (orig, argv)
    monkeypatch.setattr(sys, "orig_argv", cases[0][0])
    monkeypatch.setattr(sys, "argv", cases[0][1])
    monkeypatch.setattr(sys, "gettrace", lambda: print)  # a debugger or coverage
    assert malloc._started_as_itself() is False
    monkeypatch.setattr(sys, "gettrace", lambda: None)
    monkeypatch.setattr(sys, "getprofile", lambda: print)  # a profiler
    assert malloc._started_as_itself() is False


# Every interpreter start of the child writes its pid, GLIBC_TUNABLES and argv: the restart is
# a second start of the same process.
STARTS = """
import json, os, sys
with open(os.environ["STARTS_LOG"], "a") as log:
    log.write(json.dumps([os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv]) + "\\n")
"""


def _starts(tmp_path, args, **env):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(STARTS)
    log = tmp_path / f"starts-{len(list(tmp_path.glob('starts-*')))}.jsonl"
    drop = ("GLIBC_TUNABLES", "ALIGNZOO_HUGE_PAGES")
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ.update(
        STARTS_LOG=str(log), PYTHONPATH=f"{site}{os.pathsep}{environ.get('PYTHONPATH', '')}"
    )
    environ.update(env)
    result = subprocess.run(
        [sys.executable, "-m", "alignzoo", *args],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
    )
    return result, [json.loads(line) for line in log.read_text().splitlines()]


@glibc
def test_alignzoo_run_restarts_once_with_huge_pages_where_they_help(tmp_path):
    if malloc.huge_pages_environment({}) is None:
        pytest.skip(
            f"premise: the kernel's huge-page mode is madvise (it is "
            f"{transparent_hugepage_mode()}) and glibc is 2.35 or later "
            f"({platform.libc_ver()[1]}): otherwise the run has nothing to restart for"
        )
    # An output path that is a file: the run stops with a user error right after the restart.
    (tmp_path / "afile").write_text("")
    run = ["run", "smoke", "--out", "afile"]
    result, starts = _starts(tmp_path, run)
    # the restarted process is the same one, with the same arguments, and goes on as before:
    # here to the error for the output path, said once
    assert [s[1] for s in starts] == [None, "glibc.malloc.hugetlb=1"], starts
    assert starts[0][0] == starts[1][0] and starts[0][2] == starts[1][2]
    assert result.returncode == 2 and result.stderr.count("afile") == 1, result.stderr
    # one start: the opt-out, the user's own tunables, an experiment that keeps no memory,
    # a command that does not train
    for args, env, tunables in (
        (run, {"ALIGNZOO_HUGE_PAGES": "0"}, None),
        (run, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "glibc.malloc.hugetlb=0"),
        ([*run, "--set", "training.reuse_cpu_memory=false"], {}, None),
        (["validate", "smoke"], {}, None),
    ):
        result, starts = _starts(tmp_path, args, **env)
        assert [s[1] for s in starts] == [tunables], (args, env, starts)
