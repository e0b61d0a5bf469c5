"""Reward scale: per-labeler normalisation of the values a labeling pass gives, and clipping.

``labeling.normalize`` (:class:`~alignzoo.config.schema.NormalizeConfig`) says how, per labeler
of the arm's chain:

- ``mode: running``: whiten, ``target_mean + target_std * (v - mean) / max(std, eps)``, by
  the running mean and standard deviation of the values that labeler gave over the run's
  training passes so far, this pass included. With ``momentum: null`` every value seen counts
  alike (Welford's algorithm: count, mean, M2); with a momentum ``m`` the mean and variance
  are an exponential moving average over passes, ``mean <- (1 - m) * mean + m * pass_mean``
  (the variance likewise, with the pass's spread about the new mean), the first pass taken as
  it is.
- ``mode: fixed``: ``(v - shift) * scale``.
- ``clip``: each normalised value is clipped to ``[-clip, clip]``.

Only values are normalised (abstains and failures are not values). The value the labeler gave
stays in ``Score.info["raw"]`` (a labeler that set ``raw`` itself keeps its own), so evaluation
reports ``eval/score`` in the labeler's units; evaluation passes are never normalised and never
change the running state. With ``labeling.normalize`` unset, a labeler's class may carry its own
default (``default_normalize``, a dict of these settings): the reward model's is running
whitening to mean 0.5, std 0.5, the scale of a 0/1 rule that is right half the time.

The running state is plain data (:meth:`RunningStats.state_dict`), kept per labeler name by the
stage (:meth:`~alignzoo.labeling.orchestrator.LabelingStage.state_dict`) and saved with the run
in every checkpoint, so a resumed run normalises exactly as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alignzoo.config.schema import ArmSpec, NormalizeConfig

STATE_KEY = "labeling_normalize"
"""The key of the normalisation state in ``run.state`` (a key of its own, replaced whole after
each training pass: a checkpoint taken while a pass runs beside it copies a consistent one)."""


@dataclass
class RunningStats:
    """The running mean and variance of one labeler's values (count, mean, M2 as Welford's;
    with a momentum, M2 is the moving variance times the count)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def update(self, values: Sequence[float], momentum: float | None = None) -> None:
        """Add one pass's values."""
        if not values:
            return
        if momentum is None or self.count == 0:
            for v in values:  # Welford
                self.count += 1
                delta = v - self.mean
                self.mean += delta / self.count
                self.m2 += delta * (v - self.mean)
            return
        n = len(values)
        pass_mean = sum(values) / n
        mean = (1 - momentum) * self.mean + momentum * pass_mean
        pass_var = sum((v - mean) ** 2 for v in values) / n
        var = (1 - momentum) * (self.var + (self.mean - mean) ** 2) + momentum * pass_var
        self.count += n
        self.mean = mean
        self.m2 = var * self.count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RunningStats:
        return cls(int(state["count"]), float(state["mean"]), float(state["m2"]))


def transform(
    cfg: NormalizeConfig, values: Sequence[float], stats: RunningStats, update: bool = True
) -> list[float]:
    """One pass's values of one labeler, normalised as ``cfg`` says; ``stats`` (running mode)
    is updated with them first (unless ``update`` is False: the caller updated it already,
    with every data-parallel rank's values)."""
    if cfg.mode == "none":
        out = [float(v) for v in values]
    elif cfg.mode == "fixed":
        out = [(v - cfg.shift) * cfg.scale for v in values]
    else:
        if update:
            stats.update(values, cfg.momentum)
        std = max(stats.std, cfg.eps)
        out = [cfg.target_mean + cfg.target_std * (v - stats.mean) / std for v in values]
    if cfg.clip is not None:
        out = [min(cfg.clip, max(-cfg.clip, v)) for v in out]
    return out


def resolve(cfg: NormalizeConfig | None, component: Any) -> NormalizeConfig:
    """The arm's setting, or (unset) the labeler's own default, or none."""
    from alignzoo.config.schema import NormalizeConfig

    if cfg is not None:
        return cfg
    default = getattr(component, "default_normalize", None)
    if default:
        return NormalizeConfig.model_validate(default)
    return NormalizeConfig()


def describe(cfg: NormalizeConfig) -> str:
    """One line: which normalisation (as the report shows it)."""
    if cfg.mode == "none":
        text = "none"
    elif cfg.mode == "fixed":
        text = f"fixed (v - {cfg.shift:g}) * {cfg.scale:g}"
    else:
        over = "all values" if cfg.momentum is None else f"momentum {cfg.momentum:g}"
        text = f"running whitening ({over}) to mean {cfg.target_mean:g}, std {cfg.target_std:g}"
    if cfg.clip is not None:
        text += f", clipped to ±{cfg.clip:g}"
    return text


def arm_normalization(arm: ArmSpec) -> str:
    """Which normalisation the arm's labeler values get (its setting or its labeler's default)."""
    component: Any = None
    if arm.labeling.normalize is None:
        try:
            from alignzoo.registry import get_registry

            component = get_registry().get("labeler", arm.labeler.name)
        except Exception:  # an unknown plugin: its default cannot be read
            component = None
    return describe(resolve(arm.labeling.normalize, component))
