"""Demonstrations, offline (SFT): ``prompt`` / ``completion`` rows whose completion the policy
learns to write (TRL's prompt-completion format; conversational rows as ``messages``, the last
assistant turn the completion).

A training batch holds one sample per row; ``response_mask`` covers the completion only, so
the loss (the completion's negative log-likelihood) never trains on the prompt
(completion-only loss, TRL's default). Each step reads ``prompts_per_step`` rows.

An algorithm with an ``on_policy_fraction`` lambda > 0 (GKD) has that share of its steps
sampled instead: the policy writes one response to each of the step's prompts (at
``training.sampling``, unlabeled), and the step trains on those. Whether a step is sampled is
drawn from its first row's sampling seed, so a rerun or a resumed run draws the same steps;
under several processes each draws its own, as TRL's GKDTrainer does.

An algorithm with ``teacher_completions`` (``seq_kd``) trains the other steps on the teacher's
own samples of the step's prompts instead of the rows' completions (sequence-level
distillation): :class:`TeacherWriter` samples them with the ``hf`` backend over the frozen
teacher, at ``training.sampling`` and the rows' own seeds.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.modes.base import (
    OFFLINE_MAX_TOKENS,
    Collected,
    DataMode,
    StepSource,
    read_rows,
    sample,
    split_rows,
)
from alignzoo.engine.tokenize import is_token_column, row_tokens, tokenized_batch

COLUMNS = ("prompt", "completion")
ON_POLICY = "batch/on_policy"
"""1 when the step trained on the policy's own samples, 0 when on the rows' completions."""


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

    teacher_writer: TeacherWriter | None = None
    """Set by the engine for an algorithm with ``teacher_completions``."""

    def collect(self, rows: list[dict[str, Any]], source: StepSource) -> Collected:
        if self.samples_this_step(source):
            batch, m = sample(rows, source, n=1)
            m[ON_POLICY] = 1.0
            return _written(batch, m)
        if self.teacher_writer is not None:
            batch, m = self.teacher_writer.write(rows, source)
            if self.on_policy_fraction > 0:
                m[ON_POLICY] = 0.0
            return _written(batch, m)
        collected = read_rows(
            demonstrations_batch(source.tokenizer, rows, OFFLINE_MAX_TOKENS), len(rows)
        )
        if self.on_policy_fraction > 0:
            collected.metrics[ON_POLICY] = 0.0
        return collected

    def samples_this_step(self, source: StepSource) -> bool:
        """Whether this step's batch is the policy's samples (drawn with probability
        ``on_policy_fraction`` from the step's first sampling seed)."""
        if self.on_policy_fraction <= 0 or not source.seeds:
            return False
        draw = np.random.default_rng([source.seeds[0], 0x6B64]).random()
        return bool(draw < self.on_policy_fraction)

    def step_sizes(self, cfg: TrainingConfig) -> tuple[int, int]:
        return cfg.prompts_per_step, cfg.prompts_per_step


def _written(batch: RolloutBatch, m: dict[str, float]) -> Collected:
    """A step's batch that a model wrote (the policy or the teacher), one response a row."""
    tokens = int(batch.response_mask.sum())
    m[canonical.BATCH_RESPONSES] = float(batch.size)
    m[canonical.RESPONSE_LENGTH] = tokens / max(batch.size, 1)
    return Collected(batch, samples=batch.size, tokens=tokens, metrics=m)


class TeacherWriter:
    """The teacher's own completions of a step's prompts: the registered ``hf`` backend
    sampling with the frozen teacher (on its device, the run's precision), one response per
    row at ``training.sampling`` and the rows' seeds."""

    def __init__(self, teacher: Any, tokenizer: Any, device: str, autocast: Any) -> None:
        from alignzoo.registry import get_registry

        self.backend = get_registry().get("backend", "hf")()
        run = SimpleNamespace(
            actor=teacher,
            tokenizer=tokenizer,
            device=lambda role: device,
            models=SimpleNamespace(autocast=autocast),
        )
        self.backend.on_run_start(run)

    def write(
        self, rows: list[dict[str, Any]], source: StepSource
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """One teacher sample per row (unlabeled), with ``timing/teacher_generate``."""
        prompts, extras = split_rows(rows)
        start = time.perf_counter()
        batch = self.backend.generate(prompts, extras, 1, source.training.sampling, source.seeds)
        batch.rollout_logprobs = None  # the teacher's numbers, not the policy's
        return batch, {
            "timing/teacher_generate": time.perf_counter() - start,
            canonical.BATCH_PROMPTS: float(len(rows)),
        }
