"""One training step, stage by stage: prompts → collect (generate + label, or read) → no-grad
scoring → select (pairs, desirability) → batch transforms → mode extras → advantages →
update → weight sync. Returns the step's metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.modes import StepSource
from alignzoo.engine.prepare import FusedSnapshot, Scorer, apply_rollout_correction, prepare
from alignzoo.engine.update import update

if TYPE_CHECKING:
    from alignzoo.engine.assemble import Run

SAMPLES_PER_STEP = 4
SLOWEST_STREAM = "labels_slowest"
"""The run folder's ``labels_slowest.jsonl``: each step's slowest labeler calls."""


@dataclass
class StepResult:
    """What one step produced: metrics, a few sample rows, samples and response tokens seen."""

    metrics: dict[str, float] = field(default_factory=dict)
    sample_rows: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0


def sample_rows(batch: RolloutBatch, step: int) -> list[dict[str, Any]]:
    """The first few prompt / response / score (/ label) rows, for samples.jsonl."""
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


def train_step(run: Run, step: int) -> StepResult:
    """Run step ``step`` (1-based) end to end."""
    start = time.perf_counter()
    mode, hooks, cfg = run.mode, run.hooks, run.context.arm_spec.training
    scorer = Scorer(run.models, cfg.micro_batch_size)
    if run.ahead is not None:  # labeled in the background, behaviour snapshot taken already
        collected = run.ahead.collect(scorer)
    else:
        rows, seeds = run.sampler.next_seeded(cfg.prompts_per_step)
        rows, seeds = distributed.shard(rows), distributed.shard(seeds)  # this rank's share
        collected = mode.collect(rows, StepSource(hooks, run.models.tokenizer, cfg, seeds))
    result = StepResult(
        metrics=collected.metrics,
        sample_rows=sample_rows(collected.batch, step),
        samples=collected.samples,
        tokens=collected.tokens,
    )
    m = result.metrics
    if collected.report is not None:
        for row in collected.report.slowest:  # where labeling time went, call by call
            run.context.record(SLOWEST_STREAM, row)
    t = time.perf_counter()
    fused = run.fused_behaviour
    if run.ahead is None:
        m.update(prepare(scorer, collected.batch, generated=mode.online, behaviour=not fused))
    batch = mode.select(collected.batch, m)
    if batch is not None:  # online pairs with no untied group have nothing to learn from
        batch = hooks.transform_batch(batch, run.context)
    # Every rank must train on as many samples (their collectives would mismatch and hang).
    distributed.all_equal(batch.size if batch is not None else 0, f"step {step}'s batch size")
    if batch is not None and batch.size > 0:  # a transform may filter every sample out
        batch = mode.prepare(batch, scorer)
        batch = hooks.compute_advantages(batch)
        if not fused:  # fused: each micro-batch's weights are set with its old_logprobs
            apply_rollout_correction(batch, cfg.rollout_correction, hooks)
        snapshot = FusedSnapshot(batch, generated=mode.online) if fused else None
        m.update(update(run.learner, hooks, run.requirements, mode, batch, step, snapshot))
        run.sync_weights()
        m["timing/update"] = time.perf_counter() - t
    m[canonical.STEP_SECONDS] = time.perf_counter() - start
    if distributed.active():  # the whole global batch's numbers, on every rank
        counts = torch.tensor([result.samples, result.tokens], dtype=torch.float64)
        samples, tokens = distributed.all_sum(counts).tolist()
        result.samples, result.tokens = int(samples), int(tokens)
        result.metrics = m = distributed.reduce_metrics(m)
    m["throughput/tokens_per_s"] = result.tokens / max(m[canonical.STEP_SECONDS], 1e-9)
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
