"""A run's BLAS/torch thread count, which is part of its settings.

Floating-point results are reproducible only with the same thread count (a reduction split
over another number of threads adds in another order). A run's count is what its first attempt
trained with (``cpu_count // jobs`` in a worker of ``alignzoo run --jobs``, this process's own
count in the main process); every checkpoint records it (``state.json``: ``threads``) and a
resumed run trains with it again, whether it then runs in a worker or in the main process, with
``--jobs`` of any value (:func:`threads_set_to`, applied by the engine's ``run_one``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""The environment variables that set the thread count of processes started from this one."""


def limit_threads(threads: int) -> None:
    """Use ``threads`` BLAS/torch threads here, and in the processes started from here."""
    for var in THREAD_VARIABLES:
        os.environ[var] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def current_threads() -> int:
    """torch's intra-op thread count in this process."""
    import torch

    return int(torch.get_num_threads())


@contextlib.contextmanager
def threads_set_to(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` threads (None: as they are), then give this process back
    its own count and environment, so that a later run in the same process starts as before."""
    if threads is None:
        yield
        return
    before = current_threads()
    variables = {var: os.environ.get(var) for var in THREAD_VARIABLES}
    limit_threads(threads)
    try:
        yield
    finally:
        for var, value in variables.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        sys.modules["torch"].set_num_threads(before)
