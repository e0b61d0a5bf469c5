"""Shared test setup: the test plugin package (for the tests only), quick hypothesis
profiles, one torch thread per worker."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_PKG = ROOT / "tests" / "plugin_pkg"
TEST_PLUGINS = ROOT / ".test-plugins"


def _test_plugins() -> Path:
    """tests/plugin_pkg (test doubles: canned, keyword, all_cpu, ...) installed into
    .test-plugins/ (rebuilt when its sources change), never into the user's environment."""
    sources = [p for p in PLUGIN_PKG.rglob("*") if p.is_file() and ".egg-info" not in str(p)]
    stamp = TEST_PLUGINS / ".stamp"
    newest = str(max(p.stat().st_mtime_ns for p in sources))
    TEST_PLUGINS.parent.mkdir(exist_ok=True)
    with open(ROOT / ".test-plugins.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers start together: one installs
        if not stamp.exists() or stamp.read_text() != newest:
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                 "--upgrade", "--target", str(TEST_PLUGINS), str(PLUGIN_PKG)],
                check=True, capture_output=True,
            )  # fmt: skip
            stamp.write_text(newest)
    return TEST_PLUGINS


_plugins = str(_test_plugins())
if _plugins not in sys.path:
    sys.path.insert(0, _plugins)  # entry points are found on sys.path
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_plugins, *filter(None, [os.environ.get("PYTHONPATH")])]
    )  # and in the subprocesses the tests start

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


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A torch.distributed (gloo) group of this process alone: what FSDP2 needs to shard a
    model in a test, with the sharding code paths and a world of one."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "process-group-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
