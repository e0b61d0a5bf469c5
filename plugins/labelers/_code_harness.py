"""The code labeler's sandbox harness: the program the sandbox runs (``python -I harness.py``).

:mod:`alignzoo.plugins.labelers.code` reads this file once, when it is imported, and writes it
as ``harness.py`` into each run's scratch directory beside the sample's ``solution.py`` and
``tests.json``, in the child it has already limited (rlimits, namespaces). What runs is what the
labeler's process read: a sample that rewrites the installed file changes no later run of it.

Its first process is the supervisor and never runs the sample's code. It forks the sample's
process (under a fresh PID namespace's init where the labeler unshared one), waits for it,
kills whatever the sample left and exits with the sample's status (128 + the signal when one
killed it). SIGTERM (the labeler's timeout or close, or the labeler's death through
PR_SET_PDEATHSIG) makes it kill everything and exit at once. Where neither a PID namespace nor
a subreaper is available (``process_group``) the process runs the sample itself.

The sample's process disables sockets and the ways to start a process, runs the solution and
then each test, and prints one line: :data:`RESULT_MARK` and the result as JSON.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import time

TYPE_CHECKING = False  # typing costs every sandbox's start-up: imported for type checkers only
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any, NoReturn

RESULT_MARK = "__ALIGNZOO_CODE_RESULT__"
"""Precedes the result's JSON on the harness's last line of output."""

_libc = ctypes.CDLL(None, use_errno=True)
_prctl: Any = getattr(_libc, "prctl", None)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP = 1, 4, 22
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38

_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")

# The process filter of the subreaper's sample (seccomp, installed by the sample on itself):
# no new process (fork, vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so threads
# fall back to clone), no signal but to itself, no ptrace, no reading or writing another
# process's memory, no limits set on another process. A sample could otherwise kill its
# supervisor (same user) and leave a detached child behind, or signal the run itself.
_PROCESS_FILTER = True
_SYSCALLS = {  # name: number, per architecture; AUDIT_ARCH value under "arch"
    "x86_64": {
        "arch": 0xC000003E, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "kill": 62,
        "tkill": 200, "tgkill": 234, "pidfd_open": 434, "pidfd_send_signal": 424,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "prlimit64": 302,
    },
    "aarch64": {
        "arch": 0xC00000B7, "clone": 220, "clone3": 435, "kill": 129, "tkill": 130,
        "tgkill": 131, "pidfd_open": 434, "pidfd_send_signal": 424, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271, "prlimit64": 261,
    },
}  # fmt: skip
_PROCESS_FUNCTIONS = (
    "fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve",
    "execl", "execle", "execlp", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle",
    "spawnlp", "spawnvp",
)  # fmt: skip
"""The functions of :mod:`os` that start a process: disabled in the sample's process."""


def _status(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return code if code >= 0 else 128 - code


def _children(pid: int, table: dict[int, list[int]] | None) -> list[int]:
    if table is not None:
        return table.get(pid, [])
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids += [int(k) for k in fh.read().split()]
        except (OSError, ValueError):
            pass
    return kids


def _ppid_table() -> dict[int, list[int]]:
    """For kernels without /proc/PID/task/TID/children: parent -> children."""
    table: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            table.setdefault(ppid, []).append(int(entry))
    return table


def _kill_descendants() -> None:
    # SIGKILL each descendant before reading its children: a killed process forks no more
    table = None if _PROC_CHILDREN else _ppid_table()
    todo = _children(os.getpid(), table)
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        todo += _children(pid, table)


def _reap_all() -> None:
    # until we have no child left: reap, kill every descendant (adopted ones come to us)
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        _kill_descendants()
        time.sleep(0.001)


def _stop(signum: int, frame: FrameType | None) -> NoReturn:
    _reap_all()
    os._exit(128 + signum)


def _install_process_filter() -> bool:
    nr = _SYSCALLS.get(os.uname().machine)
    if nr is None or _prctl is None:
        return False
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    me = os.getpid()
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, nr["arch"]), (RET, 0, 0, EPERM), (LD, 0, 0, 0)]
    if os.uname().machine == "x86_64":  # the x32 ABI's numbers: refused
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]
    for name in ("fork", "vfork", "tkill", "pidfd_open", "pidfd_send_signal", "ptrace",
                 "process_vm_readv", "process_vm_writev"):  # fmt: skip
        if name in nr:
            prog += [(JEQ, 0, 1, nr[name]), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, ENOSYS)]
    prog += [(JEQ, 0, 4, nr["clone"]), (LD, 0, 0, 16), (JSET, 1, 0, 0x10000),  # CLONE_THREAD
             (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)]  # fmt: skip
    for name, allowed in (("kill", (me,)), ("tgkill", (me,)), ("prlimit64", (0, me))):
        checks = [(JEQ, len(allowed) - i, 0, pid) for i, pid in enumerate(allowed)]
        prog += [(JEQ, 0, len(checks) + 3, nr[name]), (LD, 0, 0, 16), *checks,
                 (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)]  # fmt: skip
    prog += [(RET, 0, 0, ALLOW)]

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint32)]  # fmt: skip

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    table = (Instruction * len(prog))(*[Instruction(*i) for i in prog])
    program = Program(len(prog), table)
    if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # which a filter needs
        return False
    return bool(_prctl(PR_SET_SECCOMP, 2, ctypes.byref(program), 0, 0) == 0)  # MODE_FILTER


def _contain() -> tuple[str, bool]:
    """Become the sample's supervisor (and, in a PID namespace, its namespace's init); return
    in the sample's process only: the containment that holds it and whether its process filter
    is installed."""
    # PR_SET_CHILD_SUBREAPER: every orphan of the sample is ours (unless a PID namespace's init,
    # the sample's parent where the labeler unshared one, adopts it first)
    if _prctl is None or not os.path.isdir("/proc/self/task"):
        return "process_group", False
    if _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return "process_group", False
    _prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the sample may not ptrace its supervisors
    signal.signal(signal.SIGTERM, _stop)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    main = os.fork()
    if main:  # the supervisor
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _, wait_status = os.waitpid(main, 0)
        _reap_all()
        os._exit(_status(wait_status))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if os.getpid() == 1:  # the namespace's init: it ends with the sample, and so does the rest
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler a sample could trigger
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # dies with its supervisor
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        sample = os.fork()
        if sample:
            while True:
                pid, wait_status = os.wait()
                if pid == sample:
                    os._exit(_status(wait_status))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return "pid_namespace", False
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    return "subreaper", _PROCESS_FILTER and _install_process_filter()


def _no_network(*args: Any, **kwargs: Any) -> NoReturn:
    raise OSError("network access is disabled in the code labeler's sandbox")


def _no_processes(*args: Any, **kwargs: Any) -> NoReturn:
    raise OSError("starting processes is disabled in the code labeler's sandbox")


def _disable_network_and_processes() -> None:
    import subprocess

    disabled = (
        (socket, ("socket", "create_connection"), _no_network),
        (os, _PROCESS_FUNCTIONS, _no_processes),
        (subprocess, ("Popen",), _no_processes),
    )
    for module, names, replacement in disabled:
        for name in names:
            if hasattr(module, name):
                setattr(module, name, replacement)


def _judge(source: str, tests: list[str], result: dict[str, Any]) -> None:
    """Run the solution, then each test, in one namespace; the verdict into ``result``."""
    env = {"__name__": "__main__"}
    try:
        code = compile(source, "solution.py", "exec")
    except SyntaxError as exc:
        result.update(verdict="compile_error", error=f"{exc.msg} (line {exc.lineno})")
        return
    try:
        exec(code, env)
    except MemoryError:
        result.update(verdict="memory", error="MemoryError")
        return
    except BaseException as exc:
        result.update(verdict="runtime_error", error=f"{type(exc).__name__}: {exc}"[:300])
        return
    for test in tests:
        try:
            exec(test, env)
            result["passed"] += 1
        except AssertionError:
            pass
        except MemoryError:
            result.update(verdict="memory", error="MemoryError")
            return
        except BaseException as exc:
            result.update(verdict="runtime_error", error=f"{type(exc).__name__}: {exc}"[:300])
            return
    result["verdict"] = "passed" if result["passed"] == result["total"] else "wrong_answer"


def _exit() -> NoReturn:
    """End as the interpreter would (the sample's threads joined, its atexit functions run) but
    without tearing it down: freeing the heap of a forked process copies every page of it."""
    import atexit
    import threading

    getattr(threading, "_shutdown", lambda: None)()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(0)


def main() -> NoReturn:
    try:
        interfaces = [name for _, name in socket.if_nameindex()]
    except OSError:
        interfaces = []
    isolated = all(name == "lo" for name in interfaces)
    containment, filtered = _contain()
    # the sample's process
    if _prctl is not None:
        _prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # an ordinary process (its supervisors stay not)
    _disable_network_and_processes()
    with open("solution.py", encoding="utf-8") as fh:
        source = fh.read()
    with open("tests.json", encoding="utf-8") as fh:
        tests = json.load(fh)
    result: dict[str, Any] = {
        "verdict": None,
        "passed": 0,
        "total": len(tests),
        "error": "",
        "network_isolated": isolated,
        "containment": containment,
        "process_filter": filtered,
    }
    _judge(source, tests, result)
    sys.stdout.flush()
    print(f"\n{RESULT_MARK}{json.dumps(result)}", flush=True)
    _exit()


if __name__ == "__main__":
    main()
