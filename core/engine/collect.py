"""The collection stage: a step's batch, generated and labeled (or read from offline rows).

:class:`Collector` draws the step's prompts (this rank's share of them) and lets the data mode
sample and label them, or read its rows. :class:`LabelAhead` is the collector of an arm with
``labeling.overlap: true``, described below; :func:`build_collector` picks one. Each batch a
collector produces goes to the run's behaviour policy
(:meth:`~alignzoo.engine.behaviour.Behaviour.at_collection`) as it is produced, and records the
version of the policy that sampled it (``RolloutBatch.policy_version``).

Labeling that overlaps generation (``labeling.overlap: true`` on an online arm).

Without overlap a step is generate → label → train, and the trainer waits for the labeler.
With it, each step first generates the *next* step's samples and hands them to a labeling
thread, then trains on the samples generated one step earlier, whose labeling ran meanwhile
(during the previous step's update and this step's generation)::

    step t:  generate G(t+1) with θ(t), its behaviour snapshot ──► label G(t+1) in the background
             wait for the labels of G(t) ──► train on G(t) ──► θ(t+1)

**Staleness: one step.** G(t) was sampled by θ(t-1), one update before the weights that train
on it. Its behaviour snapshot (``old_logprobs``, entropy, reference log-probs and critic values:
the arm's behaviour policy is :class:`~alignzoo.engine.behaviour.AtGeneration`) is taken
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

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.engine.modes import Collected, DataMode, StepSource, labeled, sample
from alignzoo.kernels import trace as decode_trace
from alignzoo.labeling import LabelReport, label

if TYPE_CHECKING:
    from alignzoo.config.schema import TrainingConfig
    from alignzoo.engine.behaviour import Behaviour
    from alignzoo.engine.hooks import Hooks
    from alignzoo.engine.learner import Learner
    from alignzoo.engine.sampler import PromptSampler
    from alignzoo.labeling import LabelingStage
    from alignzoo.rollout.multiturn import Episodes

_UNLABELED = (
    "scores",
    "score_valid",
    "label_info",
    "dense_rewards",
    "dense_mask",
    "reward_components",
    "reward_names",
)
"""Fields the labeling pass fills: a checkpoint keeps the batch without them."""


@dataclass
class _Ahead:
    """A generated batch whose labeling runs in the background."""

    batch: RolloutBatch
    metrics: dict[str, float]  # generation and behaviour-snapshot metrics
    step: int | None = None  # the training step the batch is for
    future: Future[tuple[LabelReport, float]] | None = None


@dataclass
class Collector:
    """Each step's prompts, sampled and labeled (or read) by the data mode when the step asks."""

    hooks: Hooks
    tokenizer: Any
    cfg: TrainingConfig
    sampler: PromptSampler
    mode: DataMode
    behaviour: Behaviour
    learner: Learner  # whose weights the backend samples with (their version)
    labeling: LabelingStage
    episodes: Episodes | None  # an arm with an environment samples episodes
    # The update follows the sampling with the same weights: the decode loop may record its
    # activations for the update's backward pass (alignzoo.kernels.trace, traces_decode).
    traces: bool = False

    def source(self, seeds: list[int], step: int | None) -> StepSource:
        return StepSource(
            self.hooks,
            self.tokenizer,
            self.cfg,
            seeds,
            step,
            self.learner.version,
            self.labeling,
            self.episodes,
        )

    def collect(self, step: int | None = None) -> Collected:
        """Step ``step``'s batch, labeled."""
        rows, seeds = self.sampler.next_seeded(self.cfg.prompts_per_step)
        rows, seeds = distributed.shard(rows), distributed.shard(seeds)  # this rank's share
        with decode_trace.recording(self.traces):
            collected = self.mode.collect(rows, self.source(seeds, step))
        collected.metrics.update(self.behaviour.at_collection(collected.batch))
        return collected

    def close(self) -> None:
        """Nothing runs in the background."""


class LabelAhead(Collector):
    """The look-ahead batch of an overlapping arm and the thread that labels it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alignzoo-label")
        self.pending: _Ahead | None = None

    def _timed_label(self, batch: RolloutBatch, step: int | None) -> tuple[LabelReport, float]:
        start = time.perf_counter()
        report = label(self.hooks, batch, self.labeling, step=step, tokenizer=self.tokenizer)
        return report, time.perf_counter() - start

    def _start(self, ahead: _Ahead) -> _Ahead:
        ahead.future = self.executor.submit(self._timed_label, ahead.batch, ahead.step)
        return ahead

    def _generate(self, step: int | None) -> _Ahead:
        """The samples of step ``step`` with the current weights, given to the behaviour policy
        now (on this thread: the models are never used from the labeling thread)."""
        rows, seeds = self.sampler.next_seeded(self.cfg.prompts_per_step)
        batch, m = sample(rows, self.source(seeds, step))
        m.update(self.behaviour.at_collection(batch))
        return self._start(_Ahead(batch, m, step=step))

    def collect(self, step: int | None = None) -> Collected:
        """Step ``step``'s batch: generated one step ago (or now, on the first step) and
        labeled; the next step's batch is generated before returning."""
        if self.pending is None:
            self.pending = self._generate(step)
        elif self.pending.future is None:  # restored from a checkpoint: label it again
            self._start(self.pending)
        current = self.pending
        self.pending = self._generate(None if step is None else step + 1)
        assert current.future is not None
        start = time.perf_counter()
        report, seconds = current.future.result()  # a labeling failure surfaces here
        m = dict(current.metrics)
        m["timing/label_wait"] = time.perf_counter() - start
        m["timing/label"] = seconds
        m[canonical.ROLLOUT_STALENESS] = 1.0
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
        return {
            "batch": plain,
            "metrics": dict(self.pending.metrics),
            "device": device,
            "step": self.pending.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            self.pending = None
            return
        batch = RolloutBatch(**state["batch"]).to(state["device"])
        self.pending = _Ahead(batch, dict(state["metrics"]), step=state.get("step"))


def build_collector(
    hooks: Hooks,
    tokenizer: Any,
    cfg: TrainingConfig,
    sampler: PromptSampler,
    mode: DataMode,
    behaviour: Behaviour,
    learner: Learner,
    labeling: LabelingStage,
    episodes: Episodes | None,
    overlap: bool,
) -> Collector:
    """The arm's collector: a :class:`LabelAhead` with ``labeling.overlap``, else a plain one."""
    cls = LabelAhead if overlap else Collector
    return cls(hooks, tokenizer, cfg, sampler, mode, behaviour, learner, labeling, episodes)
