"""Labeler "simulated_annotators": the human labeler's queue, judged by simulated annotators.

It queues a run's samples exactly as the ``human`` labeler does (the same queue folder may
hold people's judgements too), lets its annotators (:mod:`alignzoo.human.simulate`: a rule labeler
plus each annotator's bias, noise and "cannot judge" rate) judge the samples that still want
judgements, then labels each sample as the human labeler would: the aggregate of its values
mapped to [0, 1], or an abstain when too few could judge. For tests and demos of the human
feedback path, and to see what annotator noise does to training.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from alignzoo import LabelRequest, Score, hookimpl
from alignzoo.config.schema import ComponentRef
from alignzoo.human.labeler import QueueLabeler
from alignzoo.human.simulate import Annotator, Simulation, rule_scorer, simulate


class SimulatedAnnotatorsLabeler(QueueLabeler):
    """Simulated people (rule + noise + bias per annotator) answering the human queue."""

    class Params(QueueLabeler.Params):
        rule: ComponentRef = Field(description="The labeler whose 0..1 score they start from.")
        annotators: list[Annotator] = Field(min_length=1, description="The annotators.")
        seed: int = Field(0, description="Seeds every annotator's draws.")
        wait_s: float = Field(0.0, ge=0, description="How long a call waits for judgements.")

        @model_validator(mode="after")
        def _enough_annotators(self) -> SimulatedAnnotatorsLabeler.Params:
            if self.raters > len(self.annotators):
                raise ValueError(
                    f"raters ({self.raters}) exceeds the {len(self.annotators)} annotators"
                )
            return self

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._scorer: Any = None

    @hookimpl
    def on_run_start(self, run: Any) -> None:
        self._scorer = rule_scorer(self.params.rule, run)

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        p = self.params
        if self._scorer is None:  # used outside a run (e.g. a labeler check)
            self._scorer = rule_scorer(p.rule)
        ids = self._q().enqueue(requests, p.raters, p.scale)
        simulation = Simulation(rule=p.rule, annotators=p.annotators, seed=p.seed)
        simulate(self._q(), simulation, self._scorer, only=ids)
        return super().score_batch(requests)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_scorer"] = None  # rebuilt in the worker
        return state
