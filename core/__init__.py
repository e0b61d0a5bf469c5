"""alignzoo: a plugin registry and algorithm zoo for LLM post-training, with fair A/B experiments.

Importing ``alignzoo`` is light (no torch). The public API::

    from alignzoo import hookimpl, Algorithm, Labeler, Backend, DeviceMapper, Modifier, Environment
    from alignzoo import Stateful
    from alignzoo import LabelRequest, Score, LossContext, LossOutput, AlgorithmRequirements
    from alignzoo import Placement, SamplingParams
    from alignzoo import RolloutBatch, PolicyOutputs, PolicyWeights   # tensors (imports torch)
    from alignzoo import load_experiment, get_registry
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from alignzoo._lazy import lazy_import
from alignzoo.config.loader import LoadedExperiment, load_experiment
from alignzoo.config.schema import ExperimentSpec
from alignzoo.errors import (
    AlignzooError,
    ConfigError,
    LabelerTimeout,
    LabelerUnavailable,
    RunError,
    UserError,
)
from alignzoo.plugin import (
    Algorithm,
    Backend,
    Component,
    DeviceMapper,
    Environment,
    Labeler,
    Modifier,
    NoParams,
    Stateful,
    hookimpl,
)
from alignzoo.registry import Registry, get_registry
from alignzoo.types import (
    AlgorithmRequirements,
    LabelRequest,
    LossContext,
    LossOutput,
    Outcome,
    Placement,
    SamplingParams,
    Score,
)

if TYPE_CHECKING:
    from alignzoo.batch import PolicyOutputs, RolloutBatch
    from alignzoo.weights import PolicyWeights

try:
    __version__ = version("alignzoo")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "Algorithm",
    "AlgorithmRequirements",
    "AlignzooError",
    "Backend",
    "Component",
    "ConfigError",
    "DeviceMapper",
    "Environment",
    "ExperimentSpec",
    "LabelRequest",
    "Labeler",
    "LabelerTimeout",
    "LabelerUnavailable",
    "LoadedExperiment",
    "LossContext",
    "LossOutput",
    "Modifier",
    "NoParams",
    "Outcome",
    "Placement",
    "PolicyOutputs",
    "PolicyWeights",
    "Registry",
    "RolloutBatch",
    "RunError",
    "SamplingParams",
    "Score",
    "Stateful",
    "UserError",
    "__version__",
    "get_registry",
    "hookimpl",
    "lazy_import",
    "load_experiment",
]


def __getattr__(name: str) -> Any:
    # Tensor types import torch: load them only when asked for.
    if name in ("RolloutBatch", "PolicyOutputs"):
        from alignzoo import batch

        return getattr(batch, name)
    if name == "PolicyWeights":
        from alignzoo import weights

        return weights.PolicyWeights
    raise AttributeError(f"module 'alignzoo' has no attribute {name!r}")
