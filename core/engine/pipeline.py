"""Labeling that overlaps generation: ``labeling.overlap: true`` on an online arm.

Without overlap a step is generate → label → train, and the trainer waits for the labeler.
With it, each step first generates the *next* step's samples and hands them to a labeling
thread, then trains on the samples generated one step earlier, whose labeling ran meanwhile
(during the previous step's update and this step's generation)::

    step t:  generate G(t+1) with θ(t), its behaviour snapshot ──► label G(t+1) in the background
             wait for the labels of G(t) ──► train on G(t) ──► θ(t+1)

**Staleness: one step.** G(t) was sampled by θ(t-1), one update before the weights that train
on it. Its ``old_logprobs`` (and its entropy, reference log-probs and critic values) are taken
when it is generated, at θ(t-1), so the importance ratio of PPO/GRPO-style losses is that of
one-step-off-policy data, which their clip bounds; an algorithm without a ratio (REINFORCE-style
losses, DPO on online pairs) trains on one-step-old samples as if they were fresh.

The first step generates two batches with the starting weights; the look-ahead batch of the
last step is generated and labeled but never trained on. Prompts are drawn in the same order as
without overlap, so step t trains on the same prompts either way. A checkpoint keeps the
look-ahead batch (labeled again after a resume, from the label store when the labels reached
it), so a resumed run continues exactly as an uninterrupted one.

Metrics: ``timing/label`` (the background pass), ``timing/label_wait`` (how long the step
waited for it: near zero when labeling is hidden behind generation), ``rollout/staleness``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from alignzoo.batch import RolloutBatch
from alignzoo.engine.labeling import LabelReport, label
from alignzoo.engine.modes import Collected, StepSource, labeled, sample
from alignzoo.engine.prepare import Scorer, prepare

if TYPE_CHECKING:
    from alignzoo.engine.assemble import Run

_UNLABELED = ("scores", "score_valid", "label_info")
"""Fields the labeling pass fills: a checkpoint keeps the batch without them."""


@dataclass
class _Ahead:
    """A generated batch whose labeling runs in the background."""

    batch: RolloutBatch
    metrics: dict[str, float]  # generation and behaviour-snapshot metrics
    future: Future[tuple[LabelReport, float]] | None = None


class LabelAhead:
    """The look-ahead batch of an overlapping arm and the thread that labels it."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alignzoo-label")
        self.pending: _Ahead | None = None

    def _timed_label(self, batch: RolloutBatch) -> tuple[LabelReport, float]:
        start = time.perf_counter()
        report = label(self.run.hooks, batch)
        return report, time.perf_counter() - start

    def _start(self, ahead: _Ahead) -> _Ahead:
        ahead.future = self.executor.submit(self._timed_label, ahead.batch)
        return ahead

    def _generate(self, scorer: Scorer) -> _Ahead:
        """The next prompts' samples with the current weights, their behaviour snapshot taken
        now (on this thread: the models are never used from the labeling thread)."""
        run = self.run
        cfg = run.arm.training
        rows, seeds = run.sampler.next_seeded(cfg.prompts_per_step)
        batch, m = sample(rows, StepSource(run.hooks, run.models.tokenizer, cfg, seeds))
        m.update(prepare(scorer, batch, generated=True))
        return self._start(_Ahead(batch, m))

    def collect(self, scorer: Scorer) -> Collected:
        """This step's batch: generated one step ago (or now, on the first step), labeled and
        with its behaviour snapshot; the next step's batch is generated before returning."""
        if self.pending is None:
            self.pending = self._generate(scorer)
        elif self.pending.future is None:  # restored from a checkpoint: label it again
            self._start(self.pending)
        current = self.pending
        self.pending = self._generate(scorer)
        assert current.future is not None
        start = time.perf_counter()
        report, seconds = current.future.result()  # a labeling failure surfaces here
        m = dict(current.metrics)
        m["timing/label_wait"] = time.perf_counter() - start
        m["timing/label"] = seconds
        m["rollout/staleness"] = 1.0
        return labeled(current.batch, report, m)

    def close(self) -> None:
        """Let a pass in flight finish (its labels reach the store) and stop the thread."""
        self.executor.shutdown(wait=True, cancel_futures=True)

    def state_dict(self) -> dict[str, Any]:
        """The look-ahead batch without its labels. A pass in flight is not waited for: it
        only sets the label fields, which are left out."""
        if self.pending is None:
            return {}
        device = str(self.pending.batch.response_mask.device)
        batch = self.pending.batch.to("cpu")
        plain = {f.name: getattr(batch, f.name) for f in fields(batch) if f.name not in _UNLABELED}
        return {"batch": plain, "metrics": dict(self.pending.metrics), "device": device}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            self.pending = None
            return
        batch = RolloutBatch(**state["batch"]).to(state["device"])
        self.pending = _Ahead(batch, dict(state["metrics"]))
