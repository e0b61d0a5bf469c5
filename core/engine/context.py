"""The run context handed to lifecycle hooks: what one arm x seed run is and what it holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignzoo.config.schema import ArmSpec, ExperimentSpec


@dataclass
class RunContext:
    """One run of one arm with one seed.

    Passed as ``run`` to ``on_run_start``, ``transform_batch``, ``on_step_end`` and ``on_run_end``.
    Models are set by the engine before ``on_run_start``; ``state`` is free space for plugins
    (anything JSON-serialisable kept there is saved in checkpoints and restored on resume).
    """

    experiment: str
    arm: str
    seed: int
    out_dir: Path
    spec: ExperimentSpec
    arm_spec: ArmSpec
    devices: dict[str, str] = field(default_factory=dict)
    tokenizer: Any = None
    actor: Any = None
    reference: Any = None
    critic: Any = None
    console: Any = None
    step: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """'<experiment>/<arm>/seed-<n>'."""
        return f"{self.experiment}/{self.arm}/seed-{self.seed}"

    def device(self, role: str) -> str:
        """The device placed for ``role`` (``cpu`` when the mapper did not place it)."""
        return self.devices.get(role, "cpu")
