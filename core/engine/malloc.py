"""Keep the memory a CPU run frees for its next step (glibc's malloc, Linux).

On the CPU a tensor's memory comes from the C library's ``malloc``. glibc serves a block above
its mmap threshold (at most 32 MB, raised as large blocks are freed) with a fresh ``mmap`` and
hands it back to the kernel with ``munmap`` when the tensor dies, so every step's large
activations (``[tokens, intermediate]`` floats: 48 MB at 64 x 134 tokens of a 512-wide Qwen2)
are page-faulted in again, 4 KB at a time, zero-filled by the kernel. On 2 cores of a virtual
machine that was 290,000-420,000 page faults and about 14% of a decode-bound GRPO step
(``benchmarks/README.md``): a multiply of two 48 MB tensors took 13 ms into a fresh one and
6.7 ms into reused memory.

:func:`keep_freed_memory` makes glibc serve such blocks from its heap and keep what is freed
there for the next allocation, the way a GPU's caching allocator keeps freed blocks: after the
first step a run allocates without page faults. The process keeps its resident memory at
its high-water mark, and the heap's fragmentation can raise that mark above the live peak: a
temporary freed after a later, longer-lived tensor was placed above it leaves a hole that the
next, larger activation does not fit. The lean forward's fused training functions
(alignzoo.kernels.lean) free every large temporary before the next kept activation is
allocated; with them a 64 x 518-token step of the 25.8M model peaked at 9.4 GB (14.97 GB with
the plain ops, 9.8 GB without this setting; benchmarks/README.md). It is process-wide and
stays in force for the rest of the process.

:func:`restart_with_huge_pages` is the other half, for where the pages come from: ``alignzoo
run`` restarts itself once with glibc's ``glibc.malloc.hugetlb=1`` tunable (read only when a
process starts), so that the heap this module keeps is backed by 2 MB transparent huge pages
where the kernel gives them on request (``madvise`` mode): fewer TLB misses over the decode
loop's KV cache and recorded activations, which are read at every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from alignzoo.provenance import THP_MODE_FILE, transparent_hugepage_mode

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Blocks up to 1 GiB come from the heap; the heap's free top goes back to the kernel only
# beyond 2 GiB - 1 (mallopt takes a C int).
HEAP_BLOCKS_UP_TO = 1 << 30
TRIM_ABOVE = (1 << 31) - 1


def keep_freed_memory() -> bool:
    """Make this process's malloc keep freed memory for reuse (see the module docstring).

    True when the setting took effect; False where the C library is not glibc (macOS, musl,
    Windows), which leaves the process as it was.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 for a value it refuses.
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE)
    )


# ---------------------------------------------------------------- transparent huge pages

HUGE_PAGES_ENV = "ALIGNZOO_HUGE_PAGES"
"""``0`` keeps the ``alignzoo`` command from restarting itself with huge pages (see
:func:`restart_with_huge_pages`)."""
HUGETLB_TUNABLE = "glibc.malloc.hugetlb"
GLIBC_WITH_HUGETLB = (2, 35)  # the first glibc that reads the tunable


def huge_pages_environment(
    environ: Mapping[str, str] | None = None,
    thp_mode_file: Path = THP_MODE_FILE,
    libc: tuple[str, str] | None = None,
) -> dict[str, str] | None:
    """The environment to restart this process with so that glibc's malloc asks the kernel
    for transparent huge pages, or None where a restart would change nothing.

    glibc (2.35 and later) reads ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` once, when the
    process starts, and then advises the kernel (``madvise(MADV_HUGEPAGE)``) on the memory its
    heap grows into and on the blocks it maps: 2 MB pages instead of 4 KB ones, so the
    decode loop's weights, its KV cache and the recorded activations (hundreds of MB each,
    read at every step) cost fewer TLB misses and their first touch fewer page faults. That
    matters only where the kernel's mode is ``madvise`` (the common default: ``always`` gives
    huge pages without asking, ``never`` refuses them). None as well where ``ALIGNZOO_HUGE_PAGES``
    is ``0``, the C library is not glibc 2.35 or later, or ``GLIBC_TUNABLES`` already names
    the tunable (whatever its value: the user's choice stands, and a restarted process
    does not restart again).
    """
    environ = os.environ if environ is None else environ
    if environ.get(HUGE_PAGES_ENV, "1").strip() == "0":
        return None
    name, version = libc if libc is not None else platform.libc_ver()
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if name != "glibc" or numbers < GLIBC_WITH_HUGETLB:
        return None
    if transparent_hugepage_mode(thp_mode_file) != "madvise":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if HUGETLB_TUNABLE in tunables:
        return None
    joined = f"{tunables}:{HUGETLB_TUNABLE}=1" if tunables else f"{HUGETLB_TUNABLE}=1"
    return {**environ, "GLIBC_TUNABLES": joined}


def _started_as_itself() -> bool:
    """Whether running ``sys.orig_argv`` again runs this same program from its start: a
    script or module given by name (not ``-c``, nor a script read from standard input, which
    is spent), with its arguments as they were given (no wrapper that rewrote ``sys.argv``),
    and no debugger or profiler attached (it would be lost)."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return False
    if not sys.orig_argv or not sys.argv or sys.argv[0] in ("", "-", "-c"):
        return False
    arguments = sys.argv[1:]
    return sys.orig_argv[len(sys.orig_argv) - len(arguments) :] == arguments


def restart_with_huge_pages() -> None:
    """Replace this process with itself, same interpreter, arguments and process id, under
    the environment of :func:`huge_pages_environment`; return at once where that is None, where
    this process was not started as a program that ``exec`` can start again (``-c``, a script
    on standard input, arguments rewritten by a wrapper, a debugger or profiler attached), or
    where the ``exec`` fails (the process then goes on as it was).

    Call it before anything is written or printed: whatever the process did before is lost.
    ``alignzoo run`` calls it once the experiment is read (``alignzoo.cli.main`` without
    arguments: the console script and ``python -m alignzoo``); ``torchrun`` and Slurm see the
    same process, since ``exec`` keeps its id. The memory's contents are unchanged, and
    so are the numbers a run computes: only where its pages come from.
    """
    env = huge_pages_environment()
    if env is None or not _started_as_itself():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return
