"""The run context handed to lifecycle hooks: what one arm x seed run is and what it holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alignzoo.config.schema import ArmSpec, ExperimentSpec

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from alignzoo.engine.models import Models


@dataclass
class RunContext:
    """One run of one arm with one seed: the ``run`` argument of the lifecycle hooks.

    Passed to ``on_run_start``, ``transform_batch``, ``on_step_end`` and ``on_run_end``.
    ``models`` (tokenizer, actor, reference, critic, device placement) is set before
    ``on_run_start``; ``step`` is the step being run (0 before the first); ``state`` is free
    space for plugins (anything JSON-serialisable kept there is saved in checkpoints and
    restored on resume); ``console`` is where a plugin may print (None when quiet).
    """

    experiment: str
    arm: str
    seed: int
    out_dir: Path
    spec: ExperimentSpec
    arm_spec: ArmSpec
    models: Models | None = None
    console: Console | None = None
    step: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """'<experiment>/<arm>/seed-<n>'."""
        return f"{self.experiment}/{self.arm}/seed-{self.seed}"

    def device(self, role: str) -> str:
        """The device placed for ``role`` (``cpu`` when the mapper did not place it)."""
        return self.models.device(role) if self.models is not None else "cpu"

    def _models(self) -> Models:
        if self.models is None:
            raise AttributeError(f"{self.name}: the run's models are not loaded yet")
        return self.models

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (shortcut for ``models.tokenizer``)."""
        return self._models().tokenizer

    @property
    def actor(self) -> torch.nn.Module:
        """The trainable policy (shortcut for ``models.actor``)."""
        return self._models().actor

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference policy or None (shortcut for ``models.reference``)."""
        return self._models().reference

    @property
    def critic(self) -> torch.nn.Module | None:
        """The value model or None (shortcut for ``models.critic``)."""
        return self._models().critic

    @property
    def devices(self) -> dict[str, str]:
        """Role -> device, as placed by the device mapper (shortcut for ``models.devices``)."""
        return dict(self.models.devices) if self.models is not None else {}
