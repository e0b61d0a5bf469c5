"""Human-feedback tests share the engine tests' cached tiny warm start."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignzoo.config.schema import DataConfig, ModelConfig
from alignzoo.engine.policy import policy_path
from alignzoo.world.task import TaskConfig

from ..engine.conftest import TINY_MODEL, TINY_TASK, engine_cache, write_experiment  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def base(engine_cache: Path) -> str:  # noqa: F811  (engine_cache is the fixture above)
    """The tiny embedded warm start's folder (a policy to train reward models from)."""
    return policy_path(
        ModelConfig(embedded=TINY_MODEL), DataConfig(task=TaskConfig(**TINY_TASK)), lambda _: None
    )
