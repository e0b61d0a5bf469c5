"""Dataflow transforms between labeling and training: each a modifier on ``transform_batch``.

- ``dedupe``: within each group, keep the first of identical responses, so one answer repeated
  by the sampler is not counted several times in the group's baseline and loss.
- ``length_filter``: leave out responses shorter than ``min_tokens`` or longer than
  ``max_tokens`` (and, with ``drop_truncated``, those cut off by the generation budget).
- ``zero_variance_filter``: leave out groups whose samples all scored the same (their
  advantages are zero for GRPO-style baselines: compute spent on no signal; DAPO's dynamic
  sampling filter).
- ``reward_hacking``: flag samples that score at least ``min_score`` while their response fails
  a format check (a regex fullmatch); set them to ``penalty`` or drop them.
- ``reweight``: per-sample loss weights by difficulty (the group's pass rate) or by a labeler's
  ``info`` value (see :class:`Reweight`).

Each counts what it did for the step (``dataflow/<name>/<count>``, added to the step's metrics
in ``on_step_end``). They apply to sampled batches (online samples and unpaired arms); a
preference batch of (chosen, rejected) pairs is passed through unchanged.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from alignzoo._lazy import lazy_import
from alignzoo.plugin import Modifier, hookimpl

torch = lazy_import("torch")


class _Counting(Modifier):
    """A transform that counts per step and reports the counts in on_step_end."""

    name: ClassVar[str] = ""

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.counts: dict[str, float] = {}

    def count(self, key: str, n: float) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + float(n)

    @hookimpl
    def on_step_end(self, run: Any, step: int, metrics: dict[str, float]) -> None:
        for key, value in self.counts.items():
            metrics[f"dataflow/{self.name}/{key}"] = value
        self.counts = {}


def is_pairs(batch: Any) -> bool:
    """A preference batch: every group one chosen (label 1) and one rejected (label 0)."""
    if getattr(batch, "labels", None) is None:
        return False
    members: dict[int, list[float]] = {}
    for group, label in zip(batch.group_ids.tolist(), batch.labels.tolist(), strict=True):
        members.setdefault(group, []).append(label)
    return all(sorted(v) == [0.0, 1.0] for v in members.values())


def _keep(batch: Any, keep: list[int]) -> Any:
    return batch if len(keep) == batch.size else batch.select(keep)


class Dedupe(_Counting):
    """Keep the first of identical responses within each group."""

    name = "dedupe"

    @hookimpl
    def transform_batch(self, batch: Any, run: Any) -> Any:
        if is_pairs(batch):
            return batch
        seen: set[tuple[int, str]] = set()
        keep = []
        groups = batch.group_ids.tolist()
        for i, (group, text) in enumerate(zip(groups, batch.responses, strict=True)):
            if (group, text) not in seen:
                seen.add((group, text))
                keep.append(i)
        self.count("removed", batch.size - len(keep))
        return _keep(batch, keep)


class LengthFilter(_Counting):
    """Leave out responses outside [min_tokens, max_tokens] (EOS counted), or truncated ones."""

    name = "length_filter"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        min_tokens: int = Field(
            1, ge=0, description="Shortest response kept, in tokens (EOS counted)."
        )
        max_tokens: int | None = Field(
            None, ge=1, description="Longest response kept (none by default)."
        )
        drop_truncated: bool = Field(
            False, description="Also drop responses that hit the generation budget without EOS."
        )

    params: Params

    @hookimpl
    def transform_batch(self, batch: Any, run: Any) -> Any:
        if is_pairs(batch):
            return batch
        lengths = batch.response_mask.sum(dim=1).tolist()
        width = batch.response_mask.shape[1]
        keep = []
        for i, n in enumerate(lengths):
            if n < self.params.min_tokens or (
                self.params.max_tokens is not None and n > self.params.max_tokens
            ):
                continue
            if self.params.drop_truncated and n >= width and not _ends_with_eos(batch, i, run):
                continue
            keep.append(i)
        self.count("removed", batch.size - len(keep))
        return _keep(batch, keep)


def _ends_with_eos(batch: Any, i: int, run: Any) -> bool:
    tokenizer = getattr(run, "tokenizer", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    n = int(batch.response_mask[i].sum())
    return eos is not None and n > 0 and int(batch.response_ids[i, n - 1]) == eos


class ZeroVarianceFilter(_Counting):
    """Leave out groups whose samples all have the same score (no learning signal)."""

    name = "zero_variance_filter"

    @hookimpl
    def transform_batch(self, batch: Any, run: Any) -> Any:
        if batch.scores is None or is_pairs(batch):
            return batch
        by_group: dict[int, list[float]] = {}
        for group, score in zip(batch.group_ids.tolist(), batch.scores.tolist(), strict=True):
            by_group.setdefault(group, []).append(score)
        flat = {g for g, s in by_group.items() if max(s) - min(s) <= 1e-12}
        keep = [i for i, g in enumerate(batch.group_ids.tolist()) if g not in flat]
        self.count("groups_removed", len(flat))
        self.count("removed", batch.size - len(keep))
        return _keep(batch, keep)


class RewardHacking(_Counting):
    """Flag a high score on a response that fails the format check; penalise or drop it."""

    name = "reward_hacking"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        format: str = Field(r"[+-]?\d+", description="The expected format, a regex fullmatch.")
        min_score: float = Field(0.5, description="A score at least this high is suspect.")
        action: Literal["penalty", "drop"] = Field(
            "penalty",
            description="penalty: set the flagged samples' score to penalty; drop: leave them out.",
        )
        penalty: float = Field(0.0, description="The score a flagged sample gets.")

        @field_validator("format")
        @classmethod
        def _regex(cls, v: str) -> str:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression ({exc})") from None
            return v

    params: Params

    @hookimpl
    def transform_batch(self, batch: Any, run: Any) -> Any:
        if batch.scores is None or is_pairs(batch):
            return batch
        flagged = [
            i
            for i, (text, score) in enumerate(
                zip(batch.responses, batch.scores.tolist(), strict=True)
            )
            if score >= self.params.min_score
            and re.fullmatch(self.params.format, text.strip()) is None
        ]
        self.count("flagged", len(flagged))
        if not flagged:
            return batch
        if self.params.action == "drop":
            keep = [i for i in range(batch.size) if i not in set(flagged)]
            return _keep(batch, keep)
        scores = batch.scores.clone()
        scores[torch.tensor(flagged, dtype=torch.long)] = self.params.penalty
        batch.scores = scores
        return batch


class Reweight(_Counting):
    """Per-sample loss weights (``batch.weights``, which every loss of the zoo multiplies in).

    ``by``:

    - ``difficulty``: a group's samples get ``4 p (1 - p)``, with ``p`` the group's mean score
      mapped to [0, 1] over the batch's score range: prompts the policy solves about half the
      time weigh most, those it always or never solves least (a curriculum on difficulty);
    - ``info``: the labeler's ``info[key]`` per sample (for example a panel's agreement, a
      rater's confidence); a sample without it weighs 1.

    Weights are clipped to [``min_weight``, ``max_weight``], multiplied into any weights the
    batch has already and, with ``normalize``, scaled to mean 1 over the batch, so the step
    size stays what the learning rate says. Counts: ``mean``, ``min`` and ``max`` of the new
    weights.
    """

    name = "reweight"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        by: Literal["difficulty", "info"] = Field(
            "difficulty",
            description="difficulty: 4p(1-p) of the group's pass rate; info: the labeler's info[key].",
        )
        key: str = Field("weight", description="The info key read with by: info.")
        min_weight: float = Field(0.1, ge=0, description="Weights are clipped to at least this.")
        max_weight: float = Field(10.0, gt=0, description="Weights are clipped to at most this.")
        normalize: bool = Field(True, description="Scale the weights to mean 1 over the batch.")

    params: Params
    sets_weights: ClassVar[bool] = True

    def _weights(self, batch: Any) -> list[float]:
        if self.params.by == "info":
            infos = batch.label_info or [{}] * batch.size
            return [float(info.get(self.params.key, 1.0)) for info in infos]
        scores = batch.scores.tolist()
        low, high = min(scores), max(scores)
        span = high - low if high > low else 1.0
        by_group: dict[int, list[float]] = {}
        for group, score in zip(batch.group_ids.tolist(), scores, strict=True):
            by_group.setdefault(group, []).append((score - low) / span)
        mean = {g: sum(v) / len(v) for g, v in by_group.items()}
        return [4 * mean[g] * (1 - mean[g]) for g in batch.group_ids.tolist()]

    @hookimpl
    def transform_batch(self, batch: Any, run: Any) -> Any:
        if batch.scores is None or batch.size == 0 or is_pairs(batch):
            return batch
        p = self.params
        weights = torch.tensor(self._weights(batch), dtype=torch.float32)
        weights = weights.clamp(p.min_weight, p.max_weight)
        if batch.weights is not None:
            weights = weights * batch.weights.float().cpu()
        if p.normalize and float(weights.sum()) > 0:
            weights = weights * (weights.numel() / weights.sum())
        batch.weights = weights.to(batch.response_mask.device)
        self.count("mean", float(weights.mean()))
        self.count("min", float(weights.min()))
        self.count("max", float(weights.max()))
        return batch
