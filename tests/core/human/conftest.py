"""Human-feedback tests share the engine tests' cached tiny warm start."""

from __future__ import annotations

from ..engine.conftest import engine_cache, write_experiment  # noqa: F401  (fixtures)
