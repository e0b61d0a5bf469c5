"""The moving reference (``training.sync_ref_model``): TR-DPO's update of the reference policy
toward the policy being trained (Gorbatovski et al. 2024, "Learn Your Reference Model for Real
Good Alignment"), TRL 1.16's ``sync_ref_model``, ``ref_model_mixup_alpha`` and
``ref_model_sync_steps``, for every algorithm that loads a reference.

After every optimizer step whose count (the learner's policy version) is a multiple of
τ = ``ref_model_sync_steps``, each parameter of the reference becomes

    π_ref <- α π_θ + (1 - α) π_ref_prev        (TR-DPO's soft update; α = 1: a hard copy)

with α = ``ref_model_mixup_alpha``, computed in place as TRL's ``SyncRefModelCallback`` does
(``ref.mul_(1 - α).add_(θ, alpha=α)``), on the parameters only (buffers are left as loaded).
The policy's weights are read as a backend receives them (:class:`~alignzoo.weights.PolicyWeights`):
by their checkpoint names, whatever wraps the actor (DDP, torch.compile), FSDP2 shards gathered
(a collective: every rank syncs, after the same optimizer step) and a LoRA actor's adapters
merged into their base weights (its reference is then a full copy of its own, not the actor with
its adapters off; TRL refuses a PEFT model instead). Each tensor is cast to the reference's
dtype and moved to its device, so a reference on another device (the ``split`` mapper) follows.

The reference's log-probs of a batch are taken with its behaviour snapshot, before the update
that trains on it (the prepare stage; with ``labeling.overlap`` as the batch is generated, a
step ahead), so a sync inside a step with several optimizer steps reaches the next step's
batch, as TRL's GRPO reads the reference at generation time. The moved weights are saved in every
checkpoint (``reference.safetensors``) and loaded back on resume.
"""

from __future__ import annotations

import torch

from alignzoo.config.schema import TrainingConfig
from alignzoo.errors import RunError
from alignzoo.weights import PolicyWeights


def sync_due(cfg: TrainingConfig, version: int) -> bool:
    """Whether the optimizer step that made policy version ``version`` (1-based) is followed by
    a sync: TRL's ``global_step % ref_model_sync_steps == 0`` at ``on_step_end``."""
    return cfg.sync_ref_model and version > 0 and version % cfg.ref_model_sync_steps == 0


def syncs_done(cfg: TrainingConfig, version: int) -> int:
    """How many syncs the reference has had once the policy reached version ``version``."""
    return version // cfg.ref_model_sync_steps if cfg.sync_ref_model else 0


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """π_ref <- α π_θ + (1 - α) π_ref for every parameter of ``reference`` (in place), from the
    weights of ``policy`` (the actor: plain, wrapped, FSDP2-sharded or with LoRA adapters).

    Raises :class:`RunError` when a parameter of the reference has no counterpart in the
    policy's weights, or one of another shape (the two are not the same model)."""
    params = dict(reference.named_parameters(remove_duplicate=False))
    if not params:  # a LoRA arm's adapters-off view of the actor (load_models keeps a copy)
        raise RunError("training.sync_ref_model: the reference holds no weights of its own")
    done: set[int] = set()
    for name, tensor in PolicyWeights(policy, 0).named_tensors():
        param = params.get(name)
        if param is None or id(param) in done:  # a buffer, or a tied tensor's second name
            continue
        if param.shape != tensor.shape:
            raise RunError(
                f"training.sync_ref_model: the reference's {name} has shape "
                f"{tuple(param.shape)} and the policy's {tuple(tensor.shape)}"
            )
        # π_ref = α π_θ + (1 - α) π_ref_prev (TR-DPO), in TRL's order of operations
        param.mul_(1.0 - alpha).add_(tensor.to(param.device, param.dtype), alpha=alpha)
        done.add(id(param))
    missing = sorted(name for name, param in params.items() if id(param) not in done)
    if missing:
        raise RunError(
            f"training.sync_ref_model: the policy has no weights for the reference's "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
        )
