"""Modifier "replay": a priority buffer of labeled groups, mixed into each step's fresh batch.

After labeling, every fresh group (the samples of one prompt) is kept in a buffer of at most
``capacity`` groups with its sampling log-probs, scores and reference log-probs; each step then
adds replayed groups so that they make up ``ratio`` of the groups trained on. A group is drawn
(without replacement within a step) with probability proportional to ``priority ** alpha``
(plus ``epsilon``), where the priority is

- ``variance``: the variance of the group's scores (groups that still carry a learning signal
  for a group baseline; prioritised-replay style),
- ``score``: the group's mean score (shifted to be positive),
- ``recency``: the step the group was sampled at (newer first).

Replayed samples keep the log-probs of the policy that sampled them (``old_logprobs``), so a
clipped importance ratio (PPO, GRPO) corrects for their staleness; ``max_age`` steps bounds it.
Counts per step: ``replay/added``, ``replay/size``. The buffer is saved in checkpoints.
"""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.plugin import Modifier, hookimpl

torch = lazy_import("torch")
batch_module = lazy_import("alignzoo.batch")


def draw(
    priorities: list[float], k: int, alpha: float, epsilon: float, rng: random.Random
) -> list[int]:
    """``k`` distinct indices, each draw with probability proportional to ``p ** alpha +
    epsilon`` among those not yet drawn."""
    weights = [max(p, 0.0) ** alpha + epsilon for p in priorities]
    chosen: list[int] = []
    available = list(range(len(weights)))
    for _ in range(min(k, len(available))):
        total = sum(weights[i] for i in available)
        pick = rng.random() * total
        for position, i in enumerate(available):
            pick -= weights[i]
            if pick <= 0 or position == len(available) - 1:
                chosen.append(i)
                available.pop(position)
                break
    return chosen


class Replay(Modifier):
    """Mix replayed groups, drawn by priority, into each step's fresh samples."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        capacity: int = Field(256, ge=1, description="Groups kept (the oldest leave first).")
        ratio: float = Field(0.25, ge=0, lt=1, description="Share of replayed groups per step.")
        priority: Literal["variance", "score", "recency"] = Field(
            "variance",
            description="What a group is drawn by: variance of its scores, mean score, or recency.",
        )
        alpha: float = Field(1.0, ge=0, description="Sharpness: 0 draws uniformly.")
        epsilon: float = Field(1e-3, gt=0, description="Every group keeps some chance.")
        max_age: int | None = Field(None, ge=1, description="Steps after which a group leaves.")
        seed: int = Field(
            0, description="Seed of the draws (saved with the buffer in checkpoints)."
        )

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.buffer: list[dict[str, Any]] = []  # {"step", "priority", "batch": RolloutBatch}
        self.rng = random.Random(self.params.seed)
        self.counts: dict[str, float] = {}

    def _priority(self, scores: list[float], step: int) -> float:
        if self.params.priority == "recency":
            return float(step)
        if self.params.priority == "score":
            return sum(scores) / len(scores)
        mean = sum(scores) / len(scores)
        return sum((s - mean) ** 2 for s in scores) / len(scores)

    @hookimpl
    def transform_batch(self, batch: Any, run: Any) -> Any:
        if batch.scores is None or batch.size == 0 or batch.labels is not None:
            return batch  # sampled, scored batches only (not preference pairs)
        step = int(getattr(run, "step", 0) or 0)
        if self.params.max_age is not None:
            self.buffer = [g for g in self.buffer if step - g["step"] <= self.params.max_age]
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(batch.group_ids.tolist()):
            groups.setdefault(g, []).append(i)
        fresh = len(groups)
        k = round(self.params.ratio * fresh / (1 - self.params.ratio))
        picked: list[dict[str, Any]] = []
        if k and self.buffer:
            if self.params.priority == "score":
                low = min(g["priority"] for g in self.buffer)
                priorities = [g["priority"] - low for g in self.buffer]
            elif self.params.priority == "recency":
                oldest = min(g["priority"] for g in self.buffer)
                priorities = [1.0 + g["priority"] - oldest for g in self.buffer]
            else:
                priorities = [g["priority"] for g in self.buffer]
            picked = [self.buffer[i] for i in draw(priorities, k, self.params.alpha,
                                                     self.params.epsilon, self.rng)]  # fmt: skip
        # Keep this step's fresh groups for later steps (not replayed in the step they came in).
        for members in groups.values():
            part = batch.select(members).to("cpu")
            scores = part.scores.tolist()
            self.buffer.append(
                {"step": step, "priority": self._priority(scores, step), "batch": part}
            )
        self.buffer = self.buffer[-self.params.capacity :]
        self.counts = {"replay/added": float(sum(g["batch"].size for g in picked)),
                       "replay/size": float(len(self.buffer))}  # fmt: skip
        if not picked:
            return batch
        device = batch.response_mask.device
        top = int(batch.group_ids.max()) + 1
        parts = [batch]
        for offset, group in enumerate(picked):
            part = group["batch"].to(device)
            part.group_ids = torch.full_like(part.group_ids, top + offset)  # a group of its own
            parts.append(_aligned(part, batch))
        return batch_module.RolloutBatch.concat(parts)

    @hookimpl
    def on_step_end(self, run: Any, step: int, metrics: dict[str, float]) -> None:
        metrics.update(self.counts)
        self.counts = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": list(self.rng.getstate()[1]),
            "rng_version": self.rng.getstate()[0],
            "buffer": [
                {"step": g["step"], "priority": g["priority"], "batch": _plain(g["batch"])}
                for g in self.buffer
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate((state["rng_version"], tuple(state["rng"]), None))
        self.buffer = [
            {
                "step": g["step"],
                "priority": g["priority"],
                "batch": batch_module.RolloutBatch(**g["batch"]),
            }
            for g in state["buffer"]
        ]


def _plain(batch: Any) -> dict[str, Any]:
    return {f.name: getattr(batch, f.name) for f in fields(batch)}


def _aligned(part: Any, like: Any) -> Any:
    """``part`` with the optional fields ``like`` has and it lacks set, and the others unset,
    so that the two concatenate."""
    for f in fields(part):
        mine, theirs = getattr(part, f.name), getattr(like, f.name)
        if theirs is None and mine is not None:
            setattr(part, f.name, None)
    return part
