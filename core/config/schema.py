"""The experiment schema: what an experiment YAML may say (pydantic v2, unknown keys forbidden).

An experiment names arms; each arm picks an algorithm, labeler, backend, device mapper and
modifiers (components, each with its own ``params`` validated by the component's ``Params``
model) and may override the shared ``training`` and ``model`` sections. ``defaults`` holds arm
fields shared by every arm. Loading lives in :mod:`alignzoo.config.loader`, error locating in
:mod:`alignzoo.config.locate`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveInt,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from alignzoo.types import SamplingParams


class _Strict(BaseModel):
    # No inf/nan anywhere, also not from a string such as "1e999" that parses to inf.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ComponentRef(_Strict):
    """A component chosen by name, with its parameters (validated by the component's Params)."""

    name: str = Field(description="Registered component name (see `alignzoo plugins`).")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="The component's params (see `alignzoo plugins NAME`); checked against its Params model.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        # Shorthand: `algorithm: grpo` means `algorithm: {name: grpo}`.
        return {"name": value} if isinstance(value, str) else value


class LoraConfig(_Strict):
    """LoRA adapters through peft; only the adapters are trained."""

    r: PositiveInt = Field(8, description="LoRA rank of each adapter.")
    alpha: float = Field(
        16.0, gt=0, description="LoRA scaling: the update is multiplied by alpha / r."
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input while training."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names that get adapters, or 'all-linear'."
    )


class EmbeddedModelConfig(_Strict):
    """The small causal LM the embedded default builds, warm-started by supervised fine-tuning."""

    architecture: Literal["qwen2", "llama"] = Field(
        "qwen2", description="Family of the embedded policy (a transformers config built locally)."
    )
    hidden_size: PositiveInt = Field(64, description="Width of the embedded policy.")
    num_layers: PositiveInt = Field(2, description="Decoder layers of the embedded policy.")
    num_heads: PositiveInt = Field(
        4, description="Attention heads (hidden_size must divide by it)."
    )
    intermediate_size: PositiveInt = Field(256, description="Width of the MLP blocks.")
    # 800 steps: 29% greedy exact match on 2-digit addition with seed 0, ~30 s on 2 cores.
    sft_steps: int = Field(
        800, ge=0, description="Supervised warm-start steps on teacher demonstrations (cached)."
    )
    sft_lr: float = Field(3e-3, gt=0, description="Learning rate of the warm start.")
    sft_batch_size: PositiveInt = Field(64, description="Demonstrations per warm-start step.")
    sft_slip: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Probability that a warm-start demonstration of a prompt whose units column "
        "carries (+) or borrows (-) drops the carry or borrow, as a sloppy teacher would: "
        "the warm-started policy then answers such prompts wrongly when greedy but still "
        "samples the right answer, which is what RL from a verifier can fix.",
    )
    sft_on: Literal["task", "train"] = Field(
        "task",
        description="What the warm start demonstrates: the embedded arithmetic task ('task'), "
        "or the experiment's own train data, each prompt with its 'answer' column ('train', "
        "e.g. reasoning-gym prompts).",
    )
    sft_tool_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of warm-start demonstrations that call the embedded calculator "
        "('12*34=[12*34]=408' then the answer; the calculator's part is not trained on) instead "
        "of answering directly: a policy that calls the tool only sometimes, for the "
        "calculator environment (experiments/tool_use.yaml).",
    )
    seed: int = Field(0, description="Seed of the embedded model's initialisation and warm start.")


class ServedTeacherConfig(_Strict):
    """A teacher served over HTTP by an OpenAI-compatible ``/v1/completions`` endpoint (a vLLM
    server): the policy's prompt and sampled response go out as token ids, and the endpoint's
    prompt log-probs are the teacher's log-prob of each response token. Its log-probs are those
    of the raw logits (temperature 1), so the arm must sample at temperature 1."""

    base_url: str = Field(
        description="The server's address, e.g. http://127.0.0.1:8000 (a trailing /v1 is "
        "accepted); requests go to <base_url>/v1/completions."
    )
    model: str = Field(description="The model name the endpoint serves (listed by /v1/models).")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key (sent as a Bearer token)."
    )
    timeout_s: float = Field(120.0, gt=0, description="Timeout of one request, in seconds.")
    max_concurrency: PositiveInt = Field(
        4, description="Requests in flight at once (each carries up to batch_size sequences)."
    )
    batch_size: PositiveInt = Field(
        16, description="Sequences per request (the request's prompt is a list of token-id lists)."
    )
    retries: int = Field(
        2,
        ge=0,
        description="Tries after the first of a request that fails by connection, timeout, "
        "HTTP 429 or 5xx (with backoff); then the step fails. Other HTTP errors fail at once.",
    )
    logprobs_field: Literal["prompt_logprobs", "echo"] = Field(
        "prompt_logprobs",
        description="How the log-probs are asked for: 'prompt_logprobs' (vLLM's extension, "
        "prompt_logprobs: 0 and max_tokens: 1; read from choices[i].prompt_logprobs) or 'echo' "
        "(the legacy OpenAI form, echo: true, logprobs: 0, max_tokens: 0; read from "
        "choices[i].logprobs.token_logprobs).",
    )
    tokenizer: str | None = Field(
        None,
        description="A local folder with the served model's tokenizer, compared with the "
        "policy's vocabulary at validate and at load; needed when the server has no /tokenize "
        "endpoint (vLLM's has one).",
    )

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s):// URL (e.g. http://127.0.0.1:8000)")
        return value


class TeacherConfig(_Strict):
    """The teacher of a distillation algorithm (``opd``): a frozen model whose log-probs of the
    policy's own sampled tokens the algorithm learns from. It must share the policy's
    tokenizer; a local one is placed on the reference's device, a served one is called over
    HTTP; it is never trained or checkpointed."""

    path: str | None = Field(
        None,
        description="A local folder written by save_pretrained (an AutoModelForCausalLM with the "
        "policy's tokenizer).",
    )
    embedded: EmbeddedModelConfig | None = Field(
        None,
        description="The embedded world's teacher, built and cached like the warm start: the "
        "embedded policy's settings with these changed (larger, or sft_slip: 0).",
    )
    served: ServedTeacherConfig | None = Field(
        None,
        description="A teacher served by an OpenAI-compatible /v1/completions endpoint (a vLLM "
        "server) that returns prompt log-probs; sampling at temperature 1 only.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        given = [s for s in (self.path, self.embedded, self.served) if s is not None]
        if len(given) != 1:
            raise ValueError(
                "set exactly one of path (a local checkpoint), embedded or served (an "
                "OpenAI-compatible endpoint)"
            )
        return self


class ModelConfig(_Strict):
    """Which models a run loads."""

    policy: str = Field(
        "embedded",
        description="'embedded' (built and cached locally) or a local path / hub id for from_pretrained.",
    )
    reward_model: str | None = Field(
        None,
        description="Local folder of an AutoModelForSequenceClassification: the reward_model "
        "labeler's params.path unless it gives one, and a 'reward' role for the device mapper.",
    )
    teacher: TeacherConfig | None = Field(
        None,
        description="The teacher of a distillation algorithm (opd): a local checkpoint, the "
        "embedded world's teacher or a served model; its log-probs of the policy's samples fill "
        "batch.teacher_logprobs.",
    )

    @model_validator(mode="after")
    def _teacher_from_the_policy(self) -> ModelConfig:
        # The embedded teacher is the embedded policy's settings with the ones it gives,
        # resolved here once: a dumped experiment (every field written) reads back the same.
        teacher = self.teacher
        if teacher is not None and teacher.embedded is not None:
            given = {k: getattr(teacher.embedded, k) for k in teacher.embedded.model_fields_set}
            resolved = self.embedded.model_copy(update=given)
            self.teacher = teacher.model_copy(update={"embedded": resolved})
        return self

    embedded: EmbeddedModelConfig = Field(
        default_factory=EmbeddedModelConfig,
        description="The embedded default policy, used when policy is 'embedded'.",
    )
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters instead of every weight (peft); null trains all."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Precision of forward passes (autocast; weights and optimizer state stay "
        "fp32). 'auto': bf16 on a GPU that has it, else fp32 (CPU, older GPUs); 'bfloat16': "
        "bf16 on GPU and CPU (fast on a CPU with AVX512-BF16 or AMX, emulated and slower "
        "elsewhere; refused on a GPU without bf16); 'float32': no autocast; 'float16': GPU "
        "only. validate refuses a dtype the actor's device cannot train in.",
    )
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = Field(
        "auto",
        description="Attention kernel passed to transformers ('flash_attention_2' needs the flash-attn extra and a GPU).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )
    disable_dropout: bool = Field(
        True,
        description="Zero every dropout probability of the actor and critic, so that the "
        "policy that samples is the policy that is trained (importance ratio exactly 1 at "
        "the first epoch); the usual choice for RL fine-tuning.",
    )


class TaskConfig(_Strict):
    """The embedded arithmetic task: prompts like '12+7=' with a verifiable answer."""

    digits: PositiveInt = Field(
        2, description="Digits per operand of the embedded arithmetic task."
    )
    operations: list[Literal["+", "-", "*"]] = Field(
        default=["+"], min_length=1, description="Operations the task draws from."
    )
    train_size: PositiveInt = Field(2000, description="Training prompts generated.")
    eval_size: PositiveInt = Field(100, description="Held-out evaluation prompts generated.")
    seed: int = Field(1234, description="Seed of the task's prompt generation.")


class ReasoningGymTask(_Strict):
    """One task of a reasoning-gym composite: its name, share and configuration."""

    name: str = Field(description="A reasoning-gym dataset name (e.g. basic_arithmetic).")
    weight: float = Field(1.0, gt=0, description="Its share of the composite's entries.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The task's own configuration (its Config fields)."
    )


class ReasoningGymSpec(_Strict):
    """Prompts generated by reasoning-gym: one task or a weighted composite of several."""

    task: str | None = Field(None, description="A reasoning-gym dataset name (or give tasks).")
    tasks: list[ReasoningGymTask] | None = Field(
        None, description="A weighted composite of tasks (or give task)."
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="With task: the task's configuration (Config fields)."
    )
    size: PositiveInt = Field(500, description="Entries generated.")
    seed: int = Field(0, description="Seed of the generator (use another for the eval split).")
    template: str = Field(
        "{question}",
        description="The prompt from an entry: Python format fields {question} and "
        "{metadata[KEY]}.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ReasoningGymSpec:
        if (self.task is None) == (self.tasks is None):
            raise ValueError("give exactly one of task or tasks")
        if self.tasks is not None and self.config:
            raise ValueError("config goes with task; each of tasks has its own config")
        return self


class ReasoningGymData(_Strict):
    """A data source generated by reasoning-gym (the ``reasoning-gym`` extra)."""

    reasoning_gym: ReasoningGymSpec = Field(
        description="Which tasks, how many entries, the seed and the prompt template."
    )


class VerifiersSpec(_Strict):
    """Tasks from a verifiers taskset (an installed taskset package, as verifiers loads it)."""

    taskset: str = Field(
        description="The taskset's id: an installed package exporting a verifiers Taskset "
        "(verifiers' --env.taskset.id)."
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="The taskset's configuration (its TasksetConfig fields)."
    )
    select: dict[str, Any] = Field(
        default_factory=dict,
        description="Which tasks, as verifiers' SelectConfig: include, exclude, shuffle, seed, "
        "skip, limit (e.g. {skip: 100, limit: 500}).",
    )


class VerifiersData(_Strict):
    """A data source from a verifiers taskset (the ``verifiers`` extra)."""

    verifiers: VerifiersSpec = Field(description="Which taskset, its configuration and tasks.")


DataSource = str | ReasoningGymData | VerifiersData


class DataConfig(_Strict):
    """Where prompts (or preference / unpaired-feedback data) come from."""

    train: DataSource = Field(
        "embedded",
        description="'embedded', a jsonl / parquet file or dataset folder, "
        "{reasoning_gym: {...}} (prompts and scorers from reasoning-gym) or {verifiers: {...}} "
        "(a verifiers taskset).",
    )
    eval: DataSource = Field(
        "embedded",
        description="'embedded', a jsonl / parquet file or dataset folder, "
        "{reasoning_gym: {...}} or {verifiers: {...}}.",
    )
    task: TaskConfig = Field(
        default_factory=TaskConfig,
        description="The embedded arithmetic task, used when train / eval are 'embedded'.",
    )
    online: bool = Field(
        True,
        description="Preference / unpaired algorithms: sample and label pairs in the loop (true) "
        "or read them from `train` (false).",
    )
    sample_ratio: float = Field(
        1.0, gt=0, le=1, description="Share of the train split used (a fixed random subset)."
    )


class Budget(_Strict):
    """How much each arm x seed may train: exactly one of steps, samples or wall-clock seconds."""

    steps: PositiveInt | None = Field(None, description="Training steps per arm x seed.")
    samples: PositiveInt | None = Field(
        None,
        description="Samples (generated or read) per arm x seed; steps run until it is reached.",
    )
    wall_clock_s: float | None = Field(
        None,
        gt=0,
        description="Seconds of training per arm x seed (not reproducible across machines).",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> Budget:
        given = [k for k in ("steps", "samples", "wall_clock_s") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of steps, samples, wall_clock_s"
                + (f" (found {', '.join(given)})" if given else "")
            )
        return self


class RolloutCorrection(_Strict):
    """Truncated importance sampling (TIS) for the train/inference mismatch.

    A rollout engine with its own kernels samples from probabilities slightly different from
    the trainer's on the same weights. With ``level`` token or sequence, policy-gradient
    algorithms weight their surrogate by ``min(pi_old / pi_rollout, cap)`` per token, or by the
    product over the response per sequence (Yao et al. 2025; :func:`alignzoo.ops.rollout_is_weights`).
    Needs a backend that returns its sampling log-probs; ``rollout/logprob_diff`` is logged
    whenever it does, with the correction on or off.
    """

    level: Literal["off", "token", "sequence"] = Field(
        "off", description="off, per-token weights, or one weight per sequence."
    )
    cap: float = Field(
        2.0, ge=1.0, description="C: weights above it are truncated to it (or masked)."
    )
    mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: a weight above C counts as C (TIS); mask: a token (or sequence) "
        "whose weight exceeds C is left out of the surrogate, the rest keep their weights "
        "(masked importance sampling).",
    )


class AsyncConfig(_Strict):
    """Rollout producers apart from the trainer (``training.async``).

    ``producers`` processes each hold a copy of the policy and the arm's backend, labelers and
    environment; they take the steps' prompts in order, sample and label them, and hand the
    batches to the trainer through a bounded queue. A producer starts step t's prompts only
    with weights at most ``max_staleness`` steps older than those that train on them, and
    otherwise waits (it paces; nothing is dropped). ``max_staleness: 0`` is the synchronous
    run, in two processes. Off-policy correction is ``training.rollout_correction``: with
    stale samples its weights are pi_proximal / pi_behaviour, the decoupled PPO objective.
    """

    max_staleness: int = Field(
        1,
        ge=0,
        description="K: the samples of step t come from the weights of step t - K or later "
        "(0: lock-step, the synchronous run).",
    )
    producers: PositiveInt = Field(
        1, description="Producers: local processes, or Ray actors under --executor ray."
    )
    weights_every: PositiveInt = Field(
        1,
        description="M: the trainer sends its weights to the producers every M steps (and at "
        "the start); needs max_staleness >= M - 1.",
    )
    producer_threads: PositiveInt | None = Field(
        None,
        description="torch threads in each producer (default: the trainer's; the same count "
        "keeps max_staleness 0 bit-identical to the synchronous run).",
    )
    partial_rollouts: bool = Field(
        False,
        description="A rollout in progress when newer weights arrive goes on with them: the hf "
        "backend's generate before each decode step (its KV cache kept), an episode before each "
        "of the model's turns (any backend); each token keeps the version and log-prob it was "
        "sampled with (off: a batch is sampled with the weights it started with).",
    )

    @model_validator(mode="after")
    def _weights_often_enough(self) -> AsyncConfig:
        if self.max_staleness < self.weights_every - 1:
            raise ValueError(
                f"weights_every {self.weights_every} with max_staleness {self.max_staleness}: "
                "producers would wait for weights the trainer never sends; give max_staleness "
                f">= {self.weights_every - 1} or a smaller weights_every"
            )
        return self


class TrainingConfig(_Strict):
    """Optimisation settings shared by all arms (an arm's `training:` overrides single fields)."""

    # ``async`` is a Python keyword: the field is ``async_``, read and written as ``async``.
    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        serialize_by_alias=True,
        validate_by_name=True,
        validate_by_alias=True,
    )

    lr: NonNegativeFloat = Field(1e-4, description="Actor learning rate (0 freezes the policy).")
    critic_lr: NonNegativeFloat | None = Field(
        None, description="Critic learning rate (default: lr)."
    )
    prompts_per_step: PositiveInt = Field(
        8, description="Prompts (or data rows) per training step."
    )
    samples_per_prompt: PositiveInt = Field(4, description="n responses per prompt (group size).")
    epochs: PositiveInt = Field(1, description="Passes over each step's batch.")
    minibatch_size: PositiveInt | None = Field(
        None, description="Samples per optimizer step (default: the whole step batch)."
    )
    micro_batch_size: PositiveInt = Field(
        16, description="Samples per forward pass (gradient accumulation)."
    )
    packing: bool = Field(
        False,
        description="Run each forward pass's samples packed: their real tokens end to end in a "
        "few rows (best-fit decreasing), each sample with its own positions and attending only "
        "to its own tokens (alignzoo.kernels.packing), so no compute goes to padding. The same "
        "log-probs, values and loss as padded rows, up to summation order.",
    )
    packing_length: PositiveInt | None = Field(
        None,
        description="With packing: the most tokens a packed row holds (a longer sample gets a "
        "row of its own, never cut). Default: the micro-batch's longest sample, so no row is "
        "longer than the padded batch's.",
    )
    fuse_behaviour: bool = Field(
        True,
        description="When a batch is trained on once in one optimizer step (epochs 1, one "
        "minibatch, dropout off, no batch transform), take the behaviour log-probs and entropy "
        "from the update's own forward pass instead of a separate no-grad pass: the same "
        "numbers, one forward pass fewer. false always runs the separate pass.",
    )
    decode_trace: bool = Field(
        True,
        description="When a batch is trained on once in one optimizer step (epochs 1, one "
        "minibatch, dropout off, no labeling overlap or async) and the hf backend's lean decode "
        "loop samples "
        "it in one loop of 32 or more new tokens, record the loop's activations and run the "
        "update's backward pass against them instead of a second forward pass "
        "(alignzoo.kernels.trace): the same gradient up to float rounding without the forward's "
        "arithmetic, for about 1.3 GB held from sampling to the update at 64 x 134 tokens of a "
        "25.8M model. false always runs the forward pass.",
    )
    reuse_cpu_memory: bool = Field(
        True,
        description="On a CPU actor under Linux/glibc, keep the memory that tensors free for the "
        "next step instead of handing it back to the kernel (alignzoo.engine.malloc): a step's "
        "large activations are then not page-faulted in again every step. Process-wide; the "
        "kept heap can fragment and raise peak memory (the lean forward of Qwen2/Llama avoids "
        "most of it, other models' own forwards may not): false leaves malloc as it is, and "
        "`alignzoo run` does not restart on huge pages for an experiment where every arm sets "
        "it false (alignzoo.engine.malloc; ALIGNZOO_HUGE_PAGES=0 keeps 4 KB pages in any case).",
    )
    rollout_correction: RolloutCorrection = Field(
        default_factory=RolloutCorrection,
        description="Truncated importance sampling between the rollout backend's sampling "
        "log-probs and the trainer's (for backends with their own kernels, such as vLLM, and "
        "for the stale samples of training.async).",
    )
    async_: AsyncConfig | None = Field(
        None,
        alias="async",
        description="Rollout producers in processes of their own, running up to max_staleness "
        "steps ahead of the trainer (see AsyncConfig); unset: generation and training take "
        "turns in one process.",
    )
    parallel: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="How several torch.distributed processes (torchrun) train the actor and "
        "critic: 'ddp' keeps a full copy on every rank and averages gradients; 'fsdp2' shards "
        "parameters, gradients and optimizer state over the ranks (fully_shard, one unit per "
        "transformer block). Ignored in one process.",
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the gradient norm to this; null disables clipping."
    )
    weight_decay: NonNegativeFloat = Field(0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps of linear learning-rate warm-up."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning rate after warm-up: constant, or decayed to 0 over the budget.",
    )
    sync_ref_model: bool = Field(
        False,
        description="A moving reference (TR-DPO, Gorbatovski et al. 2024; TRL's sync_ref_model): "
        "every ref_model_sync_steps optimizer steps the reference becomes "
        "ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference, parameter "
        "by parameter, and its weights are checkpointed with the run. For an algorithm that "
        "loads a reference (grpo with beta > 0, dpo without reference_free, kto, ppo, ...); a "
        "LoRA arm then keeps a full reference copy, mixed with the merged policy.",
    )
    ref_model_mixup_alpha: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="α of the reference sync: π_ref <- α π_θ + (1 - α) π_ref (1 copies the "
        "policy into the reference). Used with sync_ref_model.",
    )
    ref_model_sync_steps: PositiveInt = Field(
        512,
        description="τ of the reference sync: it happens after every optimizer step whose count "
        "(the policy version) is a multiple of this. Used with sync_ref_model.",
    )
    checkpoint_every: PositiveInt = Field(
        10, description="Steps between checkpoints (and the last step always)."
    )
    checkpoint_mirror: str | None = Field(
        None,
        description="An fsspec URL (s3://bucket/prefix, ...) each complete checkpoint is copied "
        "to (its manifest last), and restored from on --resume when the run folder has none; "
        "credentials from the environment only.",
    )
    sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="How responses are sampled during training."
    )

    @model_validator(mode="after")
    def _packing_length_packs(self) -> TrainingConfig:
        if self.packing_length is not None and not self.packing:
            raise ValueError(
                f"packing_length {self.packing_length} without packing: set packing: true, "
                "or drop packing_length"
            )
        return self


class EvaluationConfig(_Strict):
    """Held-out evaluation on a fixed schedule, identical for every arm."""

    every: PositiveInt = Field(
        10, description="Evaluate every this many steps (and at start and end)."
    )
    num_prompts: PositiveInt | None = Field(
        None, description="Use the first N eval prompts (default all)."
    )
    labeler: ComponentRef | None = Field(
        None,
        description="The labeler evaluation scores with, the same for every arm (default: each "
        "arm's own labeler). Set it when arms train against different labelers, e.g. a learned "
        "reward model against the rule it was trained to imitate, so that every arm is "
        "measured the same way.",
    )
    metric: str | None = Field(
        None,
        description="Metric the report compares arms on (exact_match, score, pass@k, "
        "response_length). Default: exact_match when every arm's labeler says which answers "
        "are correct, else score (the labeler's mean value).",
    )
    metric_chosen: Literal["given", "default"] = Field(
        "given",
        description="Written by alignzoo in the resolved experiment: whether metric was given "
        "or chosen by default (the report says which).",
    )
    higher_is_better: bool | None = Field(
        None,
        description="Direction of the metric; default: guessed from its name (lower is better "
        "for loss, error, perplexity, length, time and memory).",
    )
    pass_at_k: PositiveInt | None = Field(
        None,
        description="Also report pass@k: the unbiased estimator of Chen et al. 2021 on each "
        "evaluation row's own sampled responses, averaged over the rows (a prompt that "
        "appears in two rows counts twice, each with its own samples).",
    )
    pass_at_k_samples: PositiveInt | None = Field(
        None,
        description="Responses sampled per evaluation row for pass@k (n >= pass_at_k; "
        "default pass_at_k). More than k lowers the estimator's variance.",
    )
    max_new_tokens: PositiveInt | None = Field(
        None, description="Longest evaluation response; default: training.sampling.max_new_tokens."
    )
    compare_at: Literal["final", "best_checkpoint"] = Field(
        "final",
        description="Which evaluation of each run the report compares arms on: 'final' (the "
        "last), or 'best_checkpoint' (the best by the metric among the steps with a kept "
        "checkpoint, the one `alignzoo export --step best` writes; chosen on the evaluation "
        "prompts themselves, so optimistic, and the report says so).",
    )
    target: float | None = Field(
        None,
        description="A value of the compared metric: the report gives each arm's time to reach "
        "it (the steps, samples and training wall-clock of each run's first evaluation at or "
        "past it) and compares the arms' wall-clock to it when every seed reached it. Null: no "
        "such section.",
    )
    stop_after_falls: PositiveInt | None = Field(
        None,
        description="End a run once its metric has been worse than its best so far for this "
        "many evaluations in a row (an over-optimisation stop; the run is recorded as stopped "
        "early, at that step, and a checkpoint is kept there; other runs keep their budget). "
        "Null: every run trains its whole budget.",
    )

    @field_validator("pass_at_k_samples")
    @classmethod
    def _enough_samples_for_k(cls, n: int | None, info: ValidationInfo) -> int | None:
        if n is None or "pass_at_k" not in info.data:  # a bad pass_at_k is said on its own
            return n
        k = info.data["pass_at_k"]
        if k is None:
            raise ValueError("samples for pass@k: set evaluation.pass_at_k too")
        if n < k:
            raise ValueError(
                f"{n} samples per row cannot estimate pass@{k} (the estimator needs n >= k); "
                f"give at least {k}, or leave it unset for {k}"
            )
        return n


class WandbConfig(_Strict):
    project: str = Field("alignzoo", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team); default: yours.")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline keeps runs local (wandb sync uploads them later)."
    )


class LoggingConfig(_Strict):
    """Where metrics go. metrics.jsonl is always written."""

    sinks: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default=["console", "jsonl"],
        description="Where step metrics go: the console line, metrics.jsonl, TensorBoard, W&B.",
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig,
        description="Weights & Biases settings, used when sinks include wandb.",
    )


Policy = Literal["retry", "fallback", "drop_sample", "drop_group", "fail"]


class OutcomePolicies(_Strict):
    """What to do with a sample whose label is not a value, per outcome.

    ``retry``: ask the same labeler again (``labeling.retries`` times, with backoff), then
    ``fallback``; ``fallback``: ask the next labeler of the chain, and when there is none apply
    ``exhausted``; ``drop_sample``: leave the sample out of the step (losses and group
    statistics exclude it); ``drop_group``: leave its whole group out; ``fail``: stop the run.
    """

    abstain: Policy = Field("fallback", description="The labeler declined the sample.")
    timeout: Policy = Field("retry", description="The call ran past labeling.timeout_s.")
    error: Policy = Field("retry", description="Infrastructure failure or an exception.")
    parse_failure: Policy = Field("retry", description="The labeler's own answer unreadable.")
    rejected: Policy = Field("fallback", description="NaN, inf, wrong count or type.")
    exhausted: Literal["drop_sample", "drop_group", "fail"] = Field(
        "drop_sample", description="No labeler of the chain gave a value."
    )


class BreakerConfig(_Strict):
    """A circuit breaker per labeler: when the share of failed calls over the last ``window``
    calls reaches ``error_rate`` (with at least ``min_calls``), the labeler is skipped (its
    samples fall back) for ``cooldown_s``; then one probe call decides whether it closes."""

    window: PositiveInt = Field(20, description="Calls the error rate is computed over.")
    min_calls: PositiveInt = Field(
        4, description="Calls needed in the window before the breaker may trip."
    )
    error_rate: float = Field(
        0.5, gt=0, le=1, description="Share of failed calls that trips the breaker."
    )
    cooldown_s: float = Field(
        30.0, ge=0, description="Seconds the labeler is skipped before one probe call."
    )


class NormalizeConfig(_Strict):
    """How the values a labeler gives are put on a common scale before training sees them.

    Applied by the labeling stage per labeler of the chain, to values only (not to abstains
    or failures), in training passes only (evaluation scores raw values); the value the
    labeler gave stays in ``Score.info["raw"]``. See :mod:`alignzoo.labeling.normalize`.
    """

    mode: Literal["none", "running", "fixed"] = Field(
        "none",
        description="'running': whiten by the running mean and std of the values this labeler "
        "gave over the run's passes so far, this pass included (checkpointed); 'fixed': "
        "(value - shift) * scale; 'none': values as given.",
    )
    shift: float = Field(0.0, description="'fixed': subtracted from each value.")
    scale: float = Field(1.0, description="'fixed': multiplies each shifted value.")
    momentum: float | None = Field(
        None,
        gt=0,
        le=1,
        description="'running': null weighs every value seen alike (Welford); a number makes "
        "the mean and variance an exponential moving average over passes, each pass's own "
        "mean and variance weighted by it.",
    )
    target_mean: float = Field(0.0, description="'running': the mean values are whitened to.")
    target_std: float = Field(
        1.0, gt=0, description="'running': the standard deviation values are whitened to."
    )
    eps: float = Field(
        1e-6, gt=0, description="'running': the smallest standard deviation divided by."
    )
    clip: float | None = Field(
        None, gt=0, description="Clip each normalised value to [-clip, clip] (null: no clip)."
    )


class IterateConfig(_Strict):
    """Iterated RLHF (:mod:`alignzoo.human.iterate`): every ``every`` steps, fresh responses of
    the live policy go to the human queue as pairs, the reward model is retrained on every
    agreed judgement so far (warm-started from the one in use), checked, and hot-swapped into
    the run. The arm's labeler must be ``reward_model``."""

    every: PositiveInt = Field(description="Training steps between rounds.")
    prompts: PositiveInt = Field(
        64, description="Training prompts per round, two fresh responses each (a pair)."
    )
    annotators: str | None = Field(
        None,
        description="A simulation YAML (as `alignzoo annotate simulate` reads): simulated "
        "annotators judge each round's pairs at once. Null: people judge them in the run's "
        "queue (`alignzoo annotate RUN/rlhf/queue`) and each round trains on the judgements "
        "given by then.",
    )
    raters: PositiveInt = Field(3, description="Judgements wanted per pair.")
    min_agree: PositiveInt = Field(2, description="Judgements that must agree to keep a pair.")
    data: str | None = Field(
        None,
        description="The preference data the first reward model was trained on (a folder or "
        "file of prompt, chosen, rejected): every round trains on it plus the queue's agreed "
        "pairs. Null: the queue's pairs alone.",
    )
    epochs: PositiveInt = Field(2, description="Epochs of each retraining.")
    lr: float = Field(3e-4, gt=0, description="Learning rate of each retraining.")
    negatives: str | None = Field(
        None, description="Synthetic negatives, as `train-rm --negatives` names them."
    )
    max_negatives: PositiveInt | None = Field(
        None, description="At most this many negatives per pair (`train-rm --max-negatives`)."
    )
    batch_size: PositiveInt = Field(16, description="Pairs per optimizer step of retraining.")
    min_heldout_accuracy: float = Field(
        0.6,
        ge=0,
        le=1,
        description="The check: a retrained reward model whose held-out pairwise accuracy is "
        "below this is not swapped in (the one in use stays; the round says why).",
    )


class LabelingConfig(_Strict):
    """How an arm labels: a chain of labelers, timeouts, retries, a breaker, outcome policies."""

    fallbacks: list[ComponentRef] = Field(
        default_factory=list,
        description="Labelers tried in order for the samples the arm's labeler gives no value.",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Per call; enforced by running each labeler in a worker process that is "
        "killed and replaced when a call runs past it (isolation 'process' is implied).",
    )
    isolation: Literal["inline", "process"] = Field(
        "inline", description="'process' runs each labeler in its own worker process."
    )
    batch_size: int | None = Field(
        None, ge=1, description="Most requests in one labeler call (default: the whole step)."
    )
    concurrency: int = Field(
        1,
        ge=1,
        description="Calls in flight at once: threads for an inline labeler (which must then "
        "be thread-safe), worker processes with isolation 'process'.",
    )
    retries: int = Field(2, ge=0, description="Tries after the first, for the 'retry' policy.")
    backoff_s: float = Field(
        0.2, ge=0, description="First retry wait; doubled each try, with 50-150% jitter."
    )
    backoff_max_s: float = Field(5.0, ge=0, description="Longest wait between retries.")
    deadline_s: float | None = Field(
        None, gt=0, description="Labeling time budget per step: no retry starts after it."
    )
    breaker: BreakerConfig = Field(
        default_factory=BreakerConfig,
        description="The circuit breaker of each labeler of the chain.",
    )
    on: OutcomePolicies = Field(
        default_factory=OutcomePolicies,
        description="What happens to a sample for each outcome that is not a value.",
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve the label path's metrics (label/*, labeler/*, timing/labeler/*) of "
        "the latest step on a Prometheus endpoint at 127.0.0.1:<port> while the run is live.",
    )
    overlap: bool = Field(
        False,
        description="Online arms: label each step's samples in the background while the next "
        "step's are generated, and train on samples one step old (see alignzoo.engine.collect "
        "for the staleness this brings).",
    )
    store: str | None = Field(
        "run",
        description="Where labels are persisted and reused (SQLite): 'run' (labels.sqlite in "
        "the run folder), a path shared by runs, or null to keep none.",
    )
    normalize: NormalizeConfig | None = Field(
        None,
        description="Reward scale: running whitening or a fixed scale of each labeler's "
        "values, and clipping (null: the labeler's own default, none for most; the reward "
        "model's is running whitening to mean 0.5, std 0.5, the scale of a 0/1 rule).",
    )
    iterate: IterateConfig | None = Field(
        None,
        description="Iterated RLHF: retrain the reward model on fresh judgements of the live "
        "policy every N steps and hot-swap it in (null: the reward model stays as it is).",
    )


class EpisodeConfig(_Strict):
    """Multi-turn episodes of an arm with an ``environment``: limits, tool calls, rewards."""

    max_turns: PositiveInt = Field(4, description="Model turns per episode at most.")
    max_tokens: PositiveInt = Field(
        256,
        description="Response tokens per episode at most (the model's and the environment's); "
        "an episode that reaches it is truncated. Each turn samples at most "
        "training.sampling.max_new_tokens.",
    )
    step_timeout_s: float = Field(
        30.0, gt=0, description="Longest env_reset or env_step call; past it: timeout."
    )
    episode_timeout_s: float | None = Field(
        None, gt=0, description="Longest episode (all its turns); past it: timeout."
    )
    codec: Literal["auto", "hermes", "brackets"] = Field(
        "auto",
        description="How tool calls are written: 'auto' (from the tokenizer's chat template), "
        "'hermes' (<tool_call> JSON) or 'brackets' (the embedded world's plain [12*34] "
        "calculator calls, for a tokenizer without a chat template).",
    )
    on_failure: Literal["drop_sample", "drop_group", "keep"] = Field(
        "drop_sample",
        description="An episode whose environment raised or timed out: left out of training "
        "(drop_sample), with the rest of its prompt's group (drop_group), or kept as it "
        "stands, truncated at the failure (keep).",
    )


class ArmSpec(_Strict):
    """One arm: a set of components plus overrides of the shared sections."""

    algorithm: ComponentRef = Field(
        description="The algorithm (kind algorithm): its compute_advantages / compute_loss train the policy."
    )
    labeler: ComponentRef = Field(
        default_factory=lambda: ComponentRef(name="arithmetic"),
        description="The labeler (kind labeler) that scores sampled responses; the head of labeling's chain.",
    )
    backend: ComponentRef = Field(
        default_factory=lambda: ComponentRef(name="hf"),
        description="The rollout backend (kind backend) that generates responses.",
    )
    devices: ComponentRef = Field(
        default_factory=lambda: ComponentRef(name="single"),
        description="The device mapper (kind device_mapper) that places actor, rollout, reference, critic and reward model.",
    )
    modifiers: list[ComponentRef] = Field(
        default_factory=list,
        description="Modifiers (kind modifier) around the other components: loss wrappers, batch transforms, lifecycle hooks.",
    )
    environment: ComponentRef | None = Field(
        None,
        description="An environment (kind environment): each prompt becomes a multi-turn "
        "episode (tool calls, observations) instead of one response.",
    )
    episodes: EpisodeConfig = Field(
        default_factory=EpisodeConfig,
        description="Limits, tool-call codec, reward and failure policy of the arm's episodes.",
    )
    online: bool | None = Field(
        None,
        description="Preference / unpaired algorithms: override data.online for this arm "
        "(offline reads data.train; online samples and labels pairs in the loop).",
    )
    labeling: LabelingConfig = Field(
        default_factory=LabelingConfig,
        description="How the arm labels: fallbacks, timeouts, retries, breaker, outcome policies, store, overlap.",
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig,
        description="Overrides of the top-level training section for this arm.",
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="Overrides of the top-level model section for this arm.",
    )
    sweep: dict[str, list[Any]] | None = Field(
        None,
        description="Expand this arm into one arm per combination of values of dotted fields "
        "of it, e.g. {training.lr: [1.0e-5, 3.0e-5]} -> arms <arm>-lr1e-05, <arm>-lr3e-05, "
        "compared like any others.",
    )
    description: str = Field("", description="Free text shown in the report.")

    @model_validator(mode="after")
    def _iterate_needs_a_reward_model(self) -> ArmSpec:
        if self.labeling.iterate is not None and (
            self.labeler.name != "reward_model" or "path" not in self.labeler.params
        ):
            raise ValueError(
                "labeling.iterate retrains and swaps the arm's reward model: the labeler must "
                f"be reward_model with a params.path (it is {self.labeler.name!r})"
            )
        return self

    def component_refs(self) -> list[tuple[str, str, ComponentRef]]:
        """(kind, field path, ref) for every component the arm names."""
        refs = [
            ("algorithm", "algorithm", self.algorithm),
            ("labeler", "labeler", self.labeler),
            ("backend", "backend", self.backend),
            ("device_mapper", "devices", self.devices),
        ]
        refs += [("modifier", f"modifiers.{i}", m) for i, m in enumerate(self.modifiers)]
        if self.environment is not None:
            refs.append(("environment", "environment", self.environment))
        refs += [
            ("labeler", f"labeling.fallbacks.{i}", ref)
            for i, ref in enumerate(self.labeling.fallbacks)
        ]
        return refs


MAX_NAME = 100
MAX_SEED = 2**32 - 1
SEED_RANGE = f"0 .. {MAX_SEED} (what numpy and torch both accept)"


class SeedsError(ValueError):
    """Seeds an experiment cannot run under: none, ``repeated`` ones, or ones ``outside``
    :data:`SEED_RANGE`; the message is the schema's."""

    def __init__(self, message: str, repeated: list[int], outside: list[int]) -> None:
        super().__init__(message)
        self.repeated = repeated
        self.outside = outside


def check_seeds(seeds: list[int]) -> list[int]:
    """``seeds`` if an experiment can run under them: at least one, distinct, each in
    :data:`SEED_RANGE`; else SeedsError."""
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    outside = [s for s in seeds if not 0 <= s <= MAX_SEED]
    if not seeds:
        raise SeedsError("seeds is empty", repeated, outside)
    if repeated:
        raise SeedsError("seeds must be distinct", repeated, outside)
    if outside:
        raise SeedsError(f"seed {outside[0]} is outside {SEED_RANGE}", repeated, outside)
    return seeds


_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def safe_name(name: str, what: str) -> str:
    """``name`` if it is a safe file name (one path component, never ``.`` or ``..``), else
    ValueError saying what is allowed."""
    if len(name) > MAX_NAME or not _SAFE_NAME.fullmatch(name):
        raise ValueError(
            f"{what} {name!r} must be a plain folder name: letters, digits, '_', '.', '-', "
            f"starting with a letter, digit or '_', at most {MAX_NAME} characters"
        )
    return name


class ExperimentSpec(_Strict):
    """An A/B experiment: arms trained under the same seeds, budget, data and evaluation.

    The top-level ``training`` and ``model`` sections, and ``defaults`` (any arm field), are
    merged into every arm before validation; arms override single fields.
    """

    name: str = Field(
        description="Used as the run folder name: letters, digits, '_', '.', '-' (at most "
        f"{MAX_NAME} characters), starting with a letter, digit or '_'."
    )
    description: str = Field("", description="Free text shown at the top of the report.")
    seeds: list[StrictInt] = Field(min_length=1, description="Every arm runs once per seed.")
    baseline: str | None = Field(
        None, description="Arm the others are compared against (default: first)."
    )
    budget: Budget = Field(
        description="How much every arm x seed trains: exactly one of steps, samples or wall_clock_s."
    )
    defaults: dict[str, Any] = Field(
        default_factory=dict, description="Arm fields shared by every arm (an arm overrides them)."
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig,
        description="Training settings shared by every arm (an arm's training overrides fields).",
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="The policy (and reward model) shared by every arm.",
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="Training and evaluation data."
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig,
        description="How and how often every arm is evaluated, and the metric arms are compared on.",
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Where metrics go.")
    output_dir: str = Field(
        "runs", description="Folder the experiment's runs/<name> folder is written under."
    )
    overrides: list[str] = Field(
        default_factory=list,
        description="Written by alignzoo in the resolved experiment: the --set FIELD=VALUE "
        "overrides applied to the file (the report lists them).",
    )
    arms: dict[str, ArmSpec] = Field(
        min_length=1,
        description="The arms compared, by name: each a set of components and overrides.",
    )

    @field_validator("name")
    @classmethod
    def _experiment_name(cls, name: str) -> str:
        return safe_name(name, "experiment name")

    @field_validator("arms")
    @classmethod
    def _arm_names(cls, arms: dict[str, ArmSpec]) -> dict[str, ArmSpec]:
        for name in arms:
            safe_name(str(name), "arm name")
        return arms

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, seeds: list[int]) -> list[int]:
        return check_seeds(seeds)

    def with_seeds(self, seeds: list[int]) -> ExperimentSpec:
        """This experiment under other ``seeds`` (``alignzoo run --seeds``), checked by the
        rule the file's seeds follow (``model_copy`` alone skips the validators): SeedsError
        otherwise."""
        return self.model_copy(update={"seeds": check_seeds(list(seeds))})

    @model_validator(mode="after")
    def _baseline_is_an_arm(self) -> ExperimentSpec:
        if self.baseline is not None and self.baseline not in self.arms:
            raise ValueError(
                f"baseline {self.baseline!r} is not an arm; arms: {', '.join(self.arms)}"
            )
        return self

    @property
    def baseline_arm(self) -> str:
        return self.baseline or next(iter(self.arms))
