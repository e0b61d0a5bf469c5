"""Runs inside vLLM's worker processes: the ``vllm`` backend's weight receiver.

vLLM imports this module in each worker (``LLM(worker_extension_cls=...)``) and mixes
:class:`WeightReceiver` into its worker class, so the backend can call
``llm.collective_rpc("alignzoo_load_weights", args=(blob,))`` on every worker (each
tensor-parallel rank loads its own shard through the model's ``load_weights``).

On CPU, vLLM 0.32 prepacks each linear layer's weight into a oneDNN handle after loading and
drops the plain tensor; its in-place reload then leaves the handles stale (greedy outputs of
the reloaded engine differ from a freshly loaded one). On CPU only, linear layers here run
``torch.nn.functional.linear`` on their own weight tensor instead, which the reload updates
in place (after a reload, outputs equal a fresh engine's on the same weights; this is what
tests/plugins/backends/test_vllm.py checks). GPUs keep vLLM's kernels.
"""

from __future__ import annotations

import torch


def _plain_cpu_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    """A linear layer that reads its own (reloadable) weight tensor on every call."""
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


def _patch_cpu_linear() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm.model_executor.layers.utils as layer_utils

        layer_utils.dispatch_cpu_unquantized_gemm = _plain_cpu_linear


_patch_cpu_linear()


class WeightReceiver:
    """Mixed into vLLM's worker: load one blob of the trainer's weight stream."""

    def alignzoo_load_weights(self, blob: bytes) -> int:
        """Load the (name, tensor) pairs serialised in ``blob`` (safetensors) in place;
        returns how many tensors it held."""
        from safetensors.torch import load

        named = load(blob)
        self.reload_weights(  # type: ignore[attr-defined]  # the vLLM worker's own method
            weights_iterator=iter(named.items()), is_checkpoint_format=True
        )
        return len(named)
