"""Hand-built registries and components for core tests (no dependence on the built-in plugins)."""

from __future__ import annotations

from importlib import metadata

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Algorithm, AlgorithmRequirements, Backend, DeviceMapper, Labeler
from alignzoo.registry import Registry


class ToyAlgoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_size: int = Field(4, gt=0)
    clip_ratio: float = 0.2


class ToyAlgorithm(Algorithm):
    """A toy algorithm for tests."""

    Params = ToyAlgoParams
    requirements = AlgorithmRequirements(reference=False)


class ToyLabeler(Labeler):
    """A toy labeler."""

    def score(self, request):  # pragma: no cover - not called
        raise NotImplementedError


class ToyBackend(Backend):
    """A toy backend."""


class ToyDevices(DeviceMapper):
    """A toy device mapper."""


def toy_registry() -> Registry:
    registry = Registry(entry_points=[])
    registry.register(ToyAlgorithm, "grpo", provider="toy")
    registry.register(ToyAlgorithm, "ppo", provider="toy")
    registry.register(ToyLabeler, "arithmetic", provider="toy")
    registry.register(ToyBackend, "hf", provider="toy")
    registry.register(ToyDevices, "single", provider="toy")
    return registry


def entry_point(name: str, value: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=value, group="alignzoo")


def reward_len(completions: list[str], **kwargs: object) -> list[float]:
    """A TRL-style reward function (what a bare-function entry point would name)."""
    return [-abs(20 - len(c)) for c in completions]
