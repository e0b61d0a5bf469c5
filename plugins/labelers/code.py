"""Labeler "code": run the response's Python code against test cases in a sandboxed subprocess.

The response's code (the first fenced ``python`` block if there is one, else the whole
response) runs with the sample's tests (``extra[tests_field]``: a list of Python statements,
typically ``assert f(1) == 2``) in a fresh interpreter (``python -I``) with:

- a scratch directory of its own as working directory (removed afterwards) and an empty
  environment;
- no new processes: ``os.fork``, ``os.system``, ``subprocess`` and the other ways to start one
  are disabled inside the interpreter, and the process limit backs that up for a non-root user
  (the kernel exempts root from it, in a user namespace too);
- every process the sample starts anyway (through ``ctypes``, ``posix.fork``, ...) dies with
  the sample, even one that calls ``setsid``, double-forks or ignores ``SIGTERM``: when the
  sample's main process ends (or at the timeout, or when the labeler is closed or its process
  dies) nothing of it is left running. ``containment`` says how, ``"auto"`` taking the first
  that the machine allows (probed once per process; the labeler's ``containment`` attribute,
  ``info["containment"]`` of every score and a log line at start-up say which is active):

  - ``pid_namespace`` (Linux where unprivileged user namespaces are allowed, or as root): the
    sample runs under the init of a PID namespace of its own, and when that init ends the
    kernel kills every process in the namespace. A sample cannot leave its namespace, nor
    signal or trace its supervisors (outside it, and not dumpable);
  - ``subreaper`` (Linux without namespaces, e.g. a container whose seccomp profile refuses
    ``unshare``): the sample runs under a process filter (seccomp, x86-64 and arm64) that lets
    it start no process (threads only), signal no process but itself, trace none and touch no
    other's memory or limits, so it can neither kill its supervisor (the same user) nor leave a
    child behind; behind it, a supervisor process marked ``PR_SET_CHILD_SUBREAPER`` adopts every
    orphan of the sample, however it detached, and after the sample (or at the timeout) kills
    every descendant it finds under ``/proc`` round after round and waits for them until it has
    none. ``info["process_filter"]`` says whether the filter held (not on other architectures,
    where a sample that kills its supervisor first escapes the subreaper);
  - ``process_group`` (no ``prctl``, e.g. macOS; never chosen where one of the above works):
    only the process group is killed, so ``setsid`` escapes it;
- limits: CPU seconds (``RLIMIT_CPU``), address space (``memory_mb``), file size, and number
  of processes (``max_processes`` besides the sample's own and its two supervisors; counted
  within the sample's user namespace where there is one); the sample is stopped at the
  wall-clock ``timeout_s``;
- no network: the child enters new user and network namespaces where the kernel allows it
  (then it has no interface but loopback); where it does not, sockets are disabled inside the
  interpreter, which stops ordinary code but not a determined one (``info["network_isolated"]``
  says which held).

The verdict is a real value (it judges the model's output), reported apart in
``info["verdict"]``: ``passed`` (1.0), ``wrong_answer`` (the fraction of tests passed),
``compile_error``, ``runtime_error``, ``timeout``, ``memory`` (0.0 each); ``info["correct"]``
is True only when every test passes. A sample without tests abstains.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Labeler, LabelRequest, Score
from alignzoo.plugins.labelers._code_harness import RESULT_MARK

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
PR_SET_PDEATHSIG, PR_GET_CHILD_SUBREAPER = 1, 37
MECHANISMS = ("pid_namespace", "subreaper")
"""The containments that hold every descendant, strongest first."""
_UNSHARE = {  # the namespaces the child tries to enter, in order; the first the kernel allows
    "pid_namespace": (
        CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID,
        CLONE_NEWNET | CLONE_NEWPID,  # root where user namespaces are off
        CLONE_NEWUSER | CLONE_NEWNET,  # then the harness falls back to the subreaper
        CLONE_NEWNET,
    ),
    "subreaper": (CLONE_NEWUSER | CLONE_NEWNET, CLONE_NEWNET),
    "process_group": (CLONE_NEWUSER | CLONE_NEWNET, CLONE_NEWNET),
}
_SUPERVISORS = 2  # the harness and, in a PID namespace, the namespace's init
_GRACE_S = 3.0  # how long a stopped supervisor may take to clean up before its group is killed

_HARNESS = (
    resources.files("alignzoo.plugins.labelers").joinpath("_code_harness.py").read_text("utf-8")
)
"""The sandbox's program (:mod:`alignzoo.plugins.labelers._code_harness`), read once: each run
writes it into its scratch directory, so a sample that rewrites the installed file changes no
later run of this process."""

# Run under the namespaces a mechanism needs: prints 1 when a forked child is a PID 1.
_PROBE = (
    "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0 if os.getpid() == 1 else 1)\n"
    "print(int(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0))\n"
)


def extract_code(response: str) -> str:
    """The first fenced python block of ``response``, or the whole response."""
    match = _FENCE.search(response)
    return match.group(1) if match else response


def _count_processes(uid: int) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    n += 1
            except OSError:
                continue
    return n


def _unshare(combos: tuple[int, ...]) -> int:
    """Enter the first namespace combination the kernel allows; the flags entered (0: none)."""
    unshare = getattr(ctypes.CDLL(None, use_errno=True), "unshare", None)
    if unshare is None:  # not Linux
        return 0
    for flags in combos:
        if unshare(flags) == 0:
            return flags
    return 0


def _limit(memory_mb: int, cpu_s: int, max_processes: int, combos: tuple[int, ...]) -> Any:
    def apply() -> None:  # runs in the child between fork and exec
        import resource

        flags = _unshare(combos)  # where allowed: no network, no root, a PID namespace
        prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
        if prctl is not None:  # the supervisor cleans up if the labeler's thread dies
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        nproc = max_processes + _SUPERVISORS + 1
        if not flags & CLONE_NEWUSER:  # then the limit counts every process of the user
            nproc += _count_processes(os.getuid())
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return apply


def _probe_pid_namespace() -> bool:
    def enter() -> None:
        if not _unshare(_UNSHARE["pid_namespace"][:2]):
            raise OSError("no PID namespace")

    try:
        out = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE],
            preexec_fn=enter,
            capture_output=True,
            timeout=60,
            env={},
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.strip() == b"1"


def _probe_subreaper() -> bool:
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None or not os.path.exists(f"/proc/self/task/{os.getpid()}"):
        return False
    flag = ctypes.c_int(0)
    return bool(prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0)


@functools.cache
def available_containments() -> tuple[str, ...]:
    """The containments (of :data:`MECHANISMS`) this machine allows, strongest first; probed
    once per process (a PID namespace by starting a child in one)."""
    if not sys.platform.startswith("linux"):
        return ()
    found = ("pid_namespace",) if _probe_pid_namespace() else ()
    return found + (("subreaper",) if _probe_subreaper() else ())


class CodeLabeler(Labeler):
    """Python code from the response, run against the sample's tests in a sandbox."""

    marks_correct = True
    version = "2"  # a sample that leaves a process behind is no longer timed out by it

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        tests_field: str = Field("tests", description="Column with the list of test statements.")
        timeout_s: float = Field(5.0, gt=0, description="Wall-clock limit of one run.")
        memory_mb: int = Field(512, ge=64, description="Address-space limit of the child.")
        max_processes: int = Field(16, ge=1, description="Processes the child may add.")
        containment: Literal["auto", "pid_namespace", "subreaper"] = Field(
            "auto",
            description="What kills every process a sample leaves: auto (the strongest this "
            "machine allows), pid_namespace, or subreaper (refused where unavailable).",
        )

    params: Params

    containment: str
    """The containment in use: ``pid_namespace``, ``subreaper`` or ``process_group``."""

    def __init__(self, params: BaseModel | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        available = available_containments()
        wanted = self.params.containment
        if wanted == "auto":
            self.containment = available[0] if available else "process_group"
        elif wanted in available:
            self.containment = wanted
        else:
            raise ValueError(
                f"containment {wanted!r} is not available on this machine (available: "
                f"{', '.join(available) or 'none'}); use containment: auto"
            )
        self._running: dict[subprocess.Popen[bytes], bool] = {}  # run -> stopped by close()
        self._lock = threading.Lock()
        _announce(self.containment, wanted)

    def score(self, request: LabelRequest) -> Score:
        tests = request.extra.get(self.params.tests_field)
        if not isinstance(tests, list) or not tests:
            return Score.abstain(f"no tests in {self.params.tests_field!r}")
        verdict = self.run(extract_code(request.response), [str(t) for t in tests])
        if verdict.get("closed"):
            return Score.abstain("the labeler was closed during the run")
        total = max(1, int(verdict.get("total") or len(tests)))
        passed = int(verdict.get("passed") or 0)
        kind = str(verdict["verdict"])
        value = 1.0 if kind == "passed" else passed / total if kind == "wrong_answer" else 0.0
        info = {**verdict, "correct": kind == "passed"}
        return Score(value, info=info)

    def run(self, code: str, tests: list[str]) -> dict[str, Any]:
        """Run ``code`` with ``tests`` in the sandbox; the harness's result dict."""
        scratch = tempfile.mkdtemp(prefix="alignzoo-code-")
        try:
            with open(os.path.join(scratch, "solution.py"), "w", encoding="utf-8") as fh:
                fh.write(code)
            with open(os.path.join(scratch, "tests.json"), "w", encoding="utf-8") as fh:
                json.dump(tests, fh)
            with open(os.path.join(scratch, "harness.py"), "w", encoding="utf-8") as fh:
                fh.write(_HARNESS)
            return self._run_harness(scratch, len(tests))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run_harness(self, scratch: str, n_tests: int) -> dict[str, Any]:
        cpu = int(self.params.timeout_s) + 1
        combos = _UNSHARE[self.containment]
        failed = {"passed": 0, "total": n_tests, "error": "", "containment": self.containment}
        with subprocess.Popen(
            [sys.executable, "-I", "harness.py"],
            cwd=scratch,
            env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: killed as a whole
            preexec_fn=_limit(self.params.memory_mb, cpu, self.params.max_processes, combos),
        ) as proc:
            with self._lock:
                self._running[proc] = False
            try:
                out, err = proc.communicate(timeout=self.params.timeout_s)
            except subprocess.TimeoutExpired:
                return {"verdict": "timeout", **failed}
            finally:
                self._stop(proc)
                with self._lock:
                    closed = self._running.pop(proc, False)
            if closed:
                return {"verdict": "runtime_error", "closed": True, **failed}
        text = out.decode("utf-8", "replace")
        if RESULT_MARK not in text:
            stderr = err.decode("utf-8", "replace")
            kind = "memory" if "MemoryError" in stderr else "runtime_error"
            code = proc.returncode or 0
            signum = -code if code < 0 else code - 128 if code > 128 else 0
            kind = "timeout" if signum == signal.SIGXCPU else kind
            return {"verdict": kind, **failed, "error": stderr[-300:]}
        result = json.loads(text.rsplit(RESULT_MARK, 1)[1].strip().splitlines()[0])
        return dict(result)

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        """End a run and everything it started: the supervisor (SIGTERM) kills the sample's
        processes and waits for them; one that does not end in time has its group killed."""
        if self.containment == "process_group":
            _kill_group(proc)
            return
        if proc.poll() is None:
            for signum in (signal.SIGTERM, signal.SIGCONT):  # SIGCONT: in case it was stopped
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    break
            try:
                proc.wait(timeout=_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc)

    def close(self) -> None:
        """Stop the runs in flight (their scores abstain); nothing they started survives."""
        with self._lock:
            running = list(self._running)
            for proc in running:
                self._running[proc] = True
        for proc in running:
            self._stop(proc)


@functools.cache
def _announce(containment: str, wanted: str) -> None:
    """One log line per process and containment: which one holds the sandbox's processes."""
    if containment == "pid_namespace" or wanted != "auto":
        log.info("code labeler: sample processes contained by %s", containment)
    else:
        log.warning(
            "code labeler: no PID namespace on this machine, sample processes contained by %s%s",
            containment,
            " (a sample that calls setsid escapes it)" if containment == "process_group" else "",
        )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's whole process group, again until it is empty (a process forked
    while the signal was being delivered is caught by the next round)."""
    for _ in range(200):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        except PermissionError:
            break
        time.sleep(0.005)
    proc.wait(timeout=5)
