"""Labeling fixtures: the engine's tiny experiment writer, for the tests that run a labeled run."""

from ..engine.conftest import engine_cache, write_experiment  # noqa: F401  (fixtures)
