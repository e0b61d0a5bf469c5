"""Labeler "code": run the response's Python code against test cases in a sandboxed subprocess.

The response's code (the first fenced ``python`` block if there is one, else the whole
response) runs with the sample's tests (``extra[tests_field]``: a list of Python statements,
typically ``assert f(1) == 2``) in a fresh interpreter (``python -I``) with:

- a scratch directory of its own as working directory (removed afterwards) and an empty
  environment;
- no new processes: ``os.fork``, ``os.system``, ``subprocess`` and the other ways to start one
  are disabled inside the interpreter, and the process limit backs that up for a non-root
  user (the kernel exempts root from it); the process group is killed round after round until
  it is empty, so even a fork bomb through ``ctypes`` dies at the timeout;
- limits: CPU seconds (``RLIMIT_CPU``), address space (``memory_mb``), file size, and number
  of processes; the whole process group is killed on the wall-clock ``timeout_s``;
- no network: the child enters new user and network namespaces where the kernel allows it
  (then it has no interface but loopback, and the process limit is enforced even for root);
  where it does not, sockets are disabled inside the interpreter, which stops ordinary code
  but not a determined one (``info["network_isolated"]`` says which held).

The verdict is a real value (it judges the model's output), reported apart in
``info["verdict"]``: ``passed`` (1.0), ``wrong_answer`` (the fraction of tests passed),
``compile_error``, ``runtime_error``, ``timeout``, ``memory`` (0.0 each); ``info["correct"]``
is True only when every test passes. A sample without tests abstains.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Labeler, LabelRequest, Score

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)
_MARK = "__ALIGNZOO_CODE_RESULT__"
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000

_HARNESS = r"""
import json, socket, sys
try:
    _interfaces = [name for _, name in socket.if_nameindex()]
except OSError:
    _interfaces = []
_isolated = all(name == "lo" for name in _interfaces)
def _no_network(*a, **k):
    raise OSError("network access is disabled in the code labeler's sandbox")
socket.socket = _no_network
socket.create_connection = _no_network
import os, subprocess
def _no_processes(*a, **k):
    raise OSError("starting processes is disabled in the code labeler's sandbox")
for _name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv",
              "execve", "execl", "execle", "execlp", "execvp", "execvpe", "spawnv", "spawnve",
              "spawnl", "spawnle", "spawnlp", "spawnvp"):
    if hasattr(os, _name):
        setattr(os, _name, _no_processes)
subprocess.Popen = _no_processes
source = open("solution.py", encoding="utf-8").read()
tests = json.load(open("tests.json", encoding="utf-8"))
result = {"verdict": None, "passed": 0, "total": len(tests), "error": "",
          "network_isolated": _isolated}
env = {"__name__": "__main__"}
try:
    code = compile(source, "solution.py", "exec")
except SyntaxError as exc:
    result.update(verdict="compile_error", error=f"{exc.msg} (line {exc.lineno})")
else:
    try:
        exec(code, env)
    except MemoryError:
        result.update(verdict="memory", error="MemoryError")
    except BaseException as exc:
        result.update(verdict="runtime_error", error=f"{type(exc).__name__}: {exc}"[:300])
    else:
        for test in tests:
            try:
                exec(test, env)
                result["passed"] += 1
            except AssertionError:
                pass
            except MemoryError:
                result.update(verdict="memory", error="MemoryError")
                break
            except BaseException as exc:
                result.update(verdict="runtime_error", error=f"{type(exc).__name__}: {exc}"[:300])
                break
        if result["verdict"] is None:
            result["verdict"] = "passed" if result["passed"] == result["total"] else "wrong_answer"
sys.stdout.flush()
print("\n__ALIGNZOO_CODE_RESULT__" + json.dumps(result), flush=True)
"""


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


def _limit(memory_mb: int, cpu_s: int, nproc: int) -> Any:
    def apply() -> None:  # runs in the child between fork and exec
        import resource

        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)  # where allowed: no network, no root
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return apply


class CodeLabeler(Labeler):
    """Python code from the response, run against the sample's tests in a sandbox."""

    marks_correct = True

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        tests_field: str = Field("tests", description="Column with the list of test statements.")
        timeout_s: float = Field(5.0, gt=0, description="Wall-clock limit of one run.")
        memory_mb: int = Field(512, ge=64, description="Address-space limit of the child.")
        max_processes: int = Field(16, ge=1, description="Processes the child may add.")

    params: Params

    def score(self, request: LabelRequest) -> Score:
        tests = request.extra.get(self.params.tests_field)
        if not isinstance(tests, list) or not tests:
            return Score.abstain(f"no tests in {self.params.tests_field!r}")
        verdict = self.run(extract_code(request.response), [str(t) for t in tests])
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
            nproc = _count_processes(os.getuid()) + self.params.max_processes
            cpu = int(self.params.timeout_s) + 1
            proc = subprocess.Popen(
                [sys.executable, "-I", "harness.py"],
                cwd=scratch,
                env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: killed as a whole
                preexec_fn=_limit(self.params.memory_mb, cpu, nproc),
            )
            try:
                out, err = proc.communicate(timeout=self.params.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return {"verdict": "timeout", "passed": 0, "total": len(tests), "error": ""}
            finally:
                _kill_group(proc)  # anything it left behind in its group
            text = out.decode("utf-8", "replace")
            if _MARK not in text:
                stderr = err.decode("utf-8", "replace")
                kind = "memory" if "MemoryError" in stderr else "runtime_error"
                if proc.returncode is not None and proc.returncode < 0:
                    kind = "timeout" if -proc.returncode == signal.SIGXCPU else kind
                return {"verdict": kind, "passed": 0, "total": len(tests), "error": stderr[-300:]}
            result = json.loads(text.rsplit(_MARK, 1)[1].strip().splitlines()[0])
            return dict(result)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


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
