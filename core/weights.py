"""The actor's weights as a backend receives them: (name, tensor) pairs with a version.

After the run's models load, and after each training step's update, the engine calls every
backend's ``sync_weights(weights)`` with a :class:`PolicyWeights`. It never hands over the
module: a backend with its own copy of the policy (another device, another process, a vLLM
engine) loads the pairs into it, and one that samples with the trainer's own module in the
same process (the ``hf`` backend's default) only notes the version.

The pairs are those of the policy's plain Hugging Face checkpoint, whatever wraps it during
training:

- names are the checkpoint's own (``model.layers.0.self_attn.q_proj.weight``, as
  ``save_pretrained`` writes them), without the prefixes of peft, DDP or ``torch.compile``;
- LoRA adapters are merged into their base weights (``W + scaling * B @ A`` per active
  adapter, computed aside: the training weights are not touched) and the adapter tensors left
  out, so the receiver loads a plain model;
- FSDP2-sharded parameters (DTensors) are gathered into full tensors;
- tensors are detached, and cast to the dtype and moved to the device the backend asks for.

They are produced lazily, one at a time, so a backend that streams them into its engine never
holds a second full copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


class PolicyWeights:
    """The actor's weights at one version, as the (name, tensor) pairs of its HF checkpoint.

    ``version`` counts the optimizer steps applied to the policy: 0 for the starting weights,
    then the learner's step count after each training step's update (so a resumed run continues
    the count). Iterating yields ``(name, tensor)`` pairs as :meth:`named_tensors` does with no
    cast.
    """

    def __init__(self, module: torch.nn.Module, version: int) -> None:
        self._module = module
        self.version = int(version)

    def __repr__(self) -> str:
        return f"PolicyWeights(version={self.version})"

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.named_tensors()

    def names(self) -> list[str]:
        """The checkpoint names of every tensor, in the order :meth:`named_tensors` yields them."""
        return [name for name, _ in _checkpoint_items(self._module)]

    def named_tensors(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` per checkpoint tensor, LoRA merged and shards gathered.

        ``dtype`` casts floating-point tensors (integer buffers keep theirs); ``device`` moves
        them. The tensors are detached; without a cast or a move they may share memory with the
        training weights, so a receiver must copy them (``load_state_dict`` and
        ``Tensor.copy_`` do) and never write into them.
        """
        with torch.no_grad():
            for name, tensor in _checkpoint_items(self._module):
                value = tensor.detach()
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                if device is not None:
                    value = value.to(device)
                yield name, value

    def state_dict(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        """All pairs at once, as a dict for ``load_state_dict`` (a full copy when cast or moved)."""
        return dict(self.named_tensors(dtype=dtype, device=device))


def _checkpoint_items(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain checkpoint's (name, tensor) pairs of ``module``, which may be wrapped."""
    base = _unwrap(module)
    get_base: Any = getattr(base, "get_base_model", None)
    peft = callable(get_base)
    if peft:
        base = get_base()
    deltas = _lora_deltas(base) if peft else {}
    for key, tensor in base.state_dict(keep_vars=False).items():
        name = _checkpoint_name(key)
        if name is None:
            continue
        full = getattr(tensor, "full_tensor", None)  # an FSDP2 DTensor shard: gather it
        if callable(full):
            tensor = full()
        delta = deltas.get(name)
        if delta is not None:
            tensor = tensor + delta.to(tensor.dtype)
        yield name, tensor


def is_sharded(module: Any) -> bool:
    """Whether ``module`` (or the model inside its DDP/compile wrappers) is FSDP2-sharded
    (``training.parallel: fsdp2``): each rank then holds a slice of every parameter, and a
    forward pass is a collective of all ranks."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(_unwrap(module), FSDPModule)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (``.module``) or ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None and isinstance(module, torch.nn.parallel.DistributedDataParallel):
            inner = module.module
        if inner is None:
            return module
        module = inner


def _checkpoint_name(key: str) -> str | None:
    """The checkpoint name of a (possibly peft-wrapped) state-dict key; None for adapter tensors."""
    parts = key.split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None  # adapter weights (merged into their base), and modules_to_save's originals
    for prefix in _WRAPPER_PREFIXES:
        while key.startswith(prefix):
            key = key[len(prefix) :]
    key = key.replace(".base_layer.", ".")
    if ".modules_to_save." in key:  # a fully trained module's copy: it replaces the original
        head, _, tail = key.partition(".modules_to_save.")
        key = head + "." + tail.partition(".")[2]
    return key


def _lora_deltas(base: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``name.weight -> scaling * B @ A`` summed over active adapters, for each unmerged LoRA layer."""
    deltas: dict[str, torch.Tensor] = {}
    for name, layer in base.named_modules():
        get_delta = getattr(layer, "get_delta_weight", None)
        adapters = getattr(layer, "active_adapters", None)
        if not callable(get_delta) or not adapters or getattr(layer, "merged", False):
            continue
        if getattr(layer, "disable_adapters", False):
            continue
        known: Any = getattr(layer, "lora_A", {})
        total = None
        for adapter in adapters:
            if adapter in known:
                delta = get_delta(adapter)
                total = delta if total is None else total + delta
        if total is not None:
            deltas[_checkpoint_name(name + ".weight") or name + ".weight"] = total
    return deltas
