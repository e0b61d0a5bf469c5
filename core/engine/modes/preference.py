"""Preference pairs, online or offline (DPO, SimPO and other pairwise losses).

A training batch holds adjacent pairs: sample ``2i`` is the chosen response and ``2i + 1`` the
rejected one, both with ``group_ids == i`` and ``labels`` 1.0 / 0.0 (read them with
:mod:`alignzoo.preference`). Minibatching never separates a pair.

- Offline: rows with ``prompt`` / ``chosen`` / ``rejected`` (TRL's preference format); a row is
  two samples towards the budget.
- Online: ``samples_per_prompt`` responses are sampled per prompt and scored; per prompt the
  highest-scored response is chosen and the lowest rejected. Prompts whose best and worst
  scores tie give no pair. Every sampled response counts towards the budget.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.modes.base import (
    OFFLINE_MAX_TOKENS,
    Collected,
    DataMode,
    StepSource,
    read_rows,
    sample_and_label,
)
from alignzoo.engine.tokenize import is_token_column, row_tokens, tokenized_batch
from alignzoo.errors import RunError

COLUMNS = ("prompt", "chosen", "rejected")


def pair_by_score(batch: RolloutBatch) -> RolloutBatch | None:
    """Per group, the highest-scored sample is chosen and the lowest rejected.

    Groups whose best and worst scores tie give no pair and are dropped; None when no group is
    left. Ties are broken by sample order (the first best, the last worst).
    """
    assert batch.scores is not None
    order: list[int] = []
    for gid in torch.unique(batch.group_ids, sorted=True).tolist():
        members = (batch.group_ids == gid).nonzero().flatten().tolist()
        scores = batch.scores[members]
        best = members[int(torch.argmax(scores))]
        worst = members[len(members) - 1 - int(torch.argmin(scores.flip(0)))]
        if batch.scores[best] > batch.scores[worst]:
            order += [best, worst]
    if not order:
        return None
    pairs = batch.select(order)
    pairs.group_ids = torch.arange(len(order) // 2).repeat_interleave(2)
    pairs.labels = torch.tensor([1.0, 0.0]).repeat(len(order) // 2)
    return pairs


def preference_batch(
    tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int
) -> RolloutBatch:
    """Rows with prompt / chosen / rejected become adjacent (chosen, rejected) pairs."""
    prompts, responses, extras = [], [], []
    for row in rows:
        extra = {k: v for k, v in row.items() if k not in COLUMNS and not is_token_column(k)}
        for key in ("chosen", "rejected"):
            prompts.append(str(row["prompt"]))
            responses.append(str(row[key]))
            extras.append(dict(extra))
    prompt_tokens = row_tokens(tokenizer, rows, "prompt", True)  # each prompt encoded once
    chosen = row_tokens(tokenizer, rows, "chosen", False)
    rejected = row_tokens(tokenizer, rows, "rejected", False)
    batch = tokenized_batch(
        tokenizer,
        prompts,
        responses,
        extras,
        max_new_tokens,
        prompt_tokens=[ids for ids in prompt_tokens for _ in range(2)],
        response_tokens=[ids for pair in zip(chosen, rejected, strict=True) for ids in pair],
    )
    batch.group_ids = torch.arange(len(rows)).repeat_interleave(2)
    batch.labels = torch.tensor([1.0, 0.0]).repeat(len(rows))
    return batch


class _Pairs(DataMode):
    kind = "preference"
    unit: ClassVar[int] = 2

    def check(self, batch: RolloutBatch, step: int) -> None:
        if batch.size % 2 or not torch.equal(batch.group_ids[::2], batch.group_ids[1::2]):
            raise RunError(
                f"step {step}: the preference batch is no longer adjacent (chosen, rejected) "
                f"pairs ({batch.size} samples); a batch transform must keep or drop both "
                "samples of a pair"
            )


class OnlinePairs(_Pairs):
    """Sampled responses, paired best vs worst per prompt by the labeler's scores."""

    name: ClassVar[str] = "online pairs"
    online = True

    def collect(self, rows: list[dict[str, Any]], source: StepSource) -> Collected:
        return sample_and_label(rows, source)

    def select(self, batch: RolloutBatch, metrics: dict[str, float]) -> RolloutBatch | None:
        pairs = pair_by_score(batch)
        metrics["batch/pairs"] = 0.0 if pairs is None else float(pairs.size // 2)
        return pairs

    def step_sizes(self, cfg: TrainingConfig) -> tuple[int, int]:
        return cfg.prompts_per_step * cfg.samples_per_prompt, 2 * cfg.prompts_per_step


class OfflinePreference(_Pairs):
    """prompt / chosen / rejected rows from the train data."""

    name: ClassVar[str] = "offline preference"
    online = False
    columns: ClassVar[tuple[str, ...]] = COLUMNS
    token_columns: ClassVar[dict[str, bool]] = {"prompt": True, "chosen": False, "rejected": False}

    def collect(self, rows: list[dict[str, Any]], source: StepSource) -> Collected:
        return read_rows(preference_batch(source.tokenizer, rows, OFFLINE_MAX_TOKENS), len(rows))

    def step_sizes(self, cfg: TrainingConfig) -> tuple[int, int]:
        return 2 * cfg.prompts_per_step, 2 * cfg.prompts_per_step
