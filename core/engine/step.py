"""One training step, stage by stage: prompts → generate → label → (pairs) → scoring →
batch transforms → advantages → update → weight sync. Returns the step's metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.engine.labeling import label
from alignzoo.engine.prepare import prepare, prepare_mismatched
from alignzoo.engine.rollout import (
    generate,
    label_desirable,
    pair_by_score,
    preference_batch,
    split_rows,
    task_correct,
    unpaired_batch,
)
from alignzoo.engine.update import update
from alignzoo.ops import masked_mean
from alignzoo.registry import chain_transform_batch

SAMPLES_PER_STEP = 4
OFFLINE_MAX_TOKENS = 512


@dataclass
class StepResult:
    """What one step produced: metrics, a few sample rows, samples and response tokens seen."""

    metrics: dict[str, float] = field(default_factory=dict)
    sample_rows: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0


def _reward_stats(batch: RolloutBatch) -> dict[str, float]:
    assert batch.scores is not None and batch.score_valid is not None
    return {
        "reward/mean": float(batch.scores.mean()),
        "reward/std": float(batch.scores.std(unbiased=False)),
        "reward/valid_frac": float(batch.score_valid.float().mean()),
    }


def _sample_rows(batch: RolloutBatch, step: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(min(SAMPLES_PER_STEP, batch.size)):
        row: dict[str, Any] = {
            "step": step,
            "prompt": batch.prompts[i],
            "response": batch.responses[i],
        }
        if batch.scores is not None:
            row["score"] = float(batch.scores[i])
        if batch.labels is not None:
            row["label"] = float(batch.labels[i])
        rows.append(row)
    return rows


def collect(engine: Any, step: int, result: StepResult) -> RolloutBatch | None:
    """The step's training batch: sampled and labeled online, or read from the dataset."""
    cfg = engine.arm.training
    rows = engine.sampler.next(cfg.prompts_per_step)
    m = result.metrics
    if not engine.online:
        make = preference_batch if engine.requirements.data == "preference" else unpaired_batch
        batch = make(engine.run.tokenizer, rows, OFFLINE_MAX_TOKENS)
        result.samples = batch.size
        result.tokens = int(batch.response_mask.sum())  # response tokens trained on
        result.sample_rows = _sample_rows(batch, step)
        m["batch/prompts"], m["batch/responses"] = float(len(rows)), float(batch.size)
        m["response_length/mean"] = float(batch.response_mask.sum(dim=1).mean())
        return batch
    prompts, extras = split_rows(rows)
    t = time.perf_counter()
    batch = generate(engine.pm, prompts, extras, cfg.samples_per_prompt, cfg.sampling)
    m["timing/generate"] = time.perf_counter() - t
    t = time.perf_counter()
    label(engine.pm, batch)
    m["timing/label"] = time.perf_counter() - t
    m.update(_reward_stats(batch))
    m["batch/prompts"], m["batch/responses"] = float(len(prompts)), float(batch.size)
    m["response_length/mean"] = float(batch.response_mask.sum(dim=1).mean())
    result.samples = batch.size
    result.tokens = int(batch.response_mask.sum())
    result.sample_rows = _sample_rows(batch, step)
    if engine.requirements.data == "preference":
        pairs = pair_by_score(batch)
        m["batch/pairs"] = 0.0 if pairs is None else float(pairs.size // 2)
        return pairs
    if engine.requirements.data == "unpaired":
        batch = label_desirable(batch, task_correct(batch))
        assert batch.labels is not None
        m["batch/desirable_frac"] = float(batch.labels.mean())
    return batch


def train_step(engine: Any, step: int) -> StepResult:
    """Run step ``step`` (1-based) end to end."""
    start = time.perf_counter()
    result = StepResult()
    batch = collect(engine, step, result)
    m = result.metrics
    t = time.perf_counter()
    if batch is not None:  # online DPO with no untied group has nothing to learn from
        batch = prepare(engine, batch, generated=engine.online)
        batch = chain_transform_batch(engine.pm, batch, engine.run)
    if batch is not None and batch.size > 0:  # a transform may filter every sample out
        batch = prepare_mismatched(engine, batch)
        batch = engine.pm.hook.compute_advantages(batch=batch) or batch
        m.update(update(engine.learner, batch, step))
        engine.pm.hook.sync_weights(model=engine.run.actor)
        m["timing/update"] = time.perf_counter() - t
        if "kl" not in m and batch.ref_logprobs is not None and batch.old_logprobs is not None:
            diff = batch.old_logprobs - batch.ref_logprobs
            m["kl"] = float(masked_mean(diff, batch.response_mask))
    m["timing/step"] = time.perf_counter() - start
    m["throughput/tokens_per_s"] = result.tokens / max(m["timing/step"], 1e-9)
    return result


def peak_memory_mb(device: str) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(torch.device(device)) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:  # not on POSIX
        return 0.0
