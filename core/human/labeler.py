"""The queue labeler's machinery: ratings from people (or simulated annotators) through a
:class:`~alignzoo.human.queue.HumanQueue`. The built-in labelers ``human``
(:mod:`alignzoo.plugins.labelers.human`) and ``simulated_annotators`` are this class, so that
neither plugin imports the other.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignzoo.plugin import Labeler, hookimpl
from alignzoo.types import LabelRequest, Score


class QueueLabeler(Labeler):
    """Ratings from people, through a queue that outlives the run."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        queue: str = Field(description="Folder of the queue (queue.sqlite), shared by raters.")
        raters: int = Field(1, ge=1, description="Judgements wanted per response.")
        min_raters: int | None = Field(
            None, ge=1, description="Values needed to label a response (default: raters)."
        )
        scale: tuple[float, float] = Field((1.0, 5.0), description="Lowest and highest rating.")
        aggregate: Literal["mean", "median"] = Field(
            "mean", description="How the raters' values become one: mean or median."
        )
        wait_s: float = Field(60.0, ge=0, description="How long a call waits for ratings.")
        poll_s: float = Field(0.5, gt=0, description="How often it looks at the queue.")

        @model_validator(mode="after")
        def _check(self) -> QueueLabeler.Params:
            if self.scale[1] <= self.scale[0]:
                raise ValueError(f"scale: highest must exceed lowest, got {list(self.scale)}")
            if self.min_raters is not None and self.min_raters > self.raters:
                raise ValueError(
                    f"min_raters ({self.min_raters}) cannot exceed raters ({self.raters})"
                )
            return self

    params: Params
    deterministic = False  # people answer when they answer

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._queue: Any = None
        self._asked: dict[int, None] = {}  # the queue items this run asked for, in order

    def _q(self) -> Any:
        from alignzoo.human.queue import HumanQueue

        if self._queue is None:
            self._queue = HumanQueue(self.params.queue)
        return self._queue

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None

    def __getstate__(self) -> dict[str, Any]:  # a worker process opens its own connection
        state = dict(self.__dict__)
        state["_queue"] = None
        state["_asked"] = {}
        return state

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        p = self.params
        queue = self._q()
        ids = queue.enqueue(requests, p.raters, p.scale)
        self._asked.update(dict.fromkeys(ids))
        deadline = time.monotonic() + p.wait_s
        while True:
            got = queue.judgements(ids)
            if all(len(got[i]) >= p.raters for i in ids) or time.monotonic() >= deadline:
                break
            time.sleep(min(p.poll_s, max(0.0, deadline - time.monotonic())))
        return [self._verdict(got[i]) for i in ids]

    @hookimpl
    def on_step_end(self, run: Any, step: int, metrics: dict[str, float]) -> None:
        """``human/*`` in the step's metrics, over the samples this run queued: how many,
        the share with all their judgements, and Krippendorff's alpha of the ratings."""
        if not self._asked:
            return
        from alignzoo.human.agreement import krippendorff_alpha

        low, high = self.params.scale
        given = self._q().judgements(list(self._asked))
        values = [
            [None if v is None else (v - low) / (high - low) for v in g] for g in given.values()
        ]
        metrics["human/items"] = float(len(values))
        metrics["human/complete_frac"] = sum(len(g) >= self.params.raters for g in values) / len(
            values
        )
        alpha = krippendorff_alpha(values)
        if alpha == alpha:  # NaN until two judgements of one item vary
            metrics["human/alpha"] = alpha

    def _verdict(self, judgements: list[float | None]) -> Score:
        p = self.params
        values = [v for v in judgements if v is not None]
        if len(values) >= (p.min_raters or p.raters):
            raw = statistics.fmean(values) if p.aggregate == "mean" else statistics.median(values)
            low, high = p.scale
            return Score((raw - low) / (high - low), True, {"ratings": values, "rating": raw})
        if judgements and len(judgements) >= p.raters:  # everyone answered, too few could judge
            return Score.abstain(f"{len(judgements) - len(values)} rater(s) could not judge")
        score = Score.abstain(f"waiting for raters: {len(values)} of {p.min_raters or p.raters}")
        score.info["pending"] = True
        return score
