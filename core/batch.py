"""The one data structure that flows through a training step: :class:`RolloutBatch`.

Shapes: ``B`` samples, ``P`` prompt tokens (left-padded), ``R`` response tokens (right-padded).
Every per-token tensor is ``[B, R]`` and aligned with ``response_ids``; ``response_mask`` is
1.0 on real response tokens (the EOS token included) and 0.0 on padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from alignzoo.types import LossContext


@dataclass
class RolloutBatch:
    """A batch of sampled (or dataset) responses and everything computed about them.

    Required:
        prompt_ids ``[B, P]`` long, left-padded with the pad token; prompt_mask ``[B, P]`` long.
        response_ids ``[B, R]`` long, right-padded; response_mask ``[B, R]`` float: the tokens
            trained on (every loss, KL, entropy and length metric counts these).
        group_ids ``[B]`` long: samples of one prompt share an id (GRPO groups, DPO pairs).
    Texts (lists of length B): prompts, responses, extras (dataset columns for the labeler).
    Filled by later stages (None until then):
        old_logprobs ``[B, R]``: log-probs under the policy that sampled (behaviour policy),
            computed by the trainer's own forward pass.
        rollout_logprobs ``[B, R]``: the log-probs the rollout backend recorded while sampling
            (its own numbers, which may differ from the trainer's: ``rollout/logprob_diff``).
        rollout_is_weights ``[B, R]``: truncated importance weights of the trainer's behaviour
            policy over the backend's (``training.rollout_correction``), applied by
            policy-gradient algorithms to their surrogate; None when the correction is off.
        ref_logprobs ``[B, R]``: log-probs under the frozen reference policy.
        teacher_logprobs ``[B, R]``: log-probs of the sampled tokens under the teacher
            (``model.teacher``), for distillation algorithms; None otherwise.
        values ``[B, R]``: critic values at rollout time (PPO).
        scores ``[B]``: the labeler's sequence rewards; score_valid ``[B]`` bool.
        labels ``[B]``: 1.0 chosen / desirable, 0.0 rejected / undesirable (preference data).
        token_rewards ``[B, R]``: per-token rewards (score at the last token, KL penalty).
        dense_rewards ``[B, R]`` float and dense_mask ``[B, R]`` float: a labeler's per-step
            scores (``Score.steps``, a process reward model's) placed on the response's
            tokens: each step's score on the last trained token of its span (steps ending on
            one token add up), and 1.0 in the mask there. A sample whose labeler gave no steps
            has an all-zero mask. None when no sample of the batch had steps: concatenated
            with a batch that has them, it counts as all zero (see :meth:`concat`). Filled by
            the labeling stage in training passes (:mod:`alignzoo.labeling.dense`); read by
            the algorithms that declare ``AlgorithmRequirements.dense_rewards``.
        reward_components ``[B, K]`` float32 and reward_names (K names): the separate rewards
            of a labeler that reports several (``Score.info["rewards"]``: a ``combine``'s parts),
            NaN where one does not apply to a sample (or the sample has none); None and ``()``
            when no sample reported any. Filled by the labeling stage; read by an algorithm that
            weighs the rewards itself (``AlgorithmRequirements.reward_components``). A
            concatenation holds every part's names (first seen first), NaN where a part had
            none of a name.
        advantages ``[B, R]``, returns ``[B, R]``: from ``compute_advantages``.
        weights ``[B]``: per-sample loss weights set by batch transforms (1.0 by default).
        entropy ``[B, R]``: per-token entropy of the behaviour snapshot (the policy before the
            step's update), filled by the engine for the canonical ``entropy`` metric.
        response_attention ``[B, R]`` long: the response tokens the model attends to, when
            they are more than the trained ones: a multi-turn episode's environment and
            template tokens are context (attended, 1) but not trained (response_mask 0).
            None means the same as ``response_mask > 0``.
        sampling ``[B, 3]`` float: the distribution each sample was drawn from, as
            (temperature, top_k, top_p) of the arm's ``SamplingParams`` (set by the engine for
            every sampled batch; None for dataset rows). The trainer's log-probs of a sampled
            token are taken under that distribution (:func:`alignzoo.ops.warp_logits`), the
            reference's under its tempered one.
        columns: named per-sample tensors ``[B, ...]`` that a data mode or an algorithm adds
            (for example the unpaired mode's mismatched-pair log-probs, KTO's reference point);
            sliced, moved and concatenated with the batch like every other tensor.
        label_info: the labeler's ``Score.info`` per sample.
        policy_version: the version of the policy that sampled the batch: the optimizer steps
            its weights had taken (set by the engine for every sampled batch; None for dataset
            rows). A concatenation holds the oldest version among its parts.
        token_versions ``[B, R]`` (long): the policy version that sampled each response token,
            -1 on padding (set by the engine with ``policy_version``; the tokens of one
            response may come from several versions when weights change during its sampling).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    extras: list[dict[str, Any]] = field(default_factory=list)
    old_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    score_valid: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    dense_rewards: torch.Tensor | None = None
    dense_mask: torch.Tensor | None = None
    reward_components: torch.Tensor | None = None
    reward_names: tuple[str, ...] = ()
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    response_attention: torch.Tensor | None = None
    sampling: torch.Tensor | None = None
    columns: dict[str, torch.Tensor] = field(default_factory=dict)
    label_info: list[dict[str, Any]] = field(default_factory=list)
    policy_version: int | None = None
    token_versions: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Number of samples B."""
        return int(self.response_ids.shape[0])

    def __len__(self) -> int:
        return self.size

    def select(self, index: torch.Tensor | list[int]) -> RolloutBatch:
        """The samples at ``index`` (a list or a long tensor), in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        positions = idx.tolist()
        updates: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                updates[f.name] = value.index_select(0, idx.to(value.device))
            elif isinstance(value, dict):
                updates[f.name] = {k: v.index_select(0, idx.to(v.device)) for k, v in value.items()}
            elif isinstance(value, list) and value:
                updates[f.name] = [value[i] for i in positions]
        return replace(self, **updates)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on ``device``."""
        updates: dict[str, Any] = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        updates["columns"] = {k: v.to(device) for k, v in self.columns.items()}
        return replace(self, **updates)

    def loss_context(self, micro_batches: int = 1) -> LossContext:
        """The :class:`~alignzoo.types.LossContext` of this batch taken as one optimizer step."""
        return LossContext(
            tokens=float(self.response_mask.sum()),
            sequences=self.size,
            groups=int(torch.unique(self.group_ids).numel()),
            micro_batches=micro_batches,
        )

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Stack batches along B (responses are right-padded and prompts left-padded to fit).

        A field set in only some of the batches is an error, except the dense rewards and
        their mask (a batch without them had no step scores, and counts as all zero) and the
        reward components (a batch without one of them has NaN there: it does not apply)."""
        if len(batches) == 1:
            return batches[0]
        out: dict[str, Any] = {}
        out["reward_components"], out["reward_names"] = _concat_rewards(batches)
        for f in fields(RolloutBatch):
            values = [getattr(b, f.name) for b in batches]
            if f.name in ("reward_components", "reward_names"):
                continue
            if f.name == "policy_version":  # replayed samples: the oldest policy among them
                out[f.name] = min((v for v in values if v is not None), default=None)
            elif all(v is None for v in values):
                out[f.name] = None
            elif f.name in _ZERO_WHEN_ABSENT:  # a part without step scores: all zero
                out[f.name] = _pad_cat(
                    [
                        v if v is not None else torch.zeros_like(b.response_mask, dtype=_DENSE)
                        for v, b in zip(values, batches, strict=True)
                    ],
                    left=False,
                )
            elif any(v is None for v in values):
                raise ValueError(f"cannot concatenate batches: {f.name} is set in only some")
            elif isinstance(values[0], torch.Tensor):
                left = f.name in ("prompt_ids", "prompt_mask")
                out[f.name] = _pad_cat(values, left=left)
            elif isinstance(values[0], dict):
                present = {k for k in _ZERO_COLUMNS if any(k in v for v in values)}
                values = [
                    {**{k: torch.zeros(b.size) for k in present}, **v}
                    for v, b in zip(values, batches, strict=True)
                ]
                keys = set(values[0])
                if any(set(v) != keys for v in values):
                    raise ValueError("cannot concatenate batches: their columns differ")
                out[f.name] = {k: _pad_cat([v[k] for v in values], left=False) for k in keys}
            else:
                out[f.name] = [item for v in values for item in v]
        return RolloutBatch(**out)


_ZERO_WHEN_ABSENT = ("dense_rewards", "dense_mask")
_DENSE = torch.float32
_ZERO_COLUMNS = ("truncated",)
"""Columns a batch recorded before the engine kept them lacks (a replayed group from an
older checkpoint): zero, which is what they say of it (no response truncated)."""


def _concat_rewards(batches: list[RolloutBatch]) -> tuple[torch.Tensor | None, tuple[str, ...]]:
    """The reward components of ``batches`` stacked along B under every part's names (in the
    order first seen), NaN where a part lacks a name or has none at all."""
    reported = [(b.reward_components, b.reward_names) for b in batches]
    names = tuple(dict.fromkeys(n for table, own in reported if table is not None for n in own))
    if not names:
        return None, ()
    rows, device = [], None
    for b, (table, own) in zip(batches, reported, strict=True):
        row = torch.full((b.size, len(names)), torch.nan, dtype=_DENSE)
        if table is not None:
            device = device or table.device
            for k, name in enumerate(own):
                row[:, names.index(name)] = table[:, k].to("cpu", _DENSE)
        rows.append(row)
    return torch.cat(rows).to(device), names


def _pad_cat(tensors: list[torch.Tensor], left: bool) -> torch.Tensor:
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        gap = width - t.shape[1]
        pad = (gap, 0) if left else (0, gap)
        padded.append(torch.nn.functional.pad(t, pad, value=0))
    return torch.cat(padded)


@dataclass
class PolicyOutputs:
    """What the engine computes with gradients for a micro-batch, passed to ``compute_loss``.

    logprobs ``[B, R]``: current policy log-probs of ``batch.response_ids``.
    entropy ``[B, R]``: per-token entropy of the current policy (when required).
    values ``[B, R]``: critic values (PPO).
    logits ``[B, R, V]``: the policy's logits that predict each response token, with gradients,
        before any temperature (when the algorithm asks for ``teacher_logits``).
    teacher_logits ``[B, R, V]``: the teacher's at the same positions, without gradients.
    log_sum_sq_probs ``[B, R]``: ``log Σ_v p_v²`` of the current policy's distribution at each
        response position (the one ``logprobs`` are taken from), without gradients (when the
        algorithm asks for it: WPO's weights).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
