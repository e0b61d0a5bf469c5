"""The run context handed to lifecycle hooks: what one arm x seed run is and what it holds."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alignzoo.config.schema import ArmSpec, ExperimentSpec
from alignzoo.runfolder import RunFolder
from alignzoo.types import Placement

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

    def placement(self, role: str) -> Placement:
        """The full placement of ``role``: device, GPU share, tensor-parallel size."""
        if self.models is None:
            return Placement(device="cpu")
        return self.models.placement(role)

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

    def record(self, stream: str, row: dict[str, Any]) -> Path:
        """Append ``row`` as one JSON line to ``<out_dir>/<stream>.jsonl``; return that path.

        How a plugin keeps its own output in the run folder: the row is stamped with the step
        being run (``"step"``), so on ``--resume`` the file is cut back to the checkpoint like
        the engine's own streams and nothing is written twice. ``stream`` is a plain name
        (letters, digits, ``_``), not one of the engine's (metrics, eval, samples).
        """
        from alignzoo.engine.sinks import append_jsonl

        if not _STREAM.fullmatch(stream) or stream in _ENGINE_STREAMS:
            raise ValueError(
                f"record: stream must be a plain name (letters, digits, _; at most 64) other "
                f"than {', '.join(sorted(_ENGINE_STREAMS))}, got {stream!r}"
            )
        path = RunFolder(self.out_dir).stream(stream)
        path.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(path, {**row, "step": self.step})
        return path


_STREAM = re.compile(r"[A-Za-z0-9_]{1,64}")
_ENGINE_STREAMS = frozenset({"metrics", "eval", "samples"})
