"""What every data mode shares: the step's sources, the collected batch, sampling and labeling
a batch, and the :class:`DataMode` base class the modes of :mod:`alignzoo.engine.modes` extend.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.errors import RunError
from alignzoo.labeling import LabelReport, dense_metrics, label

if TYPE_CHECKING:
    from alignzoo.config.schema import TrainingConfig
    from alignzoo.engine.hooks import Hooks
    from alignzoo.engine.scoring import Scorer
    from alignzoo.labeling import LabelingStage
    from alignzoo.rollout.multiturn import Episodes
    from alignzoo.types import DataMode as DataKind

PROMPT_COLUMN = "prompt"
TRUNCATED = "truncated"
"""``batch.columns[TRUNCATED]`` ``[B]``: 1.0 for a sampled response the length budget cut
(recorded for every single-turn sampled batch; what GRPO's mask_truncated_completions reads)."""
OFFLINE_MAX_TOKENS = 512
"""Longest response (in tokens, EOS included) an offline row is cut to."""


@dataclass
class StepSource:
    """What a mode may use to build a step's batch: the hooks (backend, labeler), the
    tokenizer (offline rows), the arm's training settings, per row its sampling seed, the
    training step the batch is for (given to labelers; None outside a training step), the
    version of the policy the backend samples with, the arm's labeling stage (None: a plain
    one over the hooks) and its episode runner (an arm with an environment)."""

    hooks: Hooks
    tokenizer: Any
    training: TrainingConfig
    seeds: list[int] | None = None
    step: int | None = None
    policy_version: int | None = None
    labeling: LabelingStage | None = None
    episodes: Episodes | None = None


@dataclass
class Collected:
    """A step's batch as collected: the samples, what they count towards the budget, metrics.

    ``batch`` is everything sampled (or read); the mode's :meth:`DataMode.select` later picks
    what trains from it. ``samples`` counts towards a samples budget; ``tokens`` are the
    response tokens seen (for throughput).
    """

    batch: RolloutBatch
    samples: int
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    report: LabelReport | None = None  # the labeling pass of an online batch


def split_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Prompts, and the other columns of each row (what the labeler gets as ``extra``)."""
    prompts = [str(r[PROMPT_COLUMN]) for r in rows]
    extras = [{k: v for k, v in r.items() if k != PROMPT_COLUMN} for r in rows]
    return prompts, extras


def correct_flags(batch: RolloutBatch) -> list[bool] | None:
    """Per sample, the labeler's ``info["correct"]``; None unless every sample carries a bool."""
    flags = [info.get("correct") for info in batch.label_info]
    if len(flags) != batch.size or not all(isinstance(f, bool) for f in flags):
        return None
    return [bool(f) for f in flags]


_RESERVED = {"mean", "std", "valid_frac"}


def part_rewards(infos: list[dict[str, Any]]) -> dict[str, float]:
    """``reward/<part>``: the mean of each part of a combined reward (``info["rewards"]``, as
    the combine labeler writes it) over the samples it applies to (not None or NaN)."""
    sums: dict[str, list[float]] = {}
    for info in infos:
        for name, value in (info.get("rewards") or {}).items():
            if value is None or math.isnan(float(value)):
                continue
            sums.setdefault(str(name), []).append(float(value))
    return {
        f"reward/{'part_' + n if n in _RESERVED else n}": sum(v) / len(v)
        for n, v in sums.items()
        if v
    }


def sample(
    rows: list[dict[str, Any]], source: StepSource, n: int | None = None
) -> tuple[RolloutBatch, dict[str, float]]:
    """Generate ``n`` (default ``samples_per_prompt``) responses per row (not yet labeled),
    recording the policy version that sampled them; ``timing/generate`` and ``batch/prompts``
    in the metrics."""
    cfg = source.training
    prompts, extras = split_rows(rows)
    start = time.perf_counter()
    per_prompt = cfg.samples_per_prompt if n is None else n
    batch, m = source.hooks.rollout(
        prompts, extras, per_prompt, cfg.sampling, source.seeds, source.episodes
    )
    batch.policy_version = source.policy_version
    # A partial rollout recorded each token's version as it sampled it; otherwise every token
    # comes from the version the batch started with.
    if source.policy_version is not None and batch.token_versions is None:
        on = batch.response_mask.bool()
        batch.token_versions = torch.where(on, source.policy_version, -1).long()
    if source.episodes is None:  # an episode's own limits are its outcome (env/truncated)
        batch.columns[TRUNCATED] = truncated(batch, source.tokenizer, cfg.sampling.max_new_tokens)
    m["timing/generate"] = time.perf_counter() - start
    m[canonical.BATCH_PROMPTS] = float(len(rows))
    return batch, m


def truncated(batch: RolloutBatch, tokenizer: Any, max_new_tokens: int) -> torch.Tensor:
    """``[B]`` float, 1.0 where a sampled response was cut by the length budget: it has
    ``max_new_tokens`` tokens and its last is not the tokenizer's EOS (a shorter one stopped on
    a stop token of its own)."""
    lengths = batch.response_mask.sum(dim=1).long()
    last = batch.response_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    eos = getattr(tokenizer, "eos_token_id", None)
    ends = last == eos if eos is not None else torch.zeros_like(lengths, dtype=torch.bool)
    return ((lengths >= max_new_tokens) & ~ends).float()


def labeled(batch: RolloutBatch, report: LabelReport, m: dict[str, float]) -> Collected:
    """A generated batch once :func:`~alignzoo.labeling.orchestrator.label` has filled it: the samples
    without a value left out, the ``reward/*`` (``reward/dense_*`` too when the labeler gave
    step scores) and ``batch/*`` metrics added to ``m``."""
    m.update(report.metrics())
    generated = batch.size
    if len(report.keep) < batch.size:  # samples without a value never reach the loss
        batch = batch.select(report.keep)
    assert batch.scores is not None and batch.score_valid is not None
    given = labeler_units(batch)
    if given is not batch.scores and batch.size:  # what training saw, beside the labeler's
        m["reward/normalized_mean"] = float(batch.scores.mean())
    if distributed.active():
        m.update(_global_sample_metrics(batch, given))
    elif batch.size:
        m[canonical.REWARD_MEAN] = float(given.mean())
        m[canonical.REWARD_STD] = float(given.std(unbiased=False))
        m[canonical.REWARD_VALID_FRAC] = float(batch.score_valid.float().mean())
        m[canonical.RESPONSE_LENGTH] = float(batch.response_mask.sum(dim=1).mean())
    m[canonical.BATCH_RESPONSES] = float(batch.size)
    m.update(part_rewards(batch.label_info))
    m.update(dense_metrics(batch))  # reward/dense_*: when the labeler gave step scores
    # The budget counts what was generated, labeled or not.
    return Collected(
        batch, samples=generated, tokens=int(batch.response_mask.sum()), metrics=m, report=report
    )


def labeler_units(batch: RolloutBatch) -> Any:
    """The batch's scores in the labelers' own units: ``info["raw"]`` where the labeling stage
    (``labeling.normalize``) or the labeler rescaled the value, else the score. ``reward/mean``
    is computed from these for every arm, so a normalised arm's training reward stays the
    labeler's reward (the proxy of the over-optimisation picture); ``batch.scores`` itself
    when nothing was rescaled."""
    import torch

    assert batch.scores is not None
    info = batch.label_info or []
    if not any(isinstance(row.get("raw"), (int, float)) for row in info):
        return batch.scores
    values = [
        float(row["raw"]) if isinstance(row.get("raw"), (int, float)) else float(score)
        for row, score in zip(info, batch.scores.tolist(), strict=True)
    ]
    return torch.tensor(values, dtype=batch.scores.dtype)


def _global_sample_metrics(batch: RolloutBatch, given: Any) -> dict[str, float]:
    """The reward and length metrics over the samples of every data-parallel rank (``given``:
    the scores in the labelers' units, :func:`labeler_units`)."""
    import torch

    assert batch.scores is not None and batch.score_valid is not None
    scores = given.double()
    local = torch.stack(
        [
            torch.tensor(float(batch.size), dtype=torch.float64),
            scores.sum(),
            (scores**2).sum(),
            batch.score_valid.double().sum(),
            batch.response_mask.double().sum(),
        ]
    )
    count, total, squares, valid, tokens = distributed.all_sum(local).tolist()
    if count == 0:
        return {}
    mean = total / count
    return {
        canonical.REWARD_MEAN: mean,
        canonical.REWARD_STD: max(squares / count - mean * mean, 0.0) ** 0.5,
        canonical.REWARD_VALID_FRAC: valid / count,
        canonical.RESPONSE_LENGTH: tokens / count,
    }


def sample_and_label(rows: list[dict[str, Any]], source: StepSource) -> Collected:
    """The online start of a step: ``samples_per_prompt`` responses per row, scored."""
    batch, m = sample(rows, source)
    start = time.perf_counter()
    report = label(
        source.hooks, batch, source.labeling, step=source.step, tokenizer=source.tokenizer
    )
    m["timing/label"] = time.perf_counter() - start
    return labeled(batch, report, m)


def read_rows(batch: RolloutBatch, rows: int) -> Collected:
    """The offline start of a step: a batch tokenised from ``rows`` dataset rows."""
    m = {
        canonical.BATCH_PROMPTS: float(rows),
        canonical.BATCH_RESPONSES: float(batch.size),
        canonical.RESPONSE_LENGTH: float(batch.response_mask.sum(dim=1).mean()),
    }
    return Collected(batch, samples=batch.size, tokens=int(batch.response_mask.sum()), metrics=m)


class DataMode:
    """Base of the data modes; subclasses set the class attributes and :meth:`collect`."""

    name: ClassVar[str] = ""
    kind: ClassVar[DataKind] = "online"
    online: ClassVar[bool] = True
    columns: ClassVar[tuple[str, ...]] = (PROMPT_COLUMN,)
    """Dataset columns of the train split the mode reads (TRL's standard names)."""
    unit: ClassVar[int] = 1
    """Consecutive samples of a training batch that minibatching never separates."""
    token_columns: ClassVar[dict[str, bool]] = {}
    """Text columns an offline mode tokenises once before training (column -> encode with the
    tokenizer's special tokens); see :func:`~alignzoo.engine.tokenize.pretokenize`."""
    on_policy_fraction: float = 0.0
    """The algorithm's ``on_policy_fraction`` (a mode that reads completions samples this
    share of its steps from the policy instead)."""

    def tokenize(self, dataset: Any, tokenizer: Any) -> Any:
        """The train dataset with the token ids of :attr:`token_columns` beside their texts."""
        from alignzoo.engine.tokenize import pretokenize

        return pretokenize(dataset, tokenizer, self.token_columns)

    def collect(self, rows: list[dict[str, Any]], source: StepSource) -> Collected:
        """The step's samples from ``rows`` (the sampler's next ``prompts_per_step`` rows)."""
        raise NotImplementedError

    def select(self, batch: RolloutBatch, metrics: dict[str, float]) -> RolloutBatch | None:
        """The training batch picked from the collected one (after its no-grad forward passes);
        None when the step has nothing to learn from. May add ``batch/*`` metrics."""
        return batch

    def prepare(self, batch: RolloutBatch, scorer: Scorer) -> RolloutBatch:
        """Anything more the mode computes without gradients, after the batch transforms."""
        return batch

    def check(self, batch: RolloutBatch, step: int) -> None:
        """Raise a RunError when a batch transform broke the mode's layout."""
        if batch.size % self.unit:
            raise RunError(
                f"step {step}: the {self.name} batch has {batch.size} samples, not a multiple "
                f"of {self.unit}; a batch transform must keep or drop whole units"
            )

    def units(self, size: int) -> list[list[int]]:
        """The indivisible index groups of a training batch of ``size`` samples."""
        return [list(range(i, min(size, i + self.unit))) for i in range(0, size, self.unit)]

    def step_sizes(self, cfg: TrainingConfig) -> tuple[int, int]:
        """(samples a step counts towards the budget, samples it trains on at most)."""
        sampled = cfg.prompts_per_step * cfg.samples_per_prompt
        return sampled, sampled
