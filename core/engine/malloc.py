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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

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
