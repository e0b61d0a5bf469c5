"""Light data types that cross plugin boundaries (no torch import here).

The tensor-carrying batch lives in :mod:`alignzoo.batch`; these are the small records around it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch
    from rich.console import Console


DataMode = Literal["online", "preference", "unpaired", "demonstrations"]
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
            ``"demonstrations"`` (prompt/completion rows the policy imitates, SFT) is read
            offline only.
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
        teacher: load the arm's ``model.teacher`` (frozen, on the reference's device; a served
            teacher is an endpoint, on no device) and fill
            ``batch.teacher_logprobs``: the teacher's log-prob of each sampled token (on-policy
            distillation).
        teacher_logits: (with ``teacher``) also the teacher's whole next-token distribution at
            each response position: ``outputs.teacher_logits`` ``[B, R, V]``, computed without
            gradients beside each micro-batch's forward pass; and the policy's own response
            logits with gradients in ``outputs.logits`` (GKD's divergences over the vocabulary).
        on_policy_fraction: (demonstrations) the share of steps whose batch the policy samples,
            one response per row's prompt, instead of reading the rows' completions (GKD's
            lambda); 0 reads every step's completions.
        teacher_logprobs: (with ``teacher``) fill ``batch.teacher_logprobs`` each step; False
            for an algorithm that only has its teacher write completions (``sft`` with
            ``seq_kd``), which then saves the teacher's scoring pass.
        teacher_completions: (demonstrations, with ``teacher``) the steps the policy does not
            sample train on the teacher's own samples of the rows' prompts, one each at
            ``training.sampling``, instead of the rows' completions (sequence-level
            distillation; TRL GKD's ``seq_kd``).
        dense_rewards: ``compute_advantages`` adds ``batch.dense_rewards`` (a labeler's step
            scores placed on tokens, :attr:`Score.steps`) to its per-token rewards when the
            batch has them. ``alignzoo validate`` refuses an arm whose labeler gives step
            scores (``Labeler.gives_steps``) to an algorithm that does not declare this.
        truncation: ``compute_advantages`` reads ``batch.columns["truncated"]``, the engine's
            record of which sampled responses the length budget cut (kept for single-turn
            batches; TRL's ``mask_truncated_completions``). ``alignzoo validate`` refuses it
            for an arm with an environment, whose episodes end by ``episodes.on_failure``.
        reward_components: ``compute_advantages`` reads each reward of a labeler that reports
            several apart (``Score.info["rewards"]``, in ``batch.reward_components``; a labeler
            that reports none counts as one reward, its value) and weighs them itself, instead
            of the one score: None (the default) when it reads the score only; otherwise how
            many rewards it weighs (one weight each; 0: any number). ``alignzoo validate``
            refuses a labeler known to report another number of rewards
            (``Labeler.reward_components``), or whose value weighs them by other than 1 (those
            weights would apply to nothing), and ``labeling.normalize`` in front of such a
            labeler (it rescales the value, and the rewards are read raw).
        log_sum_sq_probs: fill ``outputs.log_sum_sq_probs`` ``[B, R]``: ``log Σ_v p_v²`` of
            the current policy's distribution at each response position, without gradients,
            computed in the same pass over the vocabulary as the log-probs (WPO's weights, DPO's
            ``use_weighting``).
    """

    reference: bool = False
    critic: bool = False
    data: DataMode = "online"
    entropy: bool = True
    old_logprobs_in_advantages: bool = False
    rollout_correction: bool = False
    weights: bool = False
    teacher: bool = False
    teacher_logits: bool = False
    on_policy_fraction: float = 0.0
    teacher_completions: bool = False
    teacher_logprobs: bool = True
    dense_rewards: bool = False
    truncation: bool = False
    reward_components: int | None = None
    log_sum_sq_probs: bool = False


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
    """What ``compute_loss`` returns: a scalar loss tensor to minimise and float metrics.

    ``entropy_mask`` (optional, ``[B, R]`` bool): the response tokens the algorithm's policy
    term keeps by their entropy (``top_entropy_quantile``); a modifier that acts on the
    policy's entropy (``entropy_bonus``) acts on the same ones, as TRL's bonus does. None:
    every response token.
    """

    loss: Any  # torch.Tensor, scalar, requires grad
    metrics: dict[str, float] = field(default_factory=dict)
    entropy_mask: Any = None  # torch.Tensor [B, R] bool, or None


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


# ---------------------------------------------------------------- labeling: what a labeler is asked and answers


@dataclass
class LabelRequest:
    """One thing to score: the prompt, the response and any extra dataset columns.

    In a run two more fields are set (None outside one: relabel, a served labeler):
    ``completion_ids``, the token ids the policy sampled for the response (what TRL passes as
    ``completion_ids``), and ``step``, the training step the sample is for (in evaluation, the
    step evaluated: 0 before training). Neither is part of the request's identity: the label store keys on prompt, response
    and extra only.
    """

    prompt: str
    response: str
    extra: dict[str, Any] = field(default_factory=dict)
    completion_ids: list[int] | None = None
    step: int | None = None


class Outcome(str, Enum):
    """What became of one sample's label.

    ``value``: a number to train on (malformed *model output* is a value too, e.g. 0 with
    ``info["malformed"]``). ``abstain``: the labeler declines (no answer key, out of scope).
    ``timeout``: the call did not answer in time (its worker was killed). ``error``: the
    infrastructure failed (connection, 5xx, a crashed worker, an exception in the labeler).
    ``parse_failure``: the labeler's own answer was unreadable (a judge's reply). ``rejected``:
    the labeler answered something unusable (NaN, inf, the wrong count or type).
    Each arm's ``labeling.on`` says what to do with each (see
    :class:`alignzoo.config.schema.LabelingConfig`).
    """

    VALUE = "value"
    ABSTAIN = "abstain"
    TIMEOUT = "timeout"
    ERROR = "error"
    PARSE_FAILURE = "parse_failure"
    REJECTED = "rejected"


@dataclass(frozen=True)
class StepScore:
    """The score of one step of a response (a process reward): the step is the response text's
    characters ``[start, end)`` (Python string indices of ``LabelRequest.response``) and
    ``score`` a finite number.

    The engine places ``score`` on the last trained token of the step's span (the token that
    completes its last character; :mod:`alignzoo.labeling.dense`), in ``batch.dense_rewards``.
    """

    start: int
    end: int
    score: float


@dataclass
class Score:
    """A labeler's verdict on one response.

    ``outcome`` is :attr:`Outcome.VALUE` for a real score; a labeler that declines returns
    ``Score.abstain(reason)``, one that cannot read its own answer ``Score.parse_failure(reason)``
    (a labeler may also raise :class:`alignzoo.errors.LabelerUnavailable` for an infrastructure
    failure). ``valid`` is False for a value the labeler judged without confidence (kept for
    the ``reward/valid_frac`` metric; it is trained on). ``info`` carries anything worth logging
    (extracted answer, raw model score, latency). Two keys have a meaning for the engine:

    - ``info["correct"]`` (bool): the labeler knows the right answer and says whether the
      response has it. When every score of an evaluation carries it, the engine reports
      ``eval/exact_match`` (and ``eval/pass@k`` uses it); online unpaired data (KTO) counts a
      correct sample as desirable.
    - ``info["raw"]`` (number): the unscaled value of a labeler that rescales its scores per
      batch; evaluation reports it as ``eval/score`` so the metric means the same at every step.
    - ``info["rewards"]`` (dict of name -> number or None): the separate rewards of a labeler
      that gives several (TRL's several reward functions: a ``combine``'s parts, a verifiers
      task's rubric), in the same order for every sample. None (or NaN) says that reward does
      not apply to the sample (a TRL reward function's None); any other entry must be a
      finite number (else the score is ``rejected``). The engine logs each one's mean as
      ``reward/<name>`` and, in every labeling pass, places them in
      ``batch.reward_components`` ``[B, K]`` (NaN where one does not apply) with their names
      in ``batch.reward_names``, for an algorithm that weighs them itself
      (``AlgorithmRequirements.reward_components``: GRPO's ``multi_objective_aggregation``
      and ``reward_weights``). Report the rewards raw: such an algorithm reads them, not
      ``value`` (which stays what the others train on, the rewards' sum or weighted sum).

    ``steps`` (a value's only): per-step scores of the response (a process reward model's),
    each a :class:`StepScore` naming a character span of the response text. In a training pass
    the engine places each on the last trained token of its span, in ``batch.dense_rewards``
    with ``batch.dense_mask``, for algorithms that read dense rewards (PPO, REINFORCE++). The
    sequence ``value`` stays what sequence-level algorithms train on; ``labeling.normalize``
    rescales the value, never the steps.
    """

    value: float
    valid: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    outcome: Outcome = Outcome.VALUE
    steps: list[StepScore] = field(default_factory=list)

    @classmethod
    def abstain(cls, reason: str = "") -> Score:
        """The labeler declines to label this sample (not a zero)."""
        return cls(math.nan, False, {"reason": reason} if reason else {}, Outcome.ABSTAIN)

    @classmethod
    def parse_failure(cls, reason: str = "") -> Score:
        """The labeler could not read its own answer (e.g. a judge's reply without a score)."""
        return cls(math.nan, False, {"reason": reason} if reason else {}, Outcome.PARSE_FAILURE)


# ---------------------------------------------------------------- episodes: what crosses an environment's hooks
# A message is a chat message as Hugging Face chat templates take it: ``{"role": ..., "content":
# ...}``, with ``"tool_calls"`` on an assistant message and ``"name"`` on a tool message where a
# template uses them.

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Turn:
    """The model's turn as the environment sees it.

    ``text``: what the model wrote (decoded, special tokens removed). ``tool_calls``: the calls
    the arm's codec read in it, in order. ``errors``: one line per call the codec found but
    could not read (bad JSON, no name): an environment answers them as an error observation
    so the model can recover; they never raise. ``index``: 0 for the first turn.
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()
    index: int = 0


@dataclass
class EpisodeStart:
    """What ``env_reset`` returns.

    ``state``: the episode's own state, handed back to ``env_step`` and ``env_close`` (any
    object; the engine never looks inside). ``messages``: the conversation the model starts
    from (a system message, the task as a user message). ``tools``: JSON schemas of the tools
    offered (``{"type": "function", "function": {...}}``, what ``apply_chat_template(tools=)``
    renders); None when the episode offers none.
    """

    state: Any
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


@dataclass
class StepResult:
    """What ``env_step`` returns after the model's turn.

    ``messages``: the environment's answer, appended to the conversation (tool results as
    ``{"role": "tool", "name": ..., "content": ...}``, or a user message); empty when the
    episode ends without one. ``reward``: this step's reward, if the environment gives one
    (the episode's reward is the sum, see the engine's ``episodes.reward``). ``done``: the
    episode is over. ``info``: anything worth logging about the step (kept in sample rows;
    numbers under ``info["metrics"]`` are averaged into the step's ``env/*`` metrics).
    """

    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- the run, as lifecycle hooks see it


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line and flush it to disk."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        f.flush()


@dataclass
class RunContext:
    """One run of one arm with one seed: the ``run`` argument of the lifecycle hooks.

    Passed to ``on_run_start``, ``transform_batch``, ``on_step_end`` and ``on_run_end``.
    ``models`` (tokenizer, actor, reference, critic, device placement) is set before
    ``on_run_start``; ``step`` is the step being run (0 before the first); ``state`` is free
    space for plugins (anything JSON-serialisable kept there is saved in checkpoints and
    restored on resume); ``console`` is where a plugin may print (None when quiet).
    """

    experiment: str
    arm: str
    seed: int
    out_dir: Path
    spec: Any  # alignzoo.config.ExperimentSpec (the contract root imports no subpackage)
    arm_spec: Any  # alignzoo.config.schema.ArmSpec
    models: Any = None  # alignzoo.engine.models.Models, set before on_run_start
    console: Console | None = None
    step: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """'<experiment>/<arm>/seed-<n>'."""
        return f"{self.experiment}/{self.arm}/seed-{self.seed}"

    def device(self, role: str) -> str:
        """The device placed for ``role`` (``cpu`` when the mapper did not place it)."""
        return self.models.device(role) if self.models is not None else "cpu"

    def placement(self, role: str) -> Placement:
        """The full placement of ``role``: device, GPU share, tensor-parallel size."""
        if self.models is None:
            return Placement(device="cpu")
        return self.models.placement(role)

    def _models(self) -> Any:
        if self.models is None:
            raise AttributeError(f"{self.name}: the run's models are not loaded yet")
        return self.models

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (shortcut for ``models.tokenizer``)."""
        return self._models().tokenizer

    @property
    def actor(self) -> torch.nn.Module:
        """The trainable policy (shortcut for ``models.actor``)."""
        return self._models().actor

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference policy or None (shortcut for ``models.reference``)."""
        return self._models().reference

    @property
    def critic(self) -> torch.nn.Module | None:
        """The value model or None (shortcut for ``models.critic``)."""
        return self._models().critic

    @property
    def devices(self) -> dict[str, str]:
        """Role -> device, as placed by the device mapper (shortcut for ``models.devices``)."""
        return dict(self.models.devices) if self.models is not None else {}

    def record(self, stream: str, row: dict[str, Any]) -> Path:
        """Append ``row`` as one JSON line to ``<out_dir>/<stream>.jsonl``; return that path.

        How a plugin keeps its own output in the run folder: the row is stamped with the step
        being run (``"step"``), so on ``--resume`` the file is cut back to the checkpoint like
        the engine's own streams and nothing is written twice. ``stream`` is a plain name
        (letters, digits, ``_``), not one of the engine's (metrics, eval, samples).
        """
        if not _STREAM.fullmatch(stream) or stream in _ENGINE_STREAMS:
            raise ValueError(
                f"record: stream must be a plain name (letters, digits, _; at most 64) other "
                f"than {', '.join(sorted(_ENGINE_STREAMS))}, got {stream!r}"
            )
        path = self.out_dir / f"{stream}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(path, {**row, "step": self.step})
        return path


_STREAM = re.compile(r"[A-Za-z0-9_]{1,64}")
_ENGINE_STREAMS = frozenset({"metrics", "eval", "samples"})
