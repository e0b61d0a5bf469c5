"""Shared test setup: quick hypothesis profiles, one torch thread per worker, a private cache."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Two cores run two xdist workers: one BLAS thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(int(os.environ.get("ALIGNZOO_TEST_THREADS", "1")))
