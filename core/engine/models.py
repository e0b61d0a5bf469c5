"""Loading the run's models: the actor (with LoRA, gradient checkpointing, attention choice),
the frozen reference and the critic (a token-classification value head), plus the tokenizer.

Everything goes through ``from_pretrained``, exactly the path a user's local checkpoint takes;
the embedded default only differs in where the folder comes from (the cached warm start).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from alignzoo.config.schema import ModelConfig
from alignzoo.errors import UserError
from alignzoo.types import Placement

if TYPE_CHECKING:
    from alignzoo.engine.served import ServedTeacher

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Models:
    """The one owner of a run's models and where they live.

    ``actor`` is the trainable policy (a peft model under LoRA); ``reference`` the frozen
    starting policy (None when the algorithm needs none; moved toward the actor by
    ``training.sync_ref_model``, :mod:`~alignzoo.engine.refsync`); ``critic`` the value model
    (PPO); ``teacher`` the frozen teacher of a distillation algorithm (on the reference's
    device, or a :class:`~alignzoo.engine.served.ServedTeacher` behind an endpoint);
    ``devices`` maps each role (actor, ref, critic, reward, rollout, labeler) to the device the
    device mapper placed it on, ``placements`` to its full :class:`~alignzoo.types.Placement`; ``autocast`` is the mixed-precision context of forward passes.
    Everything else (the learner, the stages, the hooks' ``run``) reads the models from here.
    """

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    actor: torch.nn.Module
    policy_path: str
    devices: dict[str, str] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    reference: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    teacher: torch.nn.Module | ServedTeacher | None = None  # model.teacher (distillation)
    autocast: Callable[[], Any] = contextlib.nullcontext

    def device(self, role: str) -> str:
        """The device placed for ``role`` (``cpu`` when the mapper did not place it)."""
        return self.devices.get(role, "cpu")

    def placement(self, role: str) -> Placement:
        """The full placement of ``role`` (device, GPU share, tensor-parallel size)."""
        return self.placements.get(role) or Placement(device=self.device(role))


def load_models(
    path: str,
    cfg: ModelConfig,
    devices: dict[str, str],
    reference: bool,
    critic: bool,
    seed: int,
    moving_reference: bool = False,
) -> Models:
    """Tokenizer, actor and, when asked for, the reference and the critic, each on its device.

    ``moving_reference`` (``training.sync_ref_model``): the reference will be moved toward the
    policy, so a LoRA arm gets a copy of its own rather than the actor with adapters off."""
    device = devices.get("actor", "cpu")
    models = Models(
        tokenizer=load_tokenizer(path),
        actor=load_actor(path, cfg, device),
        policy_path=path,
        devices=dict(devices),
    )
    shared = cfg.lora is not None and models.device("ref") == device and not moving_reference
    if reference and shared:
        models.reference = AdaptersOff(models.actor)  # the starting policy, no second copy
    elif reference:
        models.reference = load_reference(path, cfg, models.device("ref"))
    if critic:
        models.critic = load_critic(path, cfg, models.device("critic"), seed)
    models.autocast = autocast_factory(cfg, models.device("actor"))
    return models


def _quiet_transformers() -> contextlib.AbstractContextManager[Any]:
    """Silence the 'newly initialized weights' chatter while loading (the value head is new)."""
    from transformers.utils import logging as hf_logging

    @contextlib.contextmanager
    def quiet() -> Any:
        level = hf_logging.get_verbosity()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            hf_logging.set_verbosity(level)
            if bars:
                hf_logging.enable_progress_bar()

    return quiet()


def load_tokenizer(path: str, field: str = "model.policy") -> Any:
    """AutoTokenizer from ``path``; a pad token is guaranteed (EOS when the model has none).
    ``field``: the experiment field a loading error names."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{field}: cannot load a tokenizer from {path!r}: {exc}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _load_kwargs(cfg: ModelConfig, device: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    attn = cfg.attn_implementation
    if attn == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise UserError(
                "model.attn_implementation: flash_attention_2 asked for, but flash-attn is not "
                "installed (pip install alignzoo[flash]); use 'sdpa' or 'auto'"
            )
        if not device.startswith("cuda"):
            raise UserError("model.attn_implementation: flash_attention_2 needs a cuda device")
        kwargs["dtype"] = _DTYPES.get(cfg.dtype, torch.bfloat16)
    if attn != "auto":
        kwargs["attn_implementation"] = attn
    return kwargs


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX), where bf16 autocast
    is faster than fp32; elsewhere torch emulates it, more slowly."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(torch.cpu, probe, None)
        if callable(check) and check():
            return True
    return False


def cuda_has_bf16(device: str) -> bool:
    """Whether the GPU ``device`` trains in bfloat16 (what torch's autocast asks of it)."""
    with torch.cuda.device(torch.device(device)):
        return bool(torch.cuda.is_bf16_supported())


def gpu_name(device: str) -> str:
    """The model name of the GPU ``device``."""
    return str(torch.cuda.get_device_name(torch.device(device)))


def dtype_problem(dtype: str, device: str) -> str | None:
    """Why an actor on ``device`` cannot train in ``model.dtype`` ``dtype``, and what would
    work; None when it can. float16 autocast is for GPUs; bfloat16 on a GPU needs one that
    has it (every CPU can, emulated where it lacks AVX512-BF16 or AMX)."""
    on_gpu = device.startswith("cuda")
    if dtype == "float16" and not on_gpu:
        return (
            f"float16 autocast is for GPUs, and the actor is placed on {device}; use bfloat16 "
            "(fast where the CPU has AVX512-BF16 or AMX) or float32"
        )
    if dtype == "bfloat16" and on_gpu and not cuda_has_bf16(device):
        return (
            f"{device} ({gpu_name(device)}) does not support bfloat16; use float16 or float32 "
            "(auto trains in float32 on this GPU)"
        )
    return None


def autocast_dtype(cfg: ModelConfig, device: str) -> torch.dtype | None:
    """The dtype the forward passes autocast to from ``model.dtype`` (None: plain fp32).

    GPU: the asked dtype, and for ``auto`` bf16 where the GPU has it (else fp32); ``float32``
    none. CPU: bf16 when asked for with ``bfloat16``, else none (``auto``, ``float32``).
    A dtype the device cannot train in (:func:`dtype_problem`) is a :class:`UserError`.
    """
    problem = dtype_problem(cfg.dtype, device)
    if problem is not None:
        raise UserError(f"model.dtype: {problem}")
    if cfg.dtype == "float32":
        return None
    if device.startswith("cuda"):
        if cfg.dtype == "auto":
            return torch.bfloat16 if cuda_has_bf16(device) else None
        return _DTYPES[cfg.dtype]
    return torch.bfloat16 if cfg.dtype == "bfloat16" else None


def autocast_factory(cfg: ModelConfig, device: str) -> Callable[[], Any]:
    """The mixed-precision context of the run's forward passes (:func:`autocast_dtype`).
    The weights and the optimizer state stay fp32 either way."""
    dtype = autocast_dtype(cfg, device)
    if dtype is None:
        return contextlib.nullcontext
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return lambda: torch.autocast(kind, dtype=dtype)


def precision_note(cfg: ModelConfig, device: str) -> str | None:
    """A line for the run's log when the precision is not what the setting suggests: bf16 on
    this CPU slower than fp32, or ``auto`` in fp32 on a GPU without bf16."""
    if cfg.dtype == "bfloat16" and not device.startswith("cuda") and not cpu_has_native_bf16():
        return (
            "model.dtype bfloat16: this CPU has no AVX512-BF16 or AMX, so torch emulates bf16 "
            "and the run will be much slower than in float32 (about 30 times, measured on a "
            "25.8M Qwen2 on an AVX2-only CPU); the numbers are bf16's all the same"
        )
    if cfg.dtype == "auto" and device.startswith("cuda") and not cuda_has_bf16(device):
        return (
            f"model.dtype auto: {device} ({gpu_name(device)}) has no bfloat16, so the forward "
            "passes run in float32 (model.dtype: float16 for fp16 autocast)"
        )
    return None


def _from_pretrained(auto_cls: Any, path: str, what: str, **kwargs: Any) -> Any:
    try:
        with _quiet_transformers():
            return auto_cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        field = "model.teacher" if what == "teacher" else "model.policy"
        raise UserError(f"{field}: cannot load the {what} from {path!r}: {exc}") from None


def load_actor(path: str, cfg: ModelConfig, device: str) -> Any:
    """The trainable policy, with LoRA adapters when ``cfg.lora`` is set."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, path, "policy", **_load_kwargs(cfg, device))
    if cfg.disable_dropout:
        disable_dropout(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
            task_type="CAUSAL_LM",
        )
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, lora)
    return model.to(device).train()


def disable_dropout(model: Any) -> Any:
    """Set every dropout probability in ``model`` to 0 (modules and attention-dropout rates)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and not isinstance(rate, bool):
            module.attention_dropout = 0.0
    return model


def freeze(model: Any) -> Any:
    """Eval mode and no gradients, for good."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class AdaptersOff(torch.nn.Module):
    """The reference of a LoRA arm: the actor itself with its adapters switched off, which is
    exactly the starting policy (the base weights are frozen), without a second copy.

    Called like a model (eval mode, no gradients, adapters disabled for the call, the
    actor's own mode restored after). It holds no parameters of its own: ``parameters()``
    are the actor's, for placement only; the learner never sees this module.
    """

    def __init__(self, actor: Any) -> None:
        super().__init__()
        self.__dict__["_actor"] = actor  # not a submodule: not saved, counted or trained twice

    @property
    def actor(self) -> Any:
        """The LoRA actor this reference reads."""
        return self.__dict__["_actor"]

    def parameters(self, recurse: bool = True) -> Any:
        return self.actor.parameters(recurse)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        actor = self.actor
        was_training = actor.training
        actor.eval()
        try:
            with torch.no_grad(), actor.disable_adapter():
                return actor(*args, **kwargs)
        finally:
            actor.train(was_training)


def load_reference(path: str, cfg: ModelConfig, device: str) -> Any:
    """The frozen reference policy (the starting weights, without adapters)."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, path, "reference", **_load_kwargs(cfg, device))
    return freeze(model.to(device))


def load_teacher(path: str, cfg: ModelConfig, device: str, policy: Models) -> Any:
    """The frozen teacher (``model.teacher``) from ``path``, refused with both tokenizers named
    when its tokenizer is not the policy's (its log-probs would score other tokens)."""
    from transformers import AutoModelForCausalLM

    teacher_tokenizer = load_tokenizer(path, "model.teacher")
    own, theirs = policy.tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if own != theirs:
        differ = len(set(own.items()) ^ set(theirs.items()))
        raise UserError(
            f"model.teacher: the teacher's tokenizer ({path}, {len(theirs)} tokens) is not the "
            f"policy's ({policy.policy_path}, {len(own)} tokens; {differ} token ids differ): "
            "distillation compares log-probs token by token, so both must tokenize alike"
        )
    model = _from_pretrained(AutoModelForCausalLM, path, "teacher", **_load_kwargs(cfg, device))
    return freeze(model.to(device))


def load_critic(path: str, cfg: ModelConfig, device: str, seed: int) -> Any:
    """A value model: the policy's body with a fresh one-output token head (seeded init)."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)
    model = _from_pretrained(
        AutoModelForTokenClassification, path, "critic", num_labels=1, **_load_kwargs(cfg, device)
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    if cfg.disable_dropout:
        disable_dropout(model)
    return model.to(device).train()


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """Parameters that require gradients (only the adapters under LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]
