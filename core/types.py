"""Light data types that cross plugin boundaries (no torch import here).

The tensor-carrying batch lives in :mod:`alignzoo.batch`; these are the small records around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The labeler's records live with the rest of labeling; they are part of this contract too.
from alignzoo.labeling.interface import LabelRequest as LabelRequest
from alignzoo.labeling.interface import Outcome as Outcome
from alignzoo.labeling.interface import Score as Score

DataMode = Literal["online", "preference", "unpaired"]
LossAggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
ROLES = ("actor", "ref", "critic", "reward", "rollout", "labeler")


@dataclass(frozen=True)
class AlgorithmRequirements:
    """What an algorithm needs the engine to provide.

    Attributes:
        reference: load a frozen reference policy and fill ``batch.ref_logprobs``.
        critic: build a value head and fill ``batch.values`` / ``outputs.values``.
        data: the kind of data the algorithm learns from, which picks the run's data mode
            (:mod:`alignzoo.engine.modes`): ``"online"`` (sampled prompts, scored by the
            labeler), ``"preference"`` (pairs: chosen/rejected) or ``"unpaired"`` (single
            completions labelled desirable/undesirable). Preference and unpaired algorithms
            read a dataset offline, or run online when the experiment's data section (or the
            arm) says ``online: true``: pairs, or good/bad samples, drawn and labelled in the loop.
        entropy: compute the current policy's per-token entropy with gradients in
            ``outputs.entropy`` (for an entropy term in the loss). The reported ``entropy``
            metric is computed by the engine for every arm either way.
        old_logprobs_in_advantages: ``compute_advantages`` reads ``batch.old_logprobs`` (a KL
            penalty in the reward, as PPO's). Otherwise, when a batch is trained on once in
            one optimizer step, the engine takes the behaviour log-probs from the update's own
            forward pass instead of a separate one, and ``old_logprobs`` is first set when
            ``compute_loss`` is called.
        weights: ``compute_loss`` multiplies each sample's loss (a pair's, by its samples')
            by ``batch.weights`` when they are set, so a modifier that sets sample weights (such
            as ``reweight``) may wrap it; ``alignzoo validate`` refuses that modifier around an
            algorithm that does not declare this, and the contract's ``weights_honoured`` check
            holds it to it.
        rollout_correction: ``compute_loss`` multiplies its policy-gradient surrogate by
            ``batch.rollout_is_weights`` when they are set (truncated importance sampling
            between the rollout backend's and the trainer's probabilities), so the arm may turn
            on ``training.rollout_correction``.
    """

    reference: bool = False
    critic: bool = False
    data: DataMode = "online"
    entropy: bool = True
    old_logprobs_in_advantages: bool = False
    rollout_correction: bool = False
    weights: bool = False


@dataclass(frozen=True)
class LossContext:
    """Counts over the whole optimizer step, handed to ``compute_loss`` with every micro-batch.

    An optimizer step accumulates gradients over micro-batches (and, under data parallelism,
    over ranks). A loss normalised by the micro-batch's own counts would make the update depend
    on ``micro_batch_size``: with one sample of 1 token (loss 1) and one of 3 tokens (loss 0), a
    token mean is 1/4 over the step but 1/2 when each sample is its own micro-batch. So
    ``compute_loss`` returns the micro-batch's *share* of the step's loss, normalised by these
    step-wide counts, and the engine sums the shares (backward per micro-batch): the result is
    the loss of the whole step, whatever the micro-batching.

    Attributes:
        tokens: valid response tokens (the sum of ``response_mask``) in the optimizer step.
        sequences: samples in the optimizer step.
        groups: distinct ``group_ids`` in the optimizer step (pairs, for preference data).
        micro_batches: how many micro-batches the step is split into (for information).
    """

    tokens: float
    sequences: int
    groups: int
    micro_batches: int = 1


class SamplingParams(BaseModel):
    """How a rollout backend samples. ``temperature == 0`` means greedy."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 samples greedily.")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling: keep the smallest set of tokens with this much probability.",
    )
    top_k: int = Field(0, ge=0, description="0 disables top-k filtering")
    max_new_tokens: int = Field(16, ge=1, description="Longest response in tokens (EOS included).")


class Placement(BaseModel):
    """Where one role runs: a device, and on GPUs a share of its memory and a tensor-parallel size.

    ``device`` is the first (or only) device. ``tensor_parallel_size`` N > 1 shards the role over
    N consecutive GPUs starting there (``cuda:2`` with N 2 means cuda:2 and cuda:3), for a
    backend that shards (vLLM). ``gpu_share`` is the fraction of each of those GPUs' memory the
    role may use, for a role that shares its GPU with another (a colocated vLLM engine's
    ``gpu_memory_utilization``); None leaves it to the component. A device mapper returns a
    Placement, or a plain device string, per role; :func:`alignzoo.devices.check_placement`
    validates one against the devices that exist.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(description="The role's (first) device: 'cpu', 'cuda:0', 'mps'.")
    gpu_share: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Fraction of the GPU's memory this role may use (GPUs only); null: the "
        "component decides.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Consecutive GPUs the role is sharded over (GPUs only)."
    )

    def devices(self) -> list[str]:
        """Every device the role occupies: ``device`` and the next GPUs of its tensor-parallel group."""
        if self.tensor_parallel_size == 1:
            return [self.device]
        kind, _, index = self.device.partition(":")
        first = int(index or 0)
        return [f"{kind}:{first + i}" for i in range(self.tensor_parallel_size)]


@dataclass
class LossOutput:
    """What ``compute_loss`` returns: a scalar loss tensor to minimise and float metrics."""

    loss: Any  # torch.Tensor, scalar, requires grad
    metrics: dict[str, float] = field(default_factory=dict)


class AggregationParams(BaseModel):
    """Params shared by policy-gradient algorithms: how per-token losses become one number.

    Algorithms subclass it for their Params and redeclare ``loss_aggregation`` with their
    paper's default. See :func:`alignzoo.ops.aggregate_loss` for the modes.
    """

    model_config = ConfigDict(extra="forbid")

    loss_aggregation: LossAggregation = Field(
        "token-mean", description="how per-token losses are reduced (see ops.aggregate_loss)"
    )
    norm_constant: float | None = Field(
        None,
        gt=0.0,
        description="Dr. GRPO's constant divisor for seq-mean-token-sum-norm (set it to the "
        "generation budget, max_new_tokens); required by that mode, unused by the others",
    )

    @model_validator(mode="after")
    def _norm_mode_needs_constant(self) -> AggregationParams:
        # A divisor that silently followed the padded width would change from batch to batch.
        if self.loss_aggregation == "seq-mean-token-sum-norm" and self.norm_constant is None:
            raise ValueError(
                "loss_aggregation 'seq-mean-token-sum-norm' needs norm_constant (a fixed "
                "divisor such as the generation budget max_new_tokens)"
            )
        return self
