"""The update's backward pass against the decode loop's own activations.

With one optimizer step per generation (one epoch, the whole batch in one minibatch), the
update's forward pass recomputes, with the same weights, what the lean decode loop
(:mod:`alignzoo.kernels.lean`) already computed token by token while it sampled the batch.
When asked (:func:`recording`), the decode loop records each layer's activations in a
:class:`DecodeTrace`; the update then reads the response's final hidden states from it
(:func:`traced_hidden`) and its backward pass runs against the recorded activations
(:class:`_TracedLayers`), layer by layer from the last, with the equations of the lean forward
(``n = RMSNorm``, ``R`` = RoPE, ``P`` = the attention's softmax, ``g`` = each tensor's gradient):

    MLP:   h' = m + W_d (silu(a) * b),  a = W_g n(m),  b = W_u n(m)
           dW_d = g^T (silu(a) * b)          dp = g W_d
           db = dp * silu(a)                 da = dp * b * silu'(a)
           dW_g = da^T n(m)    dW_u = db^T n(m)    dn = da W_g + db W_u
    Attn:  m = h + W_o o,  o = P v,  P = softmax(R(q) R(k)^T s + mask),  q, k, v = W n(h) + c
           dW_o = g^T o      do = g W_o      dv = P^T do      dP = do v^T
           dS = P * (dP - rowsum(do * o))    dq = R^T(dS k s)    dk = R^T(dS^T q s)
    Norm:  dx = r (g w - x r * mean(g w * x r)),  dw = sum g * x r,  r = 1 / rms(x)

The recorded tensors are what the decode loop computed; the gradient is autograd's through
the lean forward up to float rounding (the decode steps' GEMMs have one row per sample where
the forward's have every token): tests/core/kernels/test_trace.py compares them. What it
saves is the forward pass: 2 FLOP per parameter per token, a third of the update's
arithmetic (benchmarks/README.md).

A trace serves a batch only while every weight it recorded is unchanged (each parameter's
version counter and storage) and only the rows whose prompt and response tokens it recorded
(found by their tokens: a micro-batch is any subset of them, in any order); anything else
takes the lean forward as before. The engine asks for a trace only where the update follows
the sampling with the same weights (:func:`recording`) and releases it after the update
(:func:`release`): it holds each layer's input, query, attention output, residual and MLP
projections for every recorded token (about 1.3 GB at 64 x 134 tokens of the 25.8M model).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from alignzoo.kernels.lean import (
    DecodeSlots,
    additive_mask,
    can_run_lean,
    layer_shape,
    mlp_projections,
    rms_norm_and_rstd,
    rms_norm_backward,
    rotate_backward,
    swiglu_down_backward,
    unwrapped_model,
    visible_keys,
)

if TYPE_CHECKING:
    from alignzoo.batch import RolloutBatch
    from alignzoo.kernels.lean import KVCache, Linear

_CURRENT: DecodeTrace | None = None  # the one trace kept: the latest generation's


@dataclass
class _Scope:
    """A :func:`recording` block: it records one trace, the first decode loop's."""

    recorded: bool = False


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("decode_trace", default=None)


@contextlib.contextmanager
def recording(wanted: bool = True) -> Iterator[None]:
    """Within it (on this thread), the first lean decode loop that can records a
    :class:`DecodeTrace` of the batch it samples (:func:`start`), replacing the trace kept
    before; any later loop in the block (a labeler sampling the policy) records nothing."""
    token = _SCOPE.set(_Scope() if wanted else None)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def release() -> None:
    """Drop the trace kept (its activations are freed)."""
    global _CURRENT
    _CURRENT = None


def current() -> DecodeTrace | None:
    """The trace kept, if any (for tests and metrics)."""
    return _CURRENT


def why_not(model: Any) -> str | None:
    """None when a decode loop over ``model`` can record a trace; otherwise why not."""
    if not can_run_lean(model):
        return "the model does not take the lean forward"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "data parallel (the gradient's reduction hooks need the module's own forward)"
    base = unwrapped_model(model)
    if torch.is_autocast_enabled(next(base.parameters()).device.type):
        return "autocast"
    for layer in base.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn, mlp, layer.input_layernorm, layer.post_attention_layernorm):
            if module._forward_hooks or module._forward_pre_hooks:
                return f"{type(module).__name__} has forward hooks"
        for module in (*_projections(layer), layer.input_layernorm, layer.post_attention_layernorm):
            if module.weight.dtype != torch.float32:
                return f"a {module.weight.dtype} weight (the trace is fp32)"
        for module in _projections(layer):
            if type(module) is not torch.nn.Linear or module._forward_hooks:
                return f"{type(module).__name__} is not a bare nn.Linear (an adapter)"
    if not any(p.requires_grad for p in base.model.layers.parameters()):
        return "no layer weight is trained"
    return None


def start(model: Any, prompts: int, n: int, capacity: int) -> DecodeTrace | None:
    """A new trace for a decode loop over ``prompts`` prompts with ``n`` samples each and at
    most ``capacity`` columns, kept as the current one; None outside :func:`recording` or for a
    model :func:`why_not` refuses."""
    global _CURRENT
    scope = _SCOPE.get()
    if scope is None or scope.recorded or why_not(model) is not None:
        return None
    scope.recorded = True
    _CURRENT = None  # the last one's memory before the new one's
    _CURRENT = DecodeTrace(model, prompts, n, capacity)
    return _CURRENT


def _projections(layer: Any) -> tuple[Any, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )


def _trained(model: Any) -> list[torch.Tensor]:
    """The layers' weights a trace's backward pass gives gradients for, in a fixed order."""
    params: list[torch.Tensor] = []
    for layer in unwrapped_model(model).model.layers:
        for module in (layer.input_layernorm, *_projections(layer), layer.post_attention_layernorm):
            params.append(module.weight)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                params.append(bias)
    return params


def _state(model: Any) -> list[tuple[int, int]]:
    """Every parameter's version counter and storage: an in-place update through autograd's
    view of it (an optimizer step, ``load_state_dict``, a weight sync) changes the first, a
    replaced tensor the second. (A write through ``.data`` changes neither.)"""
    return [(p._version, p.data_ptr()) for p in model.parameters()]


class DecodeTrace:
    """Each layer's activations over the columns a decode loop ran, time-major
    ``[capacity, rows, ...]`` (``rows = prompts * n``: a prompt's prefill is written to each of
    its n rows; each decode step writes one contiguous block): the layer's input ``h``, the
    attention's output before ``o_proj``, the residual after it ``m``, the MLP's gate and up
    projections, and the last layer's output; the rotated queries ``[rows, heads, capacity,
    D]`` (the KV cache's layout) and each column's position ``[rows, capacity]``. The keys and
    values are the decode loop's KV cache (:meth:`finish`). ``capacity`` is the columns the
    loop can feed: the prompt and every sampled token but the last."""

    def __init__(self, model: Any, prompts: int, n: int, capacity: int) -> None:
        base = unwrapped_model(model)
        self.model = base
        self.n = n
        self.rows = prompts * n
        self.shape = layer_shape(base)
        hidden = base.config.hidden_size
        weight = base.model.layers[0].mlp.gate_proj.weight
        device, inner = weight.device, weight.shape[0]
        heads, dim = self.shape.heads, self.shape.head_dim
        layers = len(base.model.layers)

        def buffers(*size: int) -> list[torch.Tensor]:
            return [torch.empty(size, device=device) for _ in range(layers)]

        self.h = buffers(capacity, self.rows, hidden)
        self.o = buffers(capacity, self.rows, heads * dim)
        self.m = buffers(capacity, self.rows, hidden)
        self.inner = inner
        # The MLP's gate and up projections side by side, as the joint packed GEMM gives them.
        self.gate_up = buffers(capacity, self.rows, 2 * inner)
        self.out = torch.empty((capacity, self.rows, hidden), device=device)
        self.q = buffers(self.rows, heads, capacity, dim)
        # The attention's log-normalisers, when every step ran the CPU flash kernel
        # (lean_hidden: no grouped KV heads), whose backward then takes them.
        self.logsumexp: list[torch.Tensor] | None = buffers(self.rows, heads, capacity)
        self.positions = torch.zeros((self.rows, capacity), dtype=torch.long, device=device)
        self.params = _trained(base)
        self.state = _state(base)
        self.cache: KVCache | None = None
        self.tokens: dict[bytes, int] = {}  # a recorded row's prompt and response ids -> its row
        self.prompt_width = self.response_width = 0

    # ------------------------------------------------------------------ recording
    def _rows(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` for every row: a prefill's prompt rows repeated for their n samples."""
        if value.shape[0] != self.rows:
            return value.repeat_interleave(self.n, dim=0)
        return value

    def _put(self, buffer: torch.Tensor, start: int, value: torch.Tensor) -> None:
        """``value [B, T, ...]`` at the time-major ``buffer``'s columns ``start ..``."""
        buffer[start : start + value.shape[1]].copy_(self._rows(value).transpose(0, 1))

    def record_positions(self, start: int, positions: torch.Tensor) -> None:
        self.positions[:, start : start + positions.shape[1]] = self._rows(positions)

    def record_attention(
        self,
        layer: int,
        start: int,
        h: torch.Tensor,
        q: torch.Tensor,
        o: torch.Tensor,
        logsumexp: torch.Tensor | None = None,
    ) -> None:
        """A layer's input, rotated queries ``[B, heads, T, D]``, attention output and, from
        the CPU flash kernel, its log-normalisers ``[B, heads, T]``."""
        self._put(self.h[layer], start, h)
        width = q.shape[2]
        self.q[layer][:, :, start : start + width] = self._rows(q)
        self._put(self.o[layer], start, o)
        if logsumexp is None:
            self.logsumexp = None
        elif self.logsumexp is not None:
            self.logsumexp[layer][:, :, start : start + width] = self._rows(logsumexp)

    def record_mlp(
        self,
        layer: int,
        start: int,
        mlp: Any,
        normed: torch.Tensor,
        residual: torch.Tensor,
        linear: Linear,
    ) -> torch.Tensor:
        """``residual + mlp(normed)`` (the layer's output), its gate and up projections and
        ``residual`` recorded."""
        gate, up = mlp_projections(mlp, normed, linear)
        self._put(self.m[layer], start, residual)
        self._put(self.gate_up[layer][..., : self.inner], start, gate)
        self._put(self.gate_up[layer][..., self.inner :], start, up)
        return residual + linear(mlp.down_proj, F.silu(gate) * up)

    def decode_slots(self, layer: int, column: int, logsumexp: bool) -> DecodeSlots:
        """Where a decode step (one column, every row) writes layer ``layer``'s activations:
        views of this trace's buffers. ``logsumexp`` False: the step's attention gives none
        (grouped KV heads, another device), so the trace keeps none."""
        if not logsumexp:
            self.logsumexp = None
        last = layer + 1 == len(self.h)
        return DecodeSlots(
            h=self.h[layer][column] if layer == 0 else None,
            q=self.q[layer][:, :, column],
            o=self.o[layer][column],
            logsumexp=None if self.logsumexp is None else self.logsumexp[layer][:, :, column],
            m=self.m[layer][column],
            gate_up=self.gate_up[layer][column],
            out=self.out[column] if last else self.h[layer + 1][column],
        )

    def record_final(self, start: int, h: torch.Tensor) -> None:
        self._put(self.out, start, h)

    def finish(
        self,
        cache: KVCache,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> None:
        """The decode loop's end: its cache (keys, values and which columns are real) and the
        ``[rows, P]`` prompts and ``[rows, R]`` responses it sampled, ids and masks (before any
        padding to a wider batch), by which :func:`traced_hidden` finds a batch's rows."""
        self.cache = cache
        self.prompt_width, self.response_width = prompt_ids.shape[1], response_ids.shape[1]
        keys = _row_keys(prompt_ids, prompt_mask, response_ids, response_mask)
        self.tokens = {}
        for row, key in enumerate(keys):
            self.tokens.setdefault(key, row)

    # ------------------------------------------------------------------ reading
    def rows_of(self, model: Any, batch: RolloutBatch) -> torch.Tensor | None:
        """The recorded rows of ``batch``'s samples, or None when the trace cannot serve it:
        another model, changed weights, another layout, or a sample it did not record."""
        if self.cache is None or unwrapped_model(model) is not self.model:
            return None
        if (
            batch.prompt_ids.shape[1] != self.prompt_width
            or batch.response_ids.shape[1] != self.response_width
            or self.response_width == 0
        ):
            return None
        if _state(self.model) != self.state:
            return None
        if batch.response_attention is not None:  # attends to more than it trains on
            return None
        keys = _row_keys(
            batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
        )
        rows = [self.tokens.get(key) for key in keys]
        if any(r is None for r in rows):
            return None
        return torch.tensor(rows, dtype=torch.long)


def _row_keys(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> list[bytes]:
    """Each row's tokens and which of them are real (the masks a forward pass attends by: a
    response token masked since sampling, or a prompt that is padding where another is a
    token, is another row)."""
    ids = torch.cat([prompt_ids.cpu(), response_ids.cpu()], dim=1).long()
    real = torch.cat([prompt_mask.cpu() > 0, response_mask.cpu() > 0], dim=1).long()
    table = torch.stack([ids, real], dim=1).numpy()
    return [table[row].tobytes() for row in range(table.shape[0])]


def traced_hidden(model: Any, batch: RolloutBatch) -> torch.Tensor | None:
    """The final norm's output over ``batch``'s response positions ``[B, R, H]`` (the LM head's
    input for the logits that predict each response token, as :func:`~alignzoo.kernels.lean.lean_hidden`
    gives it) read from the current trace, its backward pass against the recorded activations;
    None when no trace serves ``batch`` (the caller then runs the forward)."""
    trace = _CURRENT
    if trace is None or torch.is_autocast_enabled(trace.out.device.type):
        return None
    # As the model is now (train mode: attention dropout; hooks added since sampling).
    if why_not(model) is not None:
        return None
    rows = trace.rows_of(model, batch)
    if rows is None:
        return None
    base = trace.model
    device = trace.out.device
    prompt_width, response_width = trace.prompt_width, trace.response_width
    columns = prompt_width + response_width - 1  # the last sampled token was never fed
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)[:, :columns].to(device)
    h0 = base.model.embed_tokens(ids)
    view = _View(trace, rows.to(device), prompt_width, columns)
    out = _TracedLayers.apply(view, h0, *trace.params)
    return F.rms_norm(out, (out.shape[-1],), base.model.norm.weight, trace.shape.eps)


@dataclass
class _View:
    """The rows of a trace one micro-batch reads, over its first ``columns`` columns."""

    trace: DecodeTrace
    rows: torch.Tensor
    prompt_width: int
    columns: int

    def __post_init__(self) -> None:
        every = torch.arange(self.trace.rows, device=self.rows.device)
        self.every = self.rows.numel() == every.numel() and bool((self.rows == every).all())

    def time_major(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[columns * B, X]`` of a ``[capacity, rows, X]`` buffer (a view for every row)."""
        picked = buffer[: self.columns]
        if not self.every:
            picked = picked.index_select(1, self.rows)
        return picked.reshape(-1, buffer.shape[-1])

    def row_major(self, buffer: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """The first ``columns`` columns (``seq_dim``) of a row-major buffer's rows."""
        picked = buffer if self.every else buffer.index_select(0, self.rows)
        return picked.narrow(seq_dim, 0, self.columns)


class _TracedLayers(torch.autograd.Function):
    """The decoder layers over a trace's recorded columns: the forward returns the last
    layer's output at the response positions ``[B, R, H]`` as recorded; the backward computes
    the gradients of the embeddings ``h0`` and of every layer weight from the recorded
    activations (the equations at the top of this module), tokens time-major throughout."""

    @staticmethod
    def forward(ctx: Any, view: _View, h0: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.view = view
        out = view.time_major(view.trace.out).view(view.columns, -1, h0.shape[-1])
        return out[view.prompt_width - 1 :].transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        view: _View = ctx.view
        trace = view.trace
        needs = ctx.needs_input_grad[2:]
        wanted = {id(p): need for p, need in zip(trace.params, needs, strict=True)}
        grads: dict[int, torch.Tensor] = {}
        rows, hidden = grad.shape[0], grad.shape[-1]
        dh = grad.new_zeros((view.columns, rows, hidden))
        dh[view.prompt_width - 1 :] = grad.transpose(0, 1)
        assert trace.cache is not None
        valid = view.row_major(trace.cache.valid, 1)
        bias = additive_mask(visible_keys(valid, 0), grad.dtype)
        base = trace.model
        positions = view.row_major(trace.positions, 1)
        cos, sin = base.model.rotary_emb(grad, positions)  # [B, S, D]
        flat = dh.view(-1, hidden)
        layers = base.model.layers
        for index in range(len(layers) - 1, -1, -1):
            flat = _layer_backward(layers[index], index, view, flat, bias, cos, sin, wanted, grads)
        dh0 = (
            flat.view(view.columns, rows, hidden).transpose(0, 1)
            if ctx.needs_input_grad[1]
            else None
        )
        out: list[torch.Tensor | None] = [None, dh0]
        out.extend(grads.get(id(p)) for p in trace.params)
        return tuple(out)


def _accumulate(
    grads: dict[int, torch.Tensor],
    wanted: dict[int, bool],
    modules: tuple[Any, ...],
    x: torch.Tensor,
    g: torch.Tensor,
) -> torch.Tensor:
    """Linear layers reading the same input ``x [N, in]`` whose outputs' gradients are the
    column blocks of ``g [N, sum of outs]``, in order: their weights' (and biases') gradients
    into ``grads`` where asked, from one GEMM; returns the gradient of ``x``, from another."""
    weights = [module.weight for module in modules]
    if any(wanted.get(id(w)) for w in weights):
        outs = [w.shape[0] for w in weights]
        if sum(outs) > x.shape[-1]:
            # The same sums as the transpose of x^T g: MKL's GEMM over the long token
            # dimension ran faster with the narrower side as the result's rows (gate/up and
            # q/k/v of the 25.8M model with AVX2, AVX-512 and AMX; benchmarks/README.md's log)
            blocks = tuple(b.t() for b in x.t().mm(g).split(outs, dim=1))
        else:
            blocks = g.t().mm(x).split(outs)
        for weight, block in zip(weights, blocks, strict=True):
            if wanted.get(id(weight)):
                grads[id(weight)] = block
    biases = [module.bias for module in modules]
    if any(b is not None and wanted.get(id(b)) for b in biases):
        sums = g.sum(0).split([w.shape[0] for w in weights])
        for bias, block in zip(biases, sums, strict=True):
            if bias is not None and wanted.get(id(bias)):
                grads[id(bias)] = block
    joined = weights[0] if len(weights) == 1 else torch.cat(weights)
    return g.mm(joined)


def _norm_backward(
    x: torch.Tensor,
    rstd: torch.Tensor,
    g: torch.Tensor,
    norm: Any,
    grads: dict[int, torch.Tensor],
    wanted: dict[int, bool],
) -> torch.Tensor:
    """RMSNorm's input gradient ``[N, H]`` for its output's ``g``; its weight's into ``grads``."""
    weight = norm.weight
    dx, dw = rms_norm_backward(x, rstd, weight, g, True, wanted.get(id(weight), False))
    if dw is not None:
        grads[id(weight)] = dw
    assert dx is not None
    return dx


def _layer_backward(
    layer: Any,
    index: int,
    view: _View,
    g: torch.Tensor,
    bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    wanted: dict[int, bool],
    grads: dict[int, torch.Tensor],
) -> torch.Tensor:
    """The gradient ``[S * B, H]`` (time-major) of layer ``index``'s input from its output's."""
    trace = view.trace
    shape = trace.shape
    cache = trace.cache
    assert cache is not None
    attn, mlp = layer.self_attn, layer.mlp
    columns = view.columns
    rows = g.shape[0] // columns

    # MLP: h' = m + W_d (silu(a) * b), silu(a) and the product recomputed by rows
    m = view.time_major(trace.m[index])
    gate_up = view.time_major(trace.gate_up[index])
    a, b = gate_up[:, : trace.inner], gate_up[:, trace.inner :]
    down = mlp.down_proj
    inner = a.shape[-1]
    dab = a.new_empty((a.shape[0], 2 * inner))  # the gate's and up's gradients side by side
    out = (dab[:, :inner], dab[:, inner:])
    need_down = bool(wanted.get(id(down.weight)))
    _, _, dw = swiglu_down_backward(a, b, down.weight, g, True, True, need_down, out=out)
    if dw is not None:
        grads[id(down.weight)] = dw
    if down.bias is not None and wanted.get(id(down.bias)):
        grads[id(down.bias)] = g.sum(0)
    normed, rstd = rms_norm_and_rstd(m, layer.post_attention_layernorm.weight, shape.eps)
    dn = _accumulate(grads, wanted, (mlp.gate_proj, mlp.up_proj), normed, dab)
    del dab, out, normed
    dm = _norm_backward(m, rstd, dn, layer.post_attention_layernorm, grads, wanted).add_(g)
    del dn

    # Attention: m = h + W_o P v
    heads, kv_heads, dim = shape.heads, shape.kv_heads, shape.head_dim
    o = view.time_major(trace.o[index])
    do_flat = _accumulate(grads, wanted, (attn.o_proj,), o, dm)

    def per_head(x: torch.Tensor) -> torch.Tensor:  # [S * B, heads * D] -> [B, heads, S, D]
        return x.view(columns, rows, heads, dim).permute(1, 2, 0, 3)

    do = per_head(do_flat).contiguous()
    del do_flat
    q = view.row_major(trace.q[index], 2)
    keys, values = cache.keys[index], cache.values[index]
    assert keys is not None and values is not None
    k, v = view.row_major(keys, 2), view.row_major(values, 2)
    scale = float(attn.scaling)
    if trace.logsumexp is not None:  # the flash kernel's backward, as the decode loop ran it
        logsumexp = view.row_major(trace.logsumexp[index], 2)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do,
            q,
            k,
            v,
            per_head(o).contiguous(),
            logsumexp,
            0.0,
            False,
            attn_mask=bias,
            scale=scale,
        )
    else:
        dq, dk, dv = _attention_backward(q, k, v, per_head(o), do, bias, scale, kv_heads)
    del do
    half = dim // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)  # [B, 1, S, D/2]

    # q, k and v's gradients side by side, time-major: [S, B, heads + 2 kv_heads, D]
    dqkv = dq.new_empty((columns, rows, heads + 2 * kv_heads, dim))
    by_head = dqkv.permute(1, 2, 0, 3)  # [B, heads + 2 kv_heads, S, D]
    rotate_backward(dq, c, s, by_head[:, :heads])
    rotate_backward(dk, c, s, by_head[:, heads : heads + kv_heads])
    by_head[:, heads + kv_heads :] = dv
    del dq, dk, dv, by_head
    h = view.time_major(trace.h[index])
    normed, rstd = rms_norm_and_rstd(h, layer.input_layernorm.weight, shape.eps)
    flat = dqkv.view(columns * rows, -1)
    dn = _accumulate(grads, wanted, (attn.q_proj, attn.k_proj, attn.v_proj), normed, flat)
    del dqkv, flat, normed
    return _norm_backward(h, rstd, dn, layer.input_layernorm, grads, wanted).add_(dm)


def _attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``q [B, heads, S, D]`` and of ``k``, ``v [B, kv_heads, S, D]`` of
    ``o = softmax(q k^T s + bias) v`` for ``do`` (the equations at the top of this module;
    each KV head serves ``heads / kv_heads`` query heads, as sdpa's ``enable_gqa``)."""
    rows, heads, columns, dim = q.shape
    groups = heads // kv_heads
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(bias), dim=-1)
    dv = torch.matmul(probs.transpose(-1, -2), do)
    dprobs = torch.matmul(do, v.transpose(-1, -2))
    delta = (do * o).sum(-1, keepdim=True)
    dscores = dprobs.sub_(delta).mul_(probs).mul_(scale)
    del probs, delta
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q)
    if groups > 1:
        dk = dk.view(rows, kv_heads, groups, columns, dim).sum(2)
        dv = dv.view(rows, kv_heads, groups, columns, dim).sum(2)
    return dq, dk, dv
