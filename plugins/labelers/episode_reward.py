"""Labeler "episode_reward": the reward a multi-turn episode's environment gave.

An arm with an ``environment`` records, per sample, the sum of the rewards its ``env_step``
calls returned in ``extra["episode"]["reward"]``; this labeler returns it (abstaining when the
environment gave none, or for a sample that is not an episode). Alone it trains on the
environment's reward; in a ``combine`` with another labeler (a rule over the final answer, a
reward model over the transcript) it adds the two, with weights.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.plugin import Labeler
from alignzoo.types import LabelRequest, Score


class EpisodeRewardLabeler(Labeler):
    """The environment's reward of a multi-turn episode (summed over its steps)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        missing: float | None = Field(
            None,
            description="The value of an episode whose environment gave no reward (null: "
            "abstain, so the arm's labeling policy decides).",
        )

    params: Params

    def score(self, request: LabelRequest) -> Score:
        episode = request.extra.get("episode")
        reward = episode.get("reward") if isinstance(episode, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            if self.params.missing is not None:
                return Score(float(self.params.missing), info={"reward": None})
            why = "not an episode" if episode is None else "the environment gave no reward"
            return Score.abstain(why)
        if not math.isfinite(reward):
            return Score(float(reward), info={"reward": reward})  # rejected by the stage
        return Score(float(reward), info={"reward": float(reward)})
