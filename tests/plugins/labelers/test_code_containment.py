"""The code labeler's sandbox holds every process a sample starts: after the sample is scored
(and after ``close()``) none is alive, however it detached (setsid, double fork, a fork bomb,
SIGTERM ignored). Each test runs under every containment this machine allows: the PID
namespace where the kernel gives one, and the subreaper fallback, forced. The subreaper's
sample also runs under a process filter that lets it start no process and signal no other
(tested on its own below); the forking tests turn that filter off, so they test the subreaper's
own cleanup, the second line of defence.

The sample's processes name themselves with a token unique to the test (``prctl(PR_SET_NAME)``,
seen in ``/proc/PID/comm`` from outside any namespace), and tell the sample's main process
that they run before it finishes, so a test cannot pass because they never started."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid

import pytest

from alignzoo import LabelRequest
from alignzoo.plugins.labelers import code as code_labeler
from alignzoo.plugins.labelers.code import CodeLabeler, available_containments
from alignzoo.types import Outcome

MECHANISMS = [m for m in code_labeler.MECHANISMS if m in available_containments()]

pytestmark = pytest.mark.skipif(not MECHANISMS, reason="no containment on this platform")

TESTS = ["assert add(1, 2) == 3"]

PRELUDE = """
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
def mark():  # PR_SET_NAME: the test finds this process by its name
    libc.prctl(15, b"{token}", 0, 0, 0)
def detach_stdio():  # as a daemon does: the labeler's pipes do not wait for it
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
def add(a, b):
    return a + b
"""


def marked(token: str) -> list[int]:
    """PIDs of the live (or unreaped) processes named ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm", "rb") as fh:
                    if fh.read().strip() == token.encode():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.fixture
def token():
    name = "az" + uuid.uuid4().hex[:12]  # comm holds 15 characters
    yield name
    for _ in range(200):  # a failing test leaves nothing behind either
        pids = marked(name)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


FILTER_ON = "_PROCESS_FILTER = True"


def without_process_filter(monkeypatch) -> None:
    assert FILTER_ON in code_labeler._HARNESS
    harness = code_labeler._HARNESS.replace(FILTER_ON, "_PROCESS_FILTER = False")
    monkeypatch.setattr(code_labeler, "_HARNESS", harness)


@pytest.fixture(params=MECHANISMS)
def labeler(request, monkeypatch):
    """A labeler under each containment; the subreaper's without its process filter, so the
    sample's processes start and the subreaper's cleanup is what is tested."""
    if request.param == "subreaper":
        without_process_filter(monkeypatch)
    lab = CodeLabeler(CodeLabeler.Params(containment=request.param, timeout_s=3.0))
    assert lab.containment == request.param
    yield lab
    lab.close()


@pytest.fixture(params=MECHANISMS)
def as_shipped(request):
    """A labeler under each containment, exactly as users get it (the process filter on)."""
    lab = CodeLabeler(CodeLabeler.Params(containment=request.param, timeout_s=3.0))
    yield lab
    lab.close()


def score(labeler: CodeLabeler, token: str, body: str) -> dict:
    code = PRELUDE.replace("{token}", token) + body
    result = labeler.score(LabelRequest(prompt="add", response=code, extra={"tests": TESTS}))
    assert result.info["containment"] == labeler.containment
    return result.info


def assert_none_left(labeler: CodeLabeler, token: str) -> None:
    assert marked(token) == []  # right after the score: nothing to wait for
    labeler.close()
    assert marked(token) == []


@pytest.mark.parametrize("fork", ["ctypes", "posix"])
def test_a_child_that_calls_setsid_dies_with_the_sample(labeler, token, fork) -> None:
    start = {
        "ctypes": "pid = libc.fork()\nif pid == 0:\n    libc.setsid()\n",
        "posix": "import posix\npid = posix.fork()\nif pid == 0:\n    os.setsid()\n",
    }[fork]
    body = start + (
        "    mark()\n    os.write(w, b'x')\n    time.sleep(60)\n    os._exit(0)\n"
        "assert pid > 0 and os.read(r, 1) == b'x'\n"  # the child runs, in a session of its own
    )
    info = score(labeler, token, "r, w = os.pipe()\n" + body)
    assert_none_left(labeler, token)
    assert info["verdict"] == "passed"  # its child held the output pipe: not a timeout


def test_a_double_forked_daemon_dies_with_the_sample(labeler, token) -> None:
    body = """
r, w = os.pipe()
pid = libc.fork()
if pid == 0:
    libc.setsid()
    if libc.fork() == 0:
        detach_stdio()
        mark()
        os.write(w, b"x")
        time.sleep(60)
    os._exit(0)
os.waitpid(pid, 0)
assert os.read(r, 1) == b"x"  # the grandchild runs, adopted by init or a subreaper
"""
    info = score(labeler, token, body)
    assert_none_left(labeler, token)
    assert info["verdict"] == "passed"


def test_a_fork_bomb_through_ctypes_dies_at_the_timeout(labeler, token) -> None:
    labeler.params.timeout_s = 1.5
    labeler.params.max_processes = 8
    body = """
mark()
for _ in range(5):  # at most 2**5 processes (root is exempt from the process limit)
    if libc.fork() == 0:
        libc.setsid()
        mark()
while True:
    time.sleep(0.05)
"""
    seen = 0
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(score(labeler, token, body)))
    thread.start()
    while thread.is_alive():
        seen = max(seen, len(marked(token)))
        time.sleep(0.05)
    thread.join()
    assert seen >= 4  # the bomb did go off
    assert result["verdict"] == "timeout"
    assert_none_left(labeler, token)


@pytest.mark.parametrize("sample_ends", ["returns", "times out"])
def test_a_child_that_ignores_sigterm_is_killed(labeler, token, sample_ends) -> None:
    labeler.params.timeout_s = 1.5
    body = """
r, w = os.pipe()
pid = libc.fork()
if pid == 0:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    os.setpgid(0, 0)  # a process group of its own
    detach_stdio()
    mark()
    os.write(w, b"x")
    while True:
        time.sleep(60)
assert pid > 0 and os.read(r, 1) == b"x"
"""
    if sample_ends == "times out":
        body += "time.sleep(60)\n"
    info = score(labeler, token, body)
    assert_none_left(labeler, token)
    assert info["verdict"] == ("passed" if sample_ends == "returns" else "timeout")


def test_close_stops_the_runs_in_flight(labeler, token) -> None:
    labeler.params.timeout_s = 30.0
    body = (
        "if libc.fork() == 0:\n    libc.setsid()\n    mark()\n    time.sleep(60)\ntime.sleep(60)\n"
    )
    result: list = []
    code = PRELUDE.replace("{token}", token) + body
    request = LabelRequest(prompt="add", response=code, extra={"tests": TESTS})
    thread = threading.Thread(target=lambda: result.append(labeler.score(request)))
    thread.start()
    deadline = time.monotonic() + 20
    while not marked(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marked(token)
    start = time.monotonic()
    labeler.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert marked(token) == []
    assert result[0].outcome == Outcome.ABSTAIN


def test_verdicts_and_limits_hold_under_each_containment(labeler) -> None:
    labeler.params.timeout_s = 1.0

    def verdict(code: str, tests: list[str] = TESTS) -> tuple[float, str]:
        request = LabelRequest(prompt="add", response=code, extra={"tests": tests})
        result = labeler.score(request)
        assert result.info["containment"] == labeler.containment
        return result.value, result.info["verdict"]

    assert verdict("def add(a, b):\n    return a + b\n") == (1.0, "passed")
    two = [*TESTS, "assert add(0, 0) == 0"]
    assert verdict("def add(a, b):\n    return 3\n", two) == (0.5, "wrong_answer")
    assert verdict("def add(a, b) return a")[1] == "compile_error"
    assert verdict("raise ValueError('boom')")[1] == "runtime_error"
    assert verdict("import os\nos._exit(3)")[1] == "runtime_error"  # no result printed
    assert verdict("while True:\n    pass\n") == (0.0, "timeout")
    labeler.params.memory_mb = 256
    assert verdict("x = bytearray(2_000_000_000)\n")[1] in ("memory", "runtime_error")


def test_the_containment_is_detected_and_a_missing_one_refused(monkeypatch) -> None:
    assert CodeLabeler().containment == MECHANISMS[0]  # the strongest available
    monkeypatch.setattr(code_labeler, "available_containments", lambda: ("subreaper",))
    assert CodeLabeler().containment == "subreaper"
    with pytest.raises(ValueError, match="pid_namespace"):
        CodeLabeler(CodeLabeler.Params(containment="pid_namespace"))
    monkeypatch.setattr(code_labeler, "available_containments", lambda: ())
    assert CodeLabeler().containment == "process_group"


@pytest.mark.skipif("subreaper" not in MECHANISMS, reason="no subreaper here")
def test_the_subreaper_finds_descendants_without_proc_children_files(monkeypatch, token) -> None:
    """Kernels built without CONFIG_PROC_CHILDREN: the supervisor reads every /proc/PID/stat."""
    without_process_filter(monkeypatch)  # its processes must start to be found
    line = '_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")'
    assert line in code_labeler._HARNESS
    monkeypatch.setattr(
        code_labeler, "_HARNESS", code_labeler._HARNESS.replace(line, "_PROC_CHILDREN = False")
    )
    labeler = CodeLabeler(CodeLabeler.Params(containment="subreaper", timeout_s=1.5))
    body = """
r, w = os.pipe()
top = os.getpid()
for _ in range(4):  # 15 processes, each in a session of its own
    if libc.fork() == 0:
        libc.setsid()
        mark()
        os.write(w, b"x")
if os.getpid() != top:
    time.sleep(60)
got = b""
while len(got) < 15:  # all of them run
    got += os.read(r, 15 - len(got))
"""
    assert score(labeler, token, body)["verdict"] == "passed"
    assert_none_left(labeler, token)


def test_a_sample_that_kills_its_supervisor_leaves_nothing_behind(as_shipped, token) -> None:
    """The escape a same-user sample had under the subreaper: detach a child, then SIGKILL the
    supervisor that would have killed it. The PID namespace kills the child with its init; the
    subreaper's process filter never lets the child start, nor the supervisor be signalled."""
    body = """
pid = libc.fork()
if pid == 0:
    libc.setsid()
    detach_stdio()
    mark()
    time.sleep(60)
    os._exit(0)
try:
    os.kill(os.getppid(), signal.SIGKILL)
except OSError:
    pass
time.sleep(0.3)
"""
    info = score(as_shipped, token, body)
    time.sleep(0.3)
    assert_none_left(as_shipped, token)
    assert info["process_filter"] is (as_shipped.containment == "subreaper")


@pytest.mark.skipif("subreaper" not in MECHANISMS, reason="no subreaper here")
def test_the_subreapers_sample_starts_no_process_and_signals_no_other(token) -> None:
    labeler = CodeLabeler(CodeLabeler.Params(containment="subreaper", timeout_s=5.0))
    body = """
import errno, posix, resource, threading
assert libc.fork() == -1 and ctypes.get_errno() == errno.EPERM
try:
    posix.fork()
except PermissionError:
    pass
else:
    raise AssertionError("posix.fork started a process")
done = []
worker = threading.Thread(target=lambda: done.append(1))  # threads are not processes
worker.start()
worker.join()
assert done == [1]
assert libc.kill(os.getppid(), 0) == -1 and ctypes.get_errno() == errno.EPERM
assert libc.kill(1, 0) == -1 and libc.kill(-1, 0) == -1 and libc.kill(0, 0) == -1
assert libc.kill(os.getpid(), 0) == 0  # itself: allowed
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # its own limits: allowed
assert libc.prlimit(os.getppid(), 4, None, None) == -1  # another's: refused
"""
    try:
        info = score(labeler, token, body)
    finally:
        labeler.close()
    assert info["process_filter"] is True
    assert info["verdict"] == "passed", info
