"""Demonstrations, offline (SFT): ``prompt`` / ``completion`` rows whose completion the policy
learns to write (TRL's prompt-completion format; conversational rows as ``messages``, the last
assistant turn the completion).

A training batch holds one sample per row; ``response_mask`` covers the completion only, so
the loss (the completion's negative log-likelihood) never trains on the prompt
(completion-only loss, TRL's default). Each step reads ``prompts_per_step`` rows.
"""

from __future__ import annotations

from typing import Any, ClassVar

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.modes.base import (
    OFFLINE_MAX_TOKENS,
    Collected,
    DataMode,
    StepSource,
    read_rows,
)
from alignzoo.engine.tokenize import is_token_column, row_tokens, tokenized_batch

COLUMNS = ("prompt", "completion")


def demonstrations_batch(
    tokenizer: Any,
    rows: list[dict[str, Any]],
    max_new_tokens: int,
    columns: tuple[str, ...] = COLUMNS,
) -> RolloutBatch:
    """Rows with prompt / completion as a batch, one sample (and group) per row; the other
    columns (but ``columns`` and token columns) go to the samples' extras."""
    extras = [
        {k: v for k, v in r.items() if k not in columns and not is_token_column(k)} for r in rows
    ]
    return tokenized_batch(
        tokenizer,
        [str(r["prompt"]) for r in rows],
        [str(r["completion"]) for r in rows],
        extras,
        max_new_tokens,
        prompt_tokens=row_tokens(tokenizer, rows, "prompt", True),
        response_tokens=row_tokens(tokenizer, rows, "completion", False),
    )


class OfflineDemonstrations(DataMode):
    """prompt / completion rows from the train data, imitated."""

    name: ClassVar[str] = "offline demonstrations"
    kind = "demonstrations"
    online = False
    columns: ClassVar[tuple[str, ...]] = COLUMNS
    token_columns: ClassVar[dict[str, bool]] = {"prompt": True, "completion": False}

    def collect(self, rows: list[dict[str, Any]], source: StepSource) -> Collected:
        return read_rows(
            demonstrations_batch(source.tokenizer, rows, OFFLINE_MAX_TOKENS), len(rows)
        )

    def step_sizes(self, cfg: TrainingConfig) -> tuple[int, int]:
        return cfg.prompts_per_step, cfg.prompts_per_step
