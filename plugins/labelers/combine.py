"""Labeler "combine": a weighted sum of several labelers, each one's value logged apart.

``labelers: [arithmetic, {name: format, params: {...}}]``, ``weights: [1.0, 0.2]`` (default:
all 1). Each part labels the whole batch; the combined value is sum(w_i * v_i). The parts'
values go to ``info["rewards"]`` (the engine logs their means as ``reward/<part>``), and
``info["correct"]`` is the first part's that says it. When a part gives a sample no value
(abstain, parse failure, rejected), the combined sample takes that outcome too: a sum with a
missing term would be a different reward. A part's step scores (``Score.steps``, a process
reward model's) pass through scaled by its weight, so the dense rewards sum as the values do.

``info["rewards"]`` holds each part's raw value (before its weight), in the parts' order: the
engine places them in ``batch.reward_components`` for an algorithm that weighs several rewards
itself. GRPO does with ``multi_objective_aggregation: normalize_then_sum`` (GDPO: each part
normalised in its group before the sum) or ``reward_weights`` (TRL's names): its
``reward_weights`` are then the one list of weights, applied to the parts' raw values in this
order, and ``weights`` here must be left unset (or all 1): ``alignzoo validate`` refuses others,
which would weigh only the value, that such an algorithm does not read.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.config.schema import ComponentRef
from alignzoo.errors import LabelerTimeout, LabelerUnavailable, UserError
from alignzoo.registry import build_plugin_manager, get_registry
from alignzoo.types import Outcome, StepScore


class CombineLabeler(Labeler):
    """A weighted sum of labelers (each part also logged as ``reward/<name>``)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        labelers: list[ComponentRef] = Field(min_length=1, description="The parts, in order.")
        weights: list[float] | None = Field(None, description="One per part (default: all 1).")
        names: list[str] | None = Field(
            None,
            description="One per part: its metric name, reward/<name> (default: a python "
            "part's function name, else the labeler's name; a repeat gets _<position>).",
        )

        @model_validator(mode="after")
        def _one_weight_per_part(self) -> CombineLabeler.Params:
            if self.weights is not None and len(self.weights) != len(self.labelers):
                raise ValueError(
                    f"weights has {len(self.weights)} entries for {len(self.labelers)} labelers"
                )
            if self.weights is not None and not all(math.isfinite(w) for w in self.weights):
                raise ValueError("weights must be finite numbers")
            if self.names is not None and len(self.names) != len(self.labelers):
                raise ValueError(
                    f"names has {len(self.names)} entries for {len(self.labelers)} labelers"
                )
            if self.names is not None and len(set(self.names)) != len(self.names):
                raise ValueError("names must differ from each other")
            return self

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        registry = get_registry()
        self.parts: list[tuple[str, Any]] = []
        self.labelers: dict[str, Any] = {}
        names: list[str] = []
        for i, ref in enumerate(self.params.labelers):
            if ref.name == "combine":
                raise UserError("combine: a part may not be another combine")
            cls = registry.get("labeler", ref.name)
            part = cls(cls.Params.model_validate(ref.params))
            name = part_name(ref) if self.params.names is None else self.params.names[i]
            name = name if name not in names else f"{name}_{i + 1}"
            names.append(name)
            self.labelers[name] = part
            self.parts.append((name, build_plugin_manager([part])))
        self.weights = self.params.weights or [1.0] * len(self.parts)

    @property
    def gives_steps(self) -> bool:
        """Whether any part gives step scores (they pass through, weighted)."""
        return any(part.gives_steps for part in self.labelers.values())

    @property
    def reward_components(self) -> dict[str, float]:
        """Its parts, by name in order, each with its weight in the value."""
        return {name: w for (name, _), w in zip(self.parts, self.weights, strict=True)}

    def provenance_parts(self) -> dict[str, Any]:
        """The parts, by name, for the run's provenance."""
        return dict(self.labelers)

    @hookimpl
    def on_run_start(self, run: Any) -> None:
        for _, pm in self.parts:  # a reward-model part loads its weights here
            pm.hook.on_run_start(run=run)

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        per_part = []
        for name, pm in self.parts:
            try:
                scores = pm.hook.score_batch(requests=requests)
            except (LabelerUnavailable, LabelerTimeout, UserError):  # keep what they mean
                raise
            except Exception as exc:  # named, so a run's failure says which part raised
                raise PartFailed(f"combine part {name!r}: {type(exc).__name__}: {exc}") from exc
            if not isinstance(scores, list) or len(scores) != len(requests):
                raise ValueError(
                    f"combine: part {name!r} returned {len(scores)} scores for {len(requests)}"
                )
            per_part.append(scores)
        out = []
        for i in range(len(requests)):
            parts = [scores[i] for scores in per_part]
            missing = next((s for s in parts if s.outcome != Outcome.VALUE), None)
            if missing is not None:
                out.append(missing)
                continue
            rewards = {name: float(s.value) for (name, _), s in zip(self.parts, parts, strict=True)}
            value = sum(w * float(s.value) for w, s in zip(self.weights, parts, strict=True))
            info: dict[str, Any] = {"rewards": rewards}
            correct = next((s.info["correct"] for s in parts if "correct" in s.info), None)
            if correct is not None:
                info["correct"] = correct
            steps = [
                StepScore(step.start, step.end, w * step.score)
                for w, s in zip(self.weights, parts, strict=True)
                for step in s.steps
            ]
            out.append(Score(value, valid=all(s.valid for s in parts), info=info, steps=steps))
        return out


class PartFailed(RuntimeError):
    """A part raised (the original is the ``__cause__``); the message names the part."""


def part_name(ref: ComponentRef) -> str:
    """A part's default metric name: a python part's function name (``file.py:fn`` -> ``fn``),
    else the labeler's name."""
    function = ref.params.get("function") if ref.name == "python" else None
    if isinstance(function, str) and ":" in function:
        return function.rsplit(":", 1)[1] or ref.name
    return ref.name
