"""One training step, stage by stage, each in its module and entered once:

1. collect (:mod:`~alignzoo.engine.collect`): the step's prompts generated and labeled, or
   offline rows read; with ``labeling.overlap`` the batch labeled in the background;
2. prepare (:mod:`~alignzoo.engine.prepare`): the behaviour policy's no-grad passes
   (:mod:`~alignzoo.engine.behaviour`: behaviour snapshot, reference, critic), the mode's
   selection (pairs, desirability), batch transforms, the mode's extras;
3. advantages: the algorithm's ``compute_advantages``;
4. update (:mod:`~alignzoo.engine.update`): the rollout correction, then epochs x
   minibatches x micro-batches of ``compute_loss``, one policy version per optimizer step;
5. sync: the new weights to the rollout backend.

The run's behaviour policy (:class:`~alignzoo.engine.behaviour.Behaviour`, chosen at assembly)
fills each batch's behaviour snapshot once, in stage 1, 2 or 4. Timings: ``timing/prepare``
(stages 2 and 3), ``timing/update`` (stage 4), ``timing/sync`` (stage 5), ``timing/step`` (all),
beside those of collection (``timing/generate``, ``timing/label``).

Returns the step's metrics (over every rank's batch under data parallelism)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.prepare import prepare_step
from alignzoo.engine.update import update

if TYPE_CHECKING:
    from alignzoo.engine.assemble import Run

SAMPLES_PER_STEP = 4
SLOWEST_STREAM = "labels_slowest"
"""The run folder's ``labels_slowest.jsonl``: each step's slowest labeler calls."""


@dataclass
class StepReport:
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
        extra = batch.extras[i] if i < len(batch.extras) else {}
        if isinstance(extra.get("messages"), list):  # an episode: its transcript, with roles
            row["messages"] = extra["messages"]
            row["episode"] = extra.get("episode")
        rows.append(row)
    return rows


def train_step(run: Run, step: int) -> StepReport:
    """Run step ``step`` (1-based) end to end."""
    start = time.perf_counter()
    collected = run.collector.collect(step)  # 1. generate → label (or read)
    report = StepReport(
        metrics=collected.metrics,
        sample_rows=sample_rows(collected.batch, step),
        samples=collected.samples,
        tokens=collected.tokens,
    )
    m = report.metrics
    if collected.report is not None:
        for row in collected.report.slowest:  # where labeling time went, call by call
            run.context.record(SLOWEST_STREAM, row)
    t = time.perf_counter()
    batch = prepare_step(  # 2. behaviour → select → transforms → mode extras
        collected, run.behaviour, run.mode, run.hooks, run.context, run.scorer, step
    )
    if batch is not None:
        batch = run.hooks.compute_advantages(batch)  # 3. advantages
    m["timing/prepare"] = time.perf_counter() - t
    if batch is not None:
        t = time.perf_counter()
        m.update(  # 4. update
            update(run.learner, run.hooks, run.requirements, run.mode, batch, step, run.behaviour)
        )
        m["timing/update"] = time.perf_counter() - t
        t = time.perf_counter()
        run.sync_weights()  # 5. the new weights to the backend
        m["timing/sync"] = time.perf_counter() - t
    m[canonical.STEP_SECONDS] = time.perf_counter() - start
    return over_every_rank(report)


def over_every_rank(report: StepReport) -> StepReport:
    """Under data parallelism, the whole global batch's counts and metrics on every rank;
    ``throughput/tokens_per_s`` from them."""
    m = report.metrics
    if distributed.active():
        counts = torch.tensor([report.samples, report.tokens], dtype=torch.float64)
        samples, tokens = distributed.all_sum(counts).tolist()
        report.samples, report.tokens = int(samples), int(tokens)
        report.metrics = m = distributed.reduce_metrics(m)
    m["throughput/tokens_per_s"] = report.tokens / max(m[canonical.STEP_SECONDS], 1e-9)
    return report


def peak_memory_mb(device: str) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(torch.device(device)) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:  # not on POSIX
        return 0.0
