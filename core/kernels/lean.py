"""A lean forward pass for Qwen2 and Llama causal LMs, on the model's own modules.

transformers' forward is general: it builds a mask object, dispatches attention through an
interface table, records outputs for hooks, updates a cache object and wraps everything in
output dataclasses. For a small model each of those costs more than the arithmetic (a 148k
Qwen2's decode step is mostly Python), so the engine drives the same layers itself when it can:

    h_0 = E[x]                                              (embed_tokens)
    for each layer l:
        a   = RMSNorm(h)                                    (input_layernorm)
        q, k, v = W_q a, W_k a, W_v a                       (q_proj, k_proj, v_proj, with biases)
        q, k = RoPE(q, pos), RoPE(k, pos)                   (rotary_emb's cos / sin)
        h   = h + W_o softmax(q k^T / sqrt(d) + mask) v     (one scaled_dot_product_attention)
        m   = RMSNorm(h)                                    (post_attention_layernorm)
        h   = h + W_down (silu(W_gate m) * W_up m)          (mlp)
    logits = W_lm RMSNorm(h)                                (norm, lm_head)

Every weight is read through the model's own ``nn.Linear`` / ``nn.Embedding`` modules, so a
LoRA adapter (peft replaces those modules), its disable switch, autocast and autograd all
apply as they do in transformers' forward. The mask is the same as transformers': key ``j`` is
visible from query ``i`` when ``j <= i`` and ``j`` is not padding; a padding query sees only
itself (its output is never read, and it stays finite).

:func:`lean_reason` says why a model cannot take this path (another architecture, sliding
windows, a non-default RoPE, gradient checkpointing, a wrapper that must see the call, ...);
callers then use the model's own forward. tests/core/engine/test_lean.py checks the logits
(and gradients) against transformers' forward for both architectures, padded batches, grouped
KV heads and the KV-cache decode path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

SUPPORTED = ("Qwen2ForCausalLM", "LlamaForCausalLM")


def unwrapped_model(model: Any) -> Any:
    """The module whose layers the lean path runs: a peft model's (adapter-injected) base model,
    ``model`` itself otherwise."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def lean_reason(model: Any) -> str | None:
    """None when :func:`lean_logits` can run ``model``; otherwise why not (for logs and tests)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "wrapped in DistributedDataParallel (its forward starts the gradient reduction)"
    base = unwrapped_model(model)
    name = type(base).__name__
    if name not in SUPPORTED:
        return f"{name} is not one of {', '.join(SUPPORTED)}"
    from alignzoo.weights import is_sharded

    if is_sharded(base):
        return "sharded (FSDP2 gathers each block's weights in that block's own forward)"
    if getattr(base.model, "gradient_checkpointing", False):
        return "gradient checkpointing is on"
    config = base.config
    attention = getattr(config, "_attn_implementation", "sdpa")
    if attention != "sdpa":  # eager's fp32 softmax, or a kernel the user chose (flash-attn)
        return f"attn_implementation {attention!r} (the lean forward has sdpa)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the lean forward has SwiGLU with silu)"
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])):
        return "sliding-window attention layers"
    rope = getattr(base.model.rotary_emb, "rope_type", "default")
    if rope != "default":
        return f"rope_type {rope!r} (the lean forward has the default RoPE)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if getattr(config, "attention_dropout", 0.0) and base.training:
        return "attention dropout in training mode"
    for module in (base, base.model, *base.model.layers):
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{type(module).__name__} has forward hooks the lean path would skip"
    return None


def can_run_lean(model: Any) -> bool:
    """Whether :func:`lean_logits` can run ``model`` (:func:`lean_reason` is None)."""
    return lean_reason(model) is None


@dataclass
class LayerShape:
    """The attention's shape and the norms' epsilon of a model the lean path runs."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float


def layer_shape(base: Any) -> LayerShape:
    config = base.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return LayerShape(heads, kv_heads, head_dim, float(config.rms_norm_eps))


# The fused functions below work through their rows in chunks of at most this many elements
# of the widest tensor involved (4 MB in fp32), so what they allocate for a moment
# (silu(gate) * up, a chunk's normalised rows, the gradient of the product) is freed before
# anything else is allocated: no hole is left between the activations kept for the backward
# pass. A hole the next, larger activation does not fit is how the CPU heap fragments
# (alignzoo.engine.malloc); at 64 x 518 tokens of the 25.8M model the forward's heap went
# from 12.2 to 7.8 GB for the same 7.5 GB of kept activations. (Chunks of 2^19 to 2^22
# elements ran a 64 x 134-token step equally fast.)
CHUNK_ELEMENTS = 1 << 20


def _row_chunks(rows: int, width: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


class _RMSNorm(torch.autograd.Function):
    """``w * x * r`` with ``r = 1 / sqrt(mean(x^2) + eps)``, keeping only ``x`` and ``r`` for
    the backward pass.

    On the CPU ``F.rms_norm`` is composed of elementwise ops whose autograd keeps the
    normalised ``x * r`` beside ``x`` (a second ``[tokens, hidden]`` tensor for each of a
    layer's two norms); here it is recomputed in the backward pass:

        dL/dw = sum_tokens g * x r
        dL/dx = r (g w - x r * mean(g w * x r))          (mean over the hidden dimension)
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        flat = x.reshape(-1, width)
        out = torch.empty_like(flat)
        rstd = torch.empty((flat.shape[0], 1), dtype=x.dtype, device=x.device)
        for rows in _row_chunks(flat.shape[0], width):
            # r = 1 / sqrt(|x|^2 / width + eps), with nothing of x's size but the output
            r = torch.linalg.vector_norm(flat[rows], dim=-1, keepdim=True, out=rstd[rows])
            r.square_().div_(width).add_(eps).rsqrt_()
            torch.mul(flat[rows], r, out=out[rows]).mul_(weight)
        ctx.save_for_backward(x, rstd, weight)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward(x, rstd, weight, grad, *ctx.needs_input_grad[:2])
        return grad_x, grad_weight, None


def rms_norm_backward(
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    grad: torch.Tensor,
    need_x: bool = True,
    need_weight: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``x`` and ``weight`` of ``w * x * r`` (:class:`_RMSNorm`'s equations)
    for the output's ``grad``, with ``rstd`` (``r`` per row, ``[rows, 1]``), chunk by chunk
    of rows; None for one not asked."""
    width = x.shape[-1]
    flat, g = x.reshape(-1, width), grad.reshape(-1, width)
    grad_x = torch.empty_like(flat) if need_x else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    for rows in _row_chunks(flat.shape[0], width):
        normed, r = flat[rows] * rstd[rows], rstd[rows]
        if grad_weight is not None:
            grad_weight += torch.linalg.vecdot(g[rows], normed, dim=0)
        if grad_x is not None:
            # g w r - x r * (r mean(g w * x r)), into grad_x: the products summed without a
            # tensor of their own (vecdot)
            gw = torch.mul(g[rows], weight, out=grad_x[rows])
            mean_r = torch.linalg.vecdot(gw, normed, dim=-1).unsqueeze(-1).div_(width).mul_(r)
            gw.mul_(r).addcmul_(normed, mean_r, value=-1.0)
    return None if grad_x is None else grad_x.view(x.shape), grad_weight


# Activations of fewer elements than this take the plain autograd ops instead of _RMSNorm and
# _SwiGLUDown: what recomputing saves there is a few MB, and a Python-level backward costs
# more than that (a 148k-parameter model's step was 7-10% slower with them).
RECOMPUTE_FROM = 1 << 20


def _rms_norm(x: torch.Tensor, norm: Any, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: in float32, ``weight * (x / sqrt(mean(x^2) + eps))``."""
    weight = norm.weight
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if (
            x.device.type == "cpu"
            and x.numel() >= RECOMPUTE_FROM
            and torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad)
        ):
            return _RMSNorm.apply(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel, the same numbers
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it: ``x cos + rotate_half(x) sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class KVCache:
    """Keys and values ``[rows, kv_heads, capacity, head_dim]`` per layer, filled column by
    column (allocated at the first write, in the dtype the projections give: autocast's under
    bf16); ``length`` columns hold data and ``valid [rows, capacity]`` says which of them are
    real tokens (not padding)."""

    valid: torch.Tensor
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    length: int = 0

    @classmethod
    def empty(cls, model: Any, rows: int, capacity: int, device: torch.device) -> KVCache:
        """An empty cache for ``rows`` sequences of at most ``capacity`` tokens."""
        layers = len(unwrapped_model(model).model.layers)
        return cls(
            valid=torch.zeros((rows, capacity), dtype=torch.bool, device=device),
            keys=[None] * layers,
            values=[None] * layers,
        )

    def repeat_interleave(self, n: int) -> KVCache:
        """Each row repeated ``n`` times in place of itself (a prompt's cache for its n samples)."""

        def repeat(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
            return [None if t is None else t.repeat_interleave(n, dim=0) for t in tensors]

        return KVCache(
            valid=self.valid.repeat_interleave(n, dim=0),
            keys=repeat(self.keys),
            values=repeat(self.values),
            length=self.length,
        )

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``[rows, kv_heads, T, head_dim]`` at columns ``start .. start + T - 1``
        of ``layer``; the layer's keys and values up to there."""
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            rows, heads, _, dim = k.shape
            size = (rows, heads, self.valid.shape[1], dim)
            keys = self.keys[layer] = k.new_empty(size)
            values = self.values[layer] = v.new_empty(size)
        end = start + k.shape[2]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]


class _SwiGLUDown(torch.autograd.Function):
    """``residual + W_down (silu(g) * u)``, keeping only ``g`` and ``u`` for the backward pass.

    Autograd through the separate ops keeps four ``[tokens, intermediate]`` tensors per layer:
    ``g`` (for silu), ``silu(g)`` and ``u`` (for the product) and the product (for
    ``W_down``'s gradient). Here ``silu(g)`` and the product are recomputed in the backward
    pass, chunk by chunk of rows (:data:`CHUNK_ELEMENTS`): the same numbers, half of the MLP's
    saved activations, which are most of a layer's (about 29% less per layer at Qwen2's
    shapes). The residual is added by the down projection's GEMM (``addmm``), so the layer's
    output is the one tensor it allocates; its gradient is the output's gradient as it is.

        dL/dW_down = sum_tokens g_out^T (silu(g) * u)
        dL/du      = (g_out W_down) * silu(g)
        dL/dg      = (g_out W_down) * u * silu'(g)
    """

    @staticmethod
    def forward(
        ctx: Any,
        gate: torch.Tensor,
        up: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        width = gate.shape[-1]
        g, u = gate.reshape(-1, width), up.reshape(-1, width)
        out = torch.empty_like(residual)
        flat_out, flat_residual = out.view(-1, out.shape[-1]), residual.reshape(-1, out.shape[-1])
        for rows in _row_chunks(g.shape[0], width):
            product = F.silu(g[rows]).mul_(u[rows])
            torch.addmm(flat_residual[rows], product, weight.t(), out=flat_out[rows])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_weight, need_residual = ctx.needs_input_grad
        grads = swiglu_down_backward(gate, up, weight, grad, need_gate, need_up, need_weight)
        return (*grads, grad if need_residual else None)


def swiglu_down_backward(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    grad: torch.Tensor,
    need_gate: bool = True,
    need_up: bool = True,
    need_weight: bool = True,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``g``, ``u`` and ``W_down`` of ``W_down (silu(g) * u)``
    (:class:`_SwiGLUDown`'s equations) for the output's ``grad``, recomputing ``silu(g)``
    and the product chunk by chunk of rows; None for one not asked. ``out``: the ``[tokens,
    intermediate]`` tensors (views allowed) to write the gate's and up's gradients to."""
    width = gate.shape[-1]
    g, u = gate.reshape(-1, width), up.reshape(-1, width)
    grad_out = grad.reshape(-1, grad.shape[-1])
    grad_gate: torch.Tensor | None
    grad_up: torch.Tensor | None
    if out is not None:
        grad_gate, grad_up = out
    else:
        grad_gate = torch.empty_like(gate) if need_gate else None
        grad_up = torch.empty_like(up) if need_up else None
    gate_rows = None if grad_gate is None else grad_gate.reshape(-1, width)
    up_rows = None if grad_up is None else grad_up.reshape(-1, width)
    grad_weight = torch.zeros_like(weight) if need_weight else None
    for rows in _row_chunks(g.shape[0], width):
        act = F.silu(g[rows])
        if grad_weight is not None:
            grad_weight.addmm_(grad_out[rows].t(), act * u[rows])
        if gate_rows is None and up_rows is None:
            continue
        grad_product = grad_out[rows].mm(weight)
        if up_rows is not None:
            torch.mul(grad_product, act, out=up_rows[rows])
        if gate_rows is not None:
            torch.ops.aten.silu_backward.grad_input(
                grad_product.mul_(u[rows]), g[rows], grad_input=gate_rows[rows]
            )
    return grad_gate, grad_up, grad_weight


class _RotateInPlace(torch.autograd.Function):
    """RoPE applied in place to a projection's output ``x [B, T, heads * D]`` (which nothing
    else keeps), as :func:`_rotate` computes it, allocating half of ``x`` for a moment instead
    of four tensors of its size. The default RoPE's ``cos`` and ``sin`` ``[B, T, D]`` repeat
    their first half (``cat(freqs, freqs)``), so with ``x = [x1, x2]`` per head:

        y1 = x1 cos - x2 sin          dL/dx1 =  g1 cos + g2 sin
        y2 = x2 cos + x1 sin          dL/dx2 = -g1 sin + g2 cos
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
    ) -> torch.Tensor:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)  # [B, T, 1, D/2]
        per_head = x.view(*x.shape[:-1], heads, 2 * half)
        x1, x2 = per_head[..., :half], per_head[..., half:]
        first = x1.clone()
        x1.mul_(c).addcmul_(x2, s, value=-1.0)
        x2.mul_(c).addcmul_(first, s)
        ctx.mark_dirty(x)
        ctx.save_for_backward(c, s)
        ctx.heads = heads
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        c, s = ctx.saved_tensors
        half = c.shape[-1]
        g = grad.reshape(*grad.shape[:-1], ctx.heads, 2 * half)
        out = torch.empty(g.shape, dtype=grad.dtype, device=grad.device)
        rotate_backward(g, c, s, out)
        return out.view(grad.shape), None, None, None


def rotate_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """RoPE's input gradient (:class:`_RotateInPlace`'s equations) written to ``out``, for the
    rotated output's ``grad [..., D]`` with the first halves ``cos``, ``sin`` ``[..., D/2]``
    of the default RoPE's (broadcast against ``grad``'s halves)."""
    half = cos.shape[-1]
    g1, g2 = grad[..., :half], grad[..., half:]
    d1, d2 = out[..., :half], out[..., half:]
    torch.mul(g1, cos, out=d1).addcmul_(g2, sin)
    torch.mul(g2, cos, out=d2).addcmul_(g1, sin, value=-1.0)
    return out


def _plain_linear(module: Any) -> bool:
    """A bare ``nn.Linear`` without bias or hooks (not a LoRA layer or a wrapped one)."""
    return (
        type(module) is torch.nn.Linear
        and module.bias is None
        and not (module._forward_hooks or module._forward_pre_hooks)
    )


Linear = Any  # a callable ``(module, x) -> module(x)``: how lean_logits runs a projection


def _call(module: Any, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class PackedLinears:
    """MKL-packed copies of a model's plain fp32 projection weights, for the decode loop.

    A decode step multiplies a few dozen rows by every weight; MKL's packed GEMM
    (``torch.ops.mkl._mkl_linear``, the one torch's inductor uses for CPU linears) skips
    repacking each weight on every call, 15-25% faster at 64 rows on AVX512 (the same numbers
    to the last bit or two of fp32). The copies are taken once per generation and are stale
    after the weights change: a decoder packs the weights it samples with and drops them at
    its end. Called as ``packed(module, x)``; a module not packed (a LoRA layer, one with
    hooks, a non-fp32 or non-CPU weight, or torch built without MKL) runs its own forward.

    The projections that read the same input, a layer's q, k and v and its MLP's gate and up,
    are packed as one matrix each where all of them are (:meth:`split` runs them as one GEMM:
    fewer, wider calls; a tenth off the decode steps' projections at 64 rows of the 25.8M
    model).
    """

    def __init__(self, model: Any, rows: int) -> None:
        self.rows = rows
        self.packed: dict[int, torch.Tensor] = {}
        # owner module -> (packed, weight, bias, each part's width) of its joint projections
        self.joint: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]]
        self.joint = {}
        self.every_layer_joint = False  # whether :meth:`decodes` may say yes
        if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
            return
        layers = unwrapped_model(model).model.layers
        with torch.no_grad():
            for module in layers.modules():
                weight = getattr(module, "weight", None)
                if (
                    type(module) is torch.nn.Linear
                    and not (module._forward_hooks or module._forward_pre_hooks)
                    and weight is not None
                    and weight.dtype == torch.float32
                    and weight.device.type == "cpu"
                ):
                    self.packed[id(module)] = torch.ops.mkl._mkl_reorder_linear_weight(
                        weight.detach(), rows
                    )
            for layer in layers:
                attn, mlp = layer.self_attn, layer.mlp
                for owner, parts in (
                    (attn, (attn.q_proj, attn.k_proj, attn.v_proj)),
                    (mlp, (mlp.gate_proj, mlp.up_proj)),
                ):
                    self._join(owner, parts)
        self.every_layer_joint = all(
            id(layer.self_attn) in self.joint and id(layer.mlp) in self.joint for layer in layers
        )

    def _join(self, owner: Any, parts: tuple[Any, ...]) -> None:
        if owner._forward_hooks or owner._forward_pre_hooks:
            return
        if not all(id(p) in self.packed for p in parts):
            return
        biases = [p.bias for p in parts]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            return
        weight = torch.cat([p.weight.detach() for p in parts])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, self.rows)
        self.joint[id(owner)] = (packed, weight, bias, [p.weight.shape[0] for p in parts])
        for p in parts:
            del self.packed[id(p)]

    def split(self, owner: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The joint projections of ``owner`` (an attention's q, k, v; an MLP's gate, up) of
        ``x``, from one packed GEMM (views of its output); None where they are not packed
        together."""
        joint = self.joint.get(id(owner))
        if joint is None or torch.is_grad_enabled() or x.dtype != torch.float32:
            return None
        widths = joint[3]
        out = self._joint(joint, x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1]).split(widths, dim=-1)

    def _joint(
        self,
        joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]],
        flat: torch.Tensor,
    ) -> torch.Tensor:
        packed, weight, bias, _ = joint
        return torch.ops.mkl._mkl_linear(flat, packed, weight, bias, self.rows)

    def decodes(self, x: torch.Tensor) -> bool:
        """Whether :func:`_decode_step` can run the model's layers over ``x``: without
        gradients, in fp32, every layer's q/k/v and gate/up packed together."""
        return self.every_layer_joint and not torch.is_grad_enabled() and x.dtype == torch.float32

    def joint_projection(self, owner: Any, x: torch.Tensor) -> torch.Tensor:
        """``owner``'s joint projections of ``x [rows, in]`` side by side ``[rows, sum of
        outs]``, as :meth:`split` computes them (for a model :meth:`decodes` accepts)."""
        return self._joint(self.joint[id(owner)], x)

    def __call__(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(id(module))
        if packed is None or torch.is_grad_enabled() or x.dtype != torch.float32:
            return module(x)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(flat, packed, module.weight, module.bias, self.rows)
        return out.view(*x.shape[:-1], out.shape[-1])


def _fused_training(x: torch.Tensor) -> bool:
    """Whether a layer reading ``x`` rotates in place (_RotateInPlace) and lets the GEMM add
    the residual: a CPU fp32 forward with gradients, outside autocast, of activations of
    :data:`RECOMPUTE_FROM` or more elements. (_SwiGLUDown decides by its own inputs.)"""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.numel() >= RECOMPUTE_FROM
        and torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
    )


def _mlp_residual(
    mlp: Any, x: torch.Tensor, residual: torch.Tensor, linear: Linear = _call
) -> torch.Tensor:
    """``residual + W_down (silu(W_gate x) * W_up x)``, the SwiGLU MLP added to the residual
    stream: through :class:`_SwiGLUDown` when it trains a plain ``down_proj`` on intermediate
    activations of :data:`RECOMPUTE_FROM` or more elements (fewer saved activations, one
    allocation), through ``linear``'s projections when packed for decoding, the module's own
    forward otherwise (no gradients, autocast, an adapter or hooks on the MLP)."""
    down = mlp.down_proj
    hooked = bool(mlp._forward_hooks or mlp._forward_pre_hooks)
    if linear is not _call and not hooked:
        gate, up = mlp_projections(mlp, x, linear)
        return residual + linear(down, mlp.act_fn(gate) * up)
    if (
        hooked
        or not _plain_linear(down)
        or not torch.is_grad_enabled()
        or torch.is_autocast_enabled(x.device.type)
    ):
        return residual + mlp(x)
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    # By the intermediate activations' size: at 64 x 12 tokens of the 25.8M model these are
    # 1.08M elements where x is 393k.
    if (
        gate.dtype != down.weight.dtype
        or up.dtype != down.weight.dtype
        or residual.dtype != gate.dtype
        or gate.numel() < RECOMPUTE_FROM
    ):
        return residual + down(mlp.act_fn(gate) * up)
    return _SwiGLUDown.apply(gate, up, down.weight, residual)


def _split(linear: Linear, owner: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """``owner``'s joint projections of ``x`` where ``linear`` packed them together
    (:meth:`PackedLinears.split`), else None."""
    split = getattr(linear, "split", None)
    return split(owner, x) if callable(split) else None


def mlp_projections(mlp: Any, x: torch.Tensor, linear: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's gate and up projections of ``x`` through ``linear`` (one packed GEMM where
    :class:`PackedLinears` packed them together)."""
    joint = _split(linear, mlp, x)
    if joint is not None:
        gate, up = joint
        return gate, up
    return linear(mlp.gate_proj, x), linear(mlp.up_proj, x)


def _linear_residual(
    module: Any, x: torch.Tensor, residual: torch.Tensor, linear: Linear = _call
) -> torch.Tensor:
    """``residual + module(x)``: one ``addmm`` (no separate projection output) for a plain
    linear layer in a fused training forward, the two ops otherwise."""
    if linear is _call and _plain_linear(module) and _fused_training(x):
        weight = module.weight
        if weight.dtype == x.dtype == residual.dtype:
            flat = torch.addmm(
                residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t()
            )
            return flat.view(residual.shape)
    return residual + linear(module, x)


def _project_rotated(
    module: Any,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    head_dim: int,
    linear: Linear = _call,
) -> torch.Tensor:
    """The query or key projection of ``x [B, T, H]`` with RoPE applied, ``[B, heads, T, D]``
    (a view of ``[B, T, heads, D]`` memory, which sdpa reads as it is): rotated in place by
    :class:`_RotateInPlace` in a fused training forward, by :func:`_rotate` otherwise.
    ``cos`` and ``sin`` are the rotary embedding's ``[B, T, D]``."""
    rows, width = x.shape[:2]
    # In place only on a bare nn.Linear's output (its backward keeps its input, not its
    # output; another module's output may be kept by its own backward), computed here as one
    # 2-D GEMM: rotating a view of it in place would make autograd rebuild the whole base
    # tensor in the backward pass (as_strided), a copy of its size per projection.
    if (
        linear is _call
        and type(module) is torch.nn.Linear
        and not (module._forward_hooks or module._forward_pre_hooks)
        and _fused_training(x)
        and module.weight.dtype == x.dtype == cos.dtype
    ):
        weight: torch.Tensor = module.weight
        flat, dim = x.reshape(-1, x.shape[-1]), cos.shape[-1]
        if module.bias is None:
            projected = flat.mm(weight.t())
        else:
            projected = torch.addmm(module.bias, flat, weight.t())
        rotated = _RotateInPlace.apply(projected, cos.reshape(-1, dim), sin.reshape(-1, dim), heads)
        return rotated.view(rows, width, heads, head_dim).transpose(1, 2)
    projected = linear(module, x)
    per_head = projected.view(rows, width, heads, head_dim).transpose(1, 2)
    return _rotate(per_head, cos.unsqueeze(1), sin.unsqueeze(1))


class Recorder(Protocol):
    """What :func:`lean_hidden` hands a layer's activations to while it decodes
    (:class:`alignzoo.kernels.trace.DecodeTrace`): ``rows`` rows, each prompt's n samples."""

    rows: int

    def record_positions(self, start: int, positions: torch.Tensor) -> None: ...

    def record_attention(
        self,
        layer: int,
        start: int,
        h: torch.Tensor,
        q: torch.Tensor,
        o: torch.Tensor,
        logsumexp: torch.Tensor | None = None,
    ) -> None: ...

    def record_mlp(
        self,
        layer: int,
        start: int,
        mlp: Any,
        normed: torch.Tensor,
        residual: torch.Tensor,
        linear: Linear,
    ) -> torch.Tensor: ...

    def record_final(self, start: int, h: torch.Tensor) -> None: ...

    def decode_slots(self, layer: int, column: int, logsumexp: bool) -> DecodeSlots: ...


@dataclass
class DecodeSlots:
    """Where a decode step writes one layer's activations for a :class:`Recorder`: views
    ``[rows, ...]`` of its buffers at the step's column, which the step computes into (no
    copies of its own). ``h``: the layer's input, for the first layer only (each later
    layer's input is the previous one's ``out``); ``q`` ``[rows, heads, D]`` rotated;
    ``o`` the attention's output before ``o_proj``; ``logsumexp`` ``[rows, heads]`` its
    softmax's log-normalisers (None: not kept); ``m`` the residual after the attention;
    ``gate_up`` the MLP's two projections side by side; ``out`` the layer's output."""

    h: torch.Tensor | None
    q: torch.Tensor
    o: torch.Tensor
    logsumexp: torch.Tensor | None
    m: torch.Tensor
    gate_up: torch.Tensor
    out: torch.Tensor


def visible_keys(
    key_valid: torch.Tensor, start: int, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """Which keys each query sees, ``[B, 1, T, S]`` bool, for the ``T = S - start`` queries at
    columns ``start .. S - 1`` over the keys ``key_valid [B, S]`` says are real tokens: query i
    (column start + i) sees key j when j <= start + i and j is real, and always itself (so a
    padding row's attention is never empty). ``segments [B, T]`` (packed samples, no cache:
    ``start`` 0) keeps each query to its own sample's keys."""
    keys_len = key_valid.shape[1]
    query_col = torch.arange(start, keys_len, device=key_valid.device)
    key_col = torch.arange(keys_len, device=key_valid.device)
    causal = key_col[None, :] <= query_col[:, None]  # [T, S]
    mask = (causal[None] & key_valid[:, None, :]) | (
        key_col[None, None, :] == query_col[None, :, None]
    )
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    return mask.unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as sdpa adds it to the scores: 0 where a key is seen, -inf where not."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))


def lean_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int = 0,
    cache: KVCache | None = None,
    linear: Linear | None = None,
    trace: Recorder | None = None,
) -> torch.Tensor:
    """Logits ``[B, T or logits_to_keep, V]`` of ``input_ids [B, T]`` (attention mask and
    position ids as transformers takes them), the same as ``model(...).logits``.

    With ``cache``, the ``T`` new tokens are written at its columns ``length .. length + T - 1``
    and attend to everything before them; ``attention_mask`` then covers only the new tokens.
    ``logits_to_keep`` > 0 runs the LM head over the last that many positions only.
    ``linear(module, x)`` runs the layers' projections (None: the module itself; the decode
    loop passes :class:`PackedLinears`). ``trace``: as :func:`lean_hidden`'s.
    """
    hidden = lean_hidden(
        model, input_ids, attention_mask, position_ids, logits_to_keep, cache, linear, trace=trace
    )
    return lean_head(model, hidden)


def lean_head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head of a model the lean path runs, over ``hidden`` from :func:`lean_hidden`."""
    return unwrapped_model(model).lm_head(hidden)


def lean_hidden(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int = 0,
    cache: KVCache | None = None,
    linear: Linear | None = None,
    segments: torch.Tensor | None = None,
    trace: Recorder | None = None,
) -> torch.Tensor:
    """What the LM head reads: the final norm's output ``[B, T or logits_to_keep, H]``;
    arguments as :func:`lean_logits` (whose logits are ``lm_head`` of this). ``segments``
    ``[B, T]`` (a packed batch's sample of each token, :mod:`alignzoo.kernels.packing`; not
    with a cache) lets a query see only keys of its own segment. ``trace`` (with ``cache``,
    without gradients) records each layer's activations for a backward pass against them
    (:mod:`alignzoo.kernels.trace`)."""
    if linear is None:
        linear = _call
    base = unwrapped_model(model)
    shape = layer_shape(base)
    inner = base.model
    rows, width = input_ids.shape
    new_valid = attention_mask.to(torch.bool)
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(hidden, position_ids)  # [B, T, D]

    if cache is None:
        start = 0
        key_valid = new_valid
    else:
        start = cache.length
        cache.valid[:, start : start + width] = new_valid
        key_valid = cache.valid[:, : start + width]
    keys_len = start + width
    if segments is not None and cache is not None:
        raise ValueError("packed segments take no KV cache")
    mask = visible_keys(key_valid, start, segments)
    if trace is not None:
        trace.record_positions(start, position_ids)
    # The additive form sdpa turns a boolean mask into (0 where seen, -inf where not), made
    # once in the activations' dtype: not again in every layer, nor kept once per layer for
    # the backward pass ([B, 1, T, S] floats each: 550 MB over 8 layers at 64 x 518 tokens).
    bias: torch.Tensor | None = None
    gqa = shape.kv_heads != shape.heads

    decodes = getattr(linear, "decodes", None)  # PackedLinears'
    if (
        cache is not None
        and width == 1
        and callable(decodes)
        and decodes(hidden)
        and (trace is None or trace.rows == rows)  # not a prefill's rows, which it repeats
    ):
        hidden = _decode_step(
            inner.layers,
            shape,
            hidden,
            cos,
            sin,
            cache,
            start,
            additive_mask(mask, hidden.dtype),
            linear,
            trace,
        )
        cache.length = keys_len
        return _rms_norm(hidden, inner.norm, shape.eps)

    for index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        normed = _rms_norm(hidden, layer.input_layernorm, shape.eps)
        joint = _split(linear, attn, normed)
        if joint is not None:  # q, k and v from one packed GEMM
            q_lin, k_lin, v_lin = joint
            cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)
            q = _rotate(q_lin.view(rows, width, shape.heads, -1).transpose(1, 2), cos_h, sin_h)
            k = _rotate(k_lin.view(rows, width, shape.kv_heads, -1).transpose(1, 2), cos_h, sin_h)
            v = v_lin
        else:
            q = _project_rotated(attn.q_proj, normed, cos, sin, shape.heads, shape.head_dim, linear)
            k = _project_rotated(
                attn.k_proj, normed, cos, sin, shape.kv_heads, shape.head_dim, linear
            )
            v = linear(attn.v_proj, normed)
        v = v.view(rows, width, shape.kv_heads, shape.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.write(index, start, k, v)
        if bias is None or bias.dtype != q.dtype:
            bias = additive_mask(mask, q.dtype)
        logsumexp = None
        if trace is not None and not gqa and q.device.type == "cpu":
            # The kernel sdpa runs here, called for its softmax's log-normalisers too (the
            # trace's backward pass takes the same kernel's backward).
            out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=bias, scale=attn.scaling
            )
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=bias,
                dropout_p=0.0,  # lean_reason refuses attention dropout in training
                scale=attn.scaling,
                enable_gqa=gqa,
            )
        out = out.transpose(1, 2).reshape(rows, width, shape.heads * shape.head_dim)
        if trace is not None:
            trace.record_attention(index, start, hidden, q, out, logsumexp)
        hidden = _linear_residual(attn.o_proj, out, hidden, linear)
        normed = _rms_norm(hidden, layer.post_attention_layernorm, shape.eps)
        if trace is not None:
            hidden = trace.record_mlp(index, start, layer.mlp, normed, hidden, linear)
        else:
            hidden = _mlp_residual(layer.mlp, normed, hidden, linear)

    if trace is not None:
        trace.record_final(start, hidden)
    if cache is not None:
        cache.length = keys_len
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:]
    return _rms_norm(hidden, inner.norm, shape.eps)


def rms_norm_and_rstd(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x [N, H]`` (no gradients) and its ``1 / rms`` per row ``[N, 1]``, as
    :class:`_RMSNorm` computes them: fewer operator calls than ``F.rms_norm``'s composite on
    the CPU. The decode step's norm, and the trace's backward pass recomputing it."""
    rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    rstd.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return torch.mul(x, rstd).mul_(weight), rstd


def _decode_step(
    layers: Any,
    shape: LayerShape,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    start: int,
    bias: torch.Tensor,
    linear: Linear,
    trace: Recorder | None,
) -> torch.Tensor:
    """The layers over one decode step's ``hidden [rows, 1, H]`` (column ``start``): the
    loop of :func:`lean_hidden`, for ``linear`` a :class:`PackedLinears` that
    :meth:`~PackedLinears.decodes` it, in fewer and smaller operator calls: RMSNorm by
    :func:`rms_norm_and_rstd`, q and k rotated together from the joint projection (the default
    RoPE's halves, as :class:`_RotateInPlace`), and the residual stream and a recorder's
    activations computed into the recorder's buffers (:class:`DecodeSlots`) instead of copied
    there. The last layer's output ``[rows, 1, H]``."""
    rows = hidden.shape[0]
    heads, kv_heads, dim = shape.heads, shape.kv_heads, shape.head_dim
    half, qk_heads = dim // 2, shape.heads + shape.kv_heads
    x = hidden.view(rows, -1)
    c, s = cos.view(rows, 1, dim)[..., :half], sin.view(rows, 1, dim)[..., :half]
    gqa = kv_heads != heads
    flash = not gqa and x.device.type == "cpu"
    rotated = x.new_empty((rows, qk_heads, dim))  # this step's rotated q and k heads
    r1, r2 = rotated[..., :half], rotated[..., half:]
    for index, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        slots = None if trace is None else trace.decode_slots(index, start, flash)
        if slots is not None and slots.h is not None:
            slots.h.copy_(x)
        normed, _ = rms_norm_and_rstd(x, layer.input_layernorm.weight, shape.eps)
        qkv = linear.joint_projection(attn, normed)
        qk = qkv[:, : qk_heads * dim].view(rows, qk_heads, dim)
        x1, x2 = qk[..., :half], qk[..., half:]
        torch.mul(x1, c, out=r1).addcmul_(x2, s, value=-1.0)  # x1 cos - x2 sin
        torch.mul(x2, c, out=r2).addcmul_(x1, s)  # x2 cos + x1 sin
        v = qkv[:, qk_heads * dim :].view(rows, kv_heads, 1, dim)
        keys, values = cache.write(index, start, rotated[:, heads:].unsqueeze(2), v)
        q = rotated[:, :heads].unsqueeze(2)  # [rows, heads, 1, D]
        if slots is not None:
            slots.q.copy_(rotated[:, :heads])
        if flash:
            out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, keys, values, 0.0, False, attn_mask=bias, scale=attn.scaling
            )
            if slots is not None and slots.logsumexp is not None:
                slots.logsumexp.copy_(logsumexp.view(rows, heads))
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=bias, dropout_p=0.0, scale=attn.scaling, enable_gqa=gqa
            )
        o = out.transpose(1, 2).reshape(rows, heads * dim)
        if slots is not None:
            slots.o.copy_(o)
        m = torch.add(x, linear(attn.o_proj, o), out=None if slots is None else slots.m)
        normed, _ = rms_norm_and_rstd(m, layer.post_attention_layernorm.weight, shape.eps)
        gate_up = linear.joint_projection(mlp, normed)
        if slots is not None:
            slots.gate_up.copy_(gate_up)
        inner = gate_up.shape[-1] // 2
        product = mlp.act_fn(gate_up[:, :inner]).mul_(gate_up[:, inner:])
        x = torch.add(m, linear(mlp.down_proj, product), out=None if slots is None else slots.out)
    return x.view(rows, 1, -1)
