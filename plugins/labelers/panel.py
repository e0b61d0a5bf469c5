"""Labeler "panel": several labelers (or raters) label every sample; their scores are
aggregated, and samples they disagree on can be left out.

``labelers``: the raters. ``aggregate``: ``mean``, ``median`` or ``majority`` (the most common
value, ties to the lower). ``agree_within`` / ``min_agree``: keep a sample only when at least
``min_agree`` raters' scores lie within ``agree_within`` of each other on the normalised scale
``scale: [low, high]`` (e.g. at least 2 within 0.3); otherwise the sample abstains with
``info["disagree"] = True`` (the arm's policy decides; by default it is dropped after the
chain), counted in ``info`` and by the labeling ledger. The aggregate is taken over the
agreeing raters. A rater that gives a sample no value is left out of that sample's panel.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.config.schema import ComponentRef
from alignzoo.human.agreement import largest_agreeing
from alignzoo.registry import build_plugin_manager, get_registry
from alignzoo.types import Outcome


class PanelLabeler(Labeler):
    """Aggregate several raters' scores (mean, median, majority), with an agreement filter."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        labelers: list[ComponentRef] = Field(min_length=2, description="The raters.")
        aggregate: Literal["mean", "median", "majority"] = Field(
            "mean", description="How the raters' scores become one: mean, median or majority."
        )
        agree_within: float | None = Field(
            None, ge=0, description="Normalised distance within which scores agree."
        )
        min_agree: int = Field(2, ge=1, description="Raters that must agree to keep a sample.")
        scale: tuple[float, float] = Field((0.0, 1.0), description="[low, high] of the scores.")

        @model_validator(mode="after")
        def _enough_raters(self) -> PanelLabeler.Params:
            if self.min_agree > len(self.labelers):
                raise ValueError(f"min_agree {self.min_agree} > {len(self.labelers)} raters")
            return self

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        registry = get_registry()
        self.raters = []
        self.labelers: dict[str, Any] = {}
        for i, ref in enumerate(self.params.labelers):
            cls = registry.get("labeler", ref.name)
            rater = cls(cls.Params.model_validate(ref.params))
            self.labelers[f"{i}.{ref.name}"] = rater
            self.raters.append(build_plugin_manager([rater]))

    def provenance_parts(self) -> dict[str, Any]:
        """The raters, by position and name, for the run's provenance."""
        return dict(self.labelers)

    @hookimpl
    def on_run_start(self, run: Any) -> None:
        for pm in self.raters:  # a reward-model rater loads its weights here
            pm.hook.on_run_start(run=run)

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        per_rater = [pm.hook.score_batch(requests=requests) for pm in self.raters]
        low, high = self.params.scale
        out = []
        for i in range(len(requests)):
            given = [s[i] for s in per_rater if s[i].outcome == Outcome.VALUE]
            values = [float(s.value) for s in given]
            if self.params.agree_within is not None:
                values = largest_agreeing(values, self.params.agree_within, low, high, strict=False)
            if len(values) < (self.params.min_agree if self.params.agree_within is not None else 1):
                score = Score.abstain("the raters disagree" if given else "no rater gave a value")
                score.info.update(
                    {"disagree": bool(given), "raters": [float(s.value) for s in given]}
                )
                out.append(score)
                continue
            if self.params.aggregate == "mean":
                value = statistics.fmean(values)
            elif self.params.aggregate == "median":
                value = float(statistics.median(values))
            else:
                counts = Counter(values)
                top = max(counts.values())
                value = min(v for v, c in counts.items() if c == top)
            info: dict[str, Any] = {
                "raters": [float(s.value) for s in given],
                "agreeing": len(values),
            }
            flags = [s.info["correct"] for s in given if "correct" in s.info]
            if flags:
                info["correct"] = sum(flags) * 2 > len(flags)  # the majority's verdict
            out.append(Score(value, info=info))
        return out
