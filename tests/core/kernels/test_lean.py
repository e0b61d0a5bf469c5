"""The lean forward (alignzoo.kernels.lean) gives transformers' logits and gradients for Qwen2 and
Llama, with padding, grouped KV heads, LoRA adapters and the KV-cache decode path; anything it
cannot run exactly is refused with a reason, and callers fall back to the model's own forward."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from alignzoo.kernels.lean import KVCache, PackedLinears, lean_hidden, lean_logits, lean_reason

VOCAB = 97


def _model(arch: str, kv_heads: int = 4, **extra) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=arch == "qwen2",
    )
    common.update(extra)
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **common))
    # Random biases and norm weights, so that a lean forward that skipped one would differ.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    return model


def _inputs(rows: int = 5, width: int = 9, seed: int = 1):
    """Left-padded rows of different lengths (one of a single token), transformers' positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    for row, pad in enumerate([0, 3, width - 1, 1, 5][:rows]):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, positions


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize(("arch", "kv_heads"), [("qwen2", 4), ("qwen2", 2), ("llama", 1)])
def test_logits_and_gradients_equal_transformers(arch, kv_heads, recompute, monkeypatch):
    """With the fused training functions (_RMSNorm, _SwiGLUDown, _RotateInPlace, the residual
    added by the GEMM), working in chunks of a few rows, and with the plain ops that
    activations below RECOMPUTE_FROM elements take."""
    from alignzoo.kernels import lean

    if recompute:
        monkeypatch.setattr(lean, "RECOMPUTE_FROM", 0)
        monkeypatch.setattr(lean, "CHUNK_ELEMENTS", 100)  # 2-3 rows of 32-48 per chunk
    model = _model(arch, kv_heads)
    assert lean_reason(model) is None
    ids, mask, positions = _inputs()
    real = mask.bool()
    weights = torch.randn(
        ids.shape[0], ids.shape[1], VOCAB, generator=torch.Generator().manual_seed(2)
    )

    def run(forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits = forward()
        (logits * weights * real[..., None]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    theirs, their_grads = run(
        lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    )
    ours, our_grads = run(lambda: lean_logits(model, ids, mask, positions))
    # What was compared is the path named: the fused functions ran, or none of them did.
    fused = {"_RMSNormBackward", "_RotateInPlaceBackward"}
    if arch == "qwen2":  # Llama's test model has biases on o_proj and down_proj: the plain ops
        fused |= {"_SwiGLUDownBackward"}
    ran = _backward_nodes(lean_logits(model, ids, mask, positions))
    assert fused <= ran if recompute else not (fused & ran)
    assert "AsStridedBackward0" not in ran  # nothing rotated in place through a view
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ours).all()  # padding rows too
    assert our_grads.keys() == their_grads.keys() and len(our_grads) == len(
        list(model.parameters())
    )
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def _backward_nodes(output: torch.Tensor) -> set[str]:
    """The names of the autograd nodes ``output`` was computed through."""
    seen: set[str] = set()
    stack, visited = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        seen.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return seen


def _saved_for_backward(forward) -> dict[int, tuple[int, tuple[int, ...]]]:
    """The activations autograd keeps for the backward pass of ``forward()``: storage ->
    (bytes, shape), parameters left out."""
    saved: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter):
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return saved


def test_the_mlp_keeps_two_intermediate_activations_per_layer_not_four(monkeypatch):
    """silu(gate) and the product are recomputed in the backward pass (_SwiGLUDown): half of
    the MLP's saved activations, fewer bytes kept than transformers' forward keeps; below
    RECOMPUTE_FROM elements the plain ops run (and keep four)."""
    from alignzoo.kernels import lean

    model = _model("qwen2").train()
    ids, mask, positions = _inputs()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def intermediate(saved) -> int:
        return sum(
            1 for ptr, (_, shape) in saved.items() if ptr not in parameters and shape[-1] == 48
        )

    def total(saved) -> int:
        return sum(size for ptr, (size, _) in saved.items() if ptr not in parameters)

    small = _saved_for_backward(lambda: lean_logits(model, ids, mask, positions))
    monkeypatch.setattr(lean, "RECOMPUTE_FROM", 0)
    ours = _saved_for_backward(lambda: lean_logits(model, ids, mask, positions))
    theirs = _saved_for_backward(
        lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    )
    layers = model.config.num_hidden_layers
    assert intermediate(small) == intermediate(theirs)
    assert intermediate(theirs) == 4 * layers  # gate, silu(gate), up, the product
    assert intermediate(ours) == 2 * layers  # gate and up
    assert total(ours) < total(theirs)


def test_each_norm_keeps_its_input_only_for_the_backward_pass(monkeypatch):
    """_RMSNorm recomputes x / rms(x) in the backward pass: per layer the two norms' inputs and
    the two normalised outputs the projections read are the hidden-sized tensors kept; the
    composite RMSNorm (transformers', and F.rms_norm on the CPU) keeps more."""
    from alignzoo.kernels import lean

    monkeypatch.setattr(lean, "RECOMPUTE_FROM", 0)  # the test model's activations are small
    model = _model("qwen2").train()
    ids, mask, positions = _inputs()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    hidden = model.config.hidden_size

    def hidden_sized(saved) -> int:
        return sum(
            1
            for ptr, (size, shape) in saved.items()
            if ptr not in parameters and shape[-1] == hidden and size == ids.numel() * hidden * 4
        )

    ours = _saved_for_backward(lambda: lean_logits(model, ids, mask, positions))
    theirs = _saved_for_backward(
        lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    )
    layers = model.config.num_hidden_layers
    # Each layer: its input, the attention norm's output, the residual after attention and
    # the MLP norm's output; then the final norm's input and output.
    assert hidden_sized(ours) == 4 * layers + 2
    assert hidden_sized(theirs) > hidden_sized(ours)


@pytest.mark.parametrize("chunk", [1 << 22, 40])
def test_the_rms_norm_function_has_the_analytic_gradient(chunk, monkeypatch):
    """Whole, and in chunks of rows (40 elements: 2 rows of 16 per chunk, 6 chunks)."""
    from alignzoo.kernels import lean
    from alignzoo.kernels.lean import _RMSNorm

    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, generator=g, requires_grad=True)
    assert len(lean._row_chunks(12, 16)) == (1 if chunk > 12 * 16 else 6)
    assert torch.autograd.gradcheck(lambda a, w: _RMSNorm.apply(a, w, 1e-6), (x, weight))
    expected = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(_RMSNorm.apply(x, weight, 1e-6), expected)


@pytest.mark.parametrize("chunk", [1 << 22, 40])
def test_the_swiglu_function_adds_the_residual_with_the_analytic_gradient(chunk, monkeypatch):
    """``residual + W_down (silu(g) * u)``, whole and in chunks of rows (40 elements of a
    12-wide intermediate: 3 rows per chunk, the last of 14 rows short), for every subset of
    inputs that needs a gradient."""
    from alignzoo.kernels import lean

    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(4)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)

    gate, up, weight, residual = leaf(2, 7, 12), leaf(2, 7, 12), leaf(6, 12), leaf(2, 7, 6)
    assert len(lean._row_chunks(14, 12)) == (1 if chunk > 14 * 12 else 5)
    fused = lean._SwiGLUDown.apply
    expected = residual + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, weight)
    torch.testing.assert_close(fused(gate, up, weight, residual), expected)
    assert torch.autograd.gradcheck(fused, (gate, up, weight, residual))
    frozen = weight.detach()  # as when only some inputs need gradients (a frozen projection)
    assert torch.autograd.gradcheck(lambda a, b, r: fused(a, b, frozen, r), (gate, up, residual))
    assert torch.autograd.gradcheck(
        lambda w: fused(gate.detach(), up.detach(), w, residual.detach()), (weight,)
    )


def test_rope_in_place_equals_rotate_half_and_has_the_analytic_gradient():
    """_RotateInPlace rotates a projection's output in its own memory, with the numbers of
    transformers' ``x cos + rotate_half(x) sin`` (cos and sin repeat their first half, as the
    default RoPE's do)."""
    from alignzoo.kernels.lean import _rotate, _RotateInPlace

    g = torch.Generator().manual_seed(6)
    rows, width, heads, dim = 2, 5, 3, 8
    angles = torch.randn(rows, width, dim // 2, dtype=torch.float64, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = torch.randn(rows, width, heads * dim, dtype=torch.float64, generator=g)

    def reference(t: torch.Tensor) -> torch.Tensor:
        per_head = t.view(rows, width, heads, dim).transpose(1, 2)
        rotated = _rotate(per_head, cos.unsqueeze(1), sin.unsqueeze(1))
        return rotated.transpose(1, 2).reshape(rows, width, heads * dim)

    expected = reference(x)
    target = x.clone()
    out = _RotateInPlace.apply(target, cos, sin, heads)
    assert out.data_ptr() == target.data_ptr()  # no new tensor of x's size
    torch.testing.assert_close(out, expected)
    leaf = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda t: _RotateInPlace.apply(t.clone(), cos, sin, heads), (leaf,)
    )
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=g)
    ours = torch.autograd.grad(_RotateInPlace.apply(leaf.clone(), cos, sin, heads), leaf, grad)
    theirs = torch.autograd.grad(reference(leaf), leaf, grad)
    torch.testing.assert_close(ours[0], theirs[0])


def test_an_mlp_with_a_bias_or_an_adapter_runs_its_own_forward():
    """The recomputing MLP takes a bare bias-free down_proj only: Llama's mlp_bias (and a LoRA
    layer, another module type) go through the module, still with transformers' gradients
    (test_logits_and_gradients_equal_transformers, llama)."""
    from alignzoo.kernels import lean

    biased = _model("llama").train()
    assert not lean._plain_linear(biased.model.layers[0].mlp.down_proj)
    plain = _model("qwen2").train()
    assert lean._plain_linear(plain.model.layers[0].mlp.down_proj)
    plain.model.layers[0].mlp.down_proj.register_forward_hook(lambda *_: None)
    assert not lean._plain_linear(plain.model.layers[0].mlp.down_proj)


def test_logits_to_keep_runs_the_head_over_the_last_positions_only():
    model = _model("qwen2").eval()
    ids, mask, positions = _inputs()
    with torch.no_grad():
        full = lean_logits(model, ids, mask, positions)
        last = lean_logits(model, ids, mask, positions, logits_to_keep=3)
        theirs = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=3
        ).logits
    assert last.shape == (ids.shape[0], 3, VOCAB)
    torch.testing.assert_close(last, full[:, -3:], rtol=0, atol=0)
    real = mask[:, -3:].bool()  # a padding position's logits are never read
    torch.testing.assert_close(last[real], theirs[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cached_decoding_gives_the_logits_of_the_whole_sequence(arch, packed):
    """Prefill a left-padded prompt batch, repeat each row's cache for 3 samples, then feed one
    token at a time (through MKL-packed weights when ``packed``, as the decode loop does):
    every step's logits equal a single forward over prompt + tokens so far."""
    model = _model(arch, kv_heads=2).eval()
    ids, mask, positions = _inputs(rows=4, width=7)
    n, steps = 3, 4
    extra = {}
    used: list[int] = []  # the packed weights each step really multiplied by

    class Counted(PackedLinears):
        def __call__(self, module, x):
            if id(module) in self.packed:
                used.append(id(module))
            return super().__call__(module, x)

        def split(self, owner, x):
            out = super().split(owner, x)
            if out is not None:
                used.append(id(owner))
            return out

        def joint_projection(self, owner, x):  # the decode step's (_decode_step)
            used.append(id(owner))
            return super().joint_projection(owner, x)

    if packed:
        packer = Counted(model, 4 * n)
        # Every projection of every layer, where torch has MKL (the llama's with biases): o and
        # down alone, q/k/v and gate/up each as one matrix.
        mkl = torch.backends.mkl.is_available()
        assert len(packer.packed) == (2 * 2 if mkl else 0)
        assert len(packer.joint) == (2 * 2 if mkl else 0)
        assert sorted(widths for *_, widths in packer.joint.values()) == (
            [[32, 16, 16], [32, 16, 16], [48, 48], [48, 48]] if mkl else []
        )
        extra["linear"] = packer
    new = torch.randint(2, VOCAB, (4 * n, steps), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = KVCache.empty(model, 4, ids.shape[1] + steps, torch.device("cpu"))
        first = lean_logits(model, ids, mask, positions, logits_to_keep=1, cache=cache)
        assert cache.length == ids.shape[1]
        cache = cache.repeat_interleave(n)
        all_ids = ids.repeat_interleave(n, dim=0)
        all_mask = mask.repeat_interleave(n, dim=0)
        position = positions.repeat_interleave(n, dim=0)[:, -1:]
        stepped = [first.repeat_interleave(n, dim=0)[:, 0]]
        for t in range(steps):
            position = position + 1
            token = new[:, t : t + 1]
            stepped.append(
                lean_logits(model, token, torch.ones_like(token), position, cache=cache, **extra)[
                    :, 0
                ]
            )
            all_ids = torch.cat([all_ids, token], dim=1)
            all_mask = torch.cat([all_mask, torch.ones_like(token)], dim=1)
        full_positions = (all_mask.cumsum(dim=1) - 1).clamp(min=0)
        whole = model(input_ids=all_ids, attention_mask=all_mask, position_ids=full_positions)
    width = ids.shape[1]
    assert len(used) == (steps * (len(packer.packed) + len(packer.joint)) if packed else 0)
    for t, logits in enumerate(stepped):
        torch.testing.assert_close(logits, whole.logits[:, width - 1 + t], rtol=1e-5, atol=1e-5)


class _GeneralLoop(PackedLinears):
    """Packed weights the decode step's fast path declines: the general per-layer loop."""

    def decodes(self, x):
        return False


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="packed weights need MKL")
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize(
    ("arch", "heads", "kv_heads", "prompts", "n", "scaling"),
    [
        ("qwen2", 4, 4, 3, 2, None),  # the CPU flash kernel, several prompts and samples
        ("qwen2", 4, 1, 2, 3, None),  # grouped KV heads: sdpa
        ("llama", 1, 1, 1, 1, 0.5),  # one head, one row, every bias, another scale
        ("llama", 4, 4, 2, 2, None),  # o_proj and down_proj biases through the flash kernel
    ],
)
def test_the_packed_decode_step_computes_what_the_general_loop_does(
    arch, heads, kv_heads, prompts, n, scaling, traced
):
    """lean._decode_step (a decode step with every layer packed) against the general loop
    over the same packed weights: the hidden states, the KV cache and, with a trace, every
    activation it records, to float rounding (its RMSNorm and RoPE are written differently)."""
    from alignzoo.kernels.trace import DecodeTrace

    model = _model(arch, kv_heads, num_attention_heads=heads, head_dim=8).eval()
    if scaling is not None:
        for layer in model.model.layers:
            layer.self_attn.scaling = scaling
    ids, mask, positions = _inputs(rows=prompts, width=5)
    steps, capacity = 3, 5 + 3

    def decode(packed_cls):
        trace = DecodeTrace(model, prompts, n, capacity) if traced else None
        generator = torch.Generator().manual_seed(2)
        cache = KVCache.empty(model, prompts, capacity, torch.device("cpu"))
        with torch.no_grad():
            lean_hidden(model, ids, mask, positions, 1, cache, None, trace=trace)
            cache = cache.repeat_interleave(n)
            packed = packed_cls(model, prompts * n)
            position = positions.repeat_interleave(n, dim=0)[:, -1:]
            hidden = []
            for _ in range(steps):
                position = position + 1
                token = torch.randint(2, VOCAB, (prompts * n, 1), generator=generator)
                out = lean_hidden(
                    model, token, torch.ones_like(token), position, 1, cache, packed, trace=trace
                )
                hidden.append(out.clone())
        return hidden, cache, trace, packed

    fast, fast_cache, fast_trace, packed = decode(PackedLinears)
    general, general_cache, general_trace, _ = decode(_GeneralLoop)
    with torch.no_grad():  # the premise: the fast path ran
        assert packed.decodes(torch.zeros(1, 32))
    for a, b in zip(fast, general, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fast_cache.length == general_cache.length == capacity
    for a, b in zip(
        fast_cache.keys + fast_cache.values, general_cache.keys + general_cache.values, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if not traced:
        return
    for name in ("h", "q", "o", "m", "gate_up"):
        for a, b in zip(getattr(fast_trace, name), getattr(general_trace, name), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(fast_trace.out, general_trace.out, rtol=1e-5, atol=1e-5)
    flash = heads == kv_heads
    assert (fast_trace.logsumexp is not None) == (general_trace.logsumexp is not None) == flash
    if flash:
        for a, b in zip(fast_trace.logsumexp, general_trace.logsumexp, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="packed weights need MKL")
def test_a_one_token_prefill_with_packed_weights_fills_every_sample_of_the_trace():
    """A width-1 call over the prompts' rows (before their n samples) with packed weights and
    a trace is no decode step: the general loop runs and records each prompt for its n
    samples, as over unpacked weights."""
    from alignzoo.kernels.trace import DecodeTrace

    model = _model("qwen2", 4).eval()
    prompts, n = 2, 3
    token = torch.tensor([[5], [9]])
    ones, positions = torch.ones_like(token), torch.zeros_like(token)
    traces = []
    for packed in (PackedLinears(model, prompts), None):
        trace = DecodeTrace(model, prompts, n, 1)
        for buffer in trace.h + trace.m + trace.gate_up + [trace.out]:
            buffer.fill_(float("nan"))
        cache = KVCache.empty(model, prompts, 1, torch.device("cpu"))
        with torch.no_grad():
            lean_hidden(model, token, ones, positions, 1, cache, packed, trace=trace)
        traces.append(trace)
    fast, plain = traces
    for name in ("h", "m", "gate_up"):
        for a, b in zip(getattr(fast, name), getattr(plain, name), strict=True):
            assert not a.isnan().any(), name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert not fast.out.isnan().any()
    torch.testing.assert_close(fast.out[0, 0], fast.out[0, 2])  # prompt 0's samples alike


def test_a_lora_model_runs_its_adapters_and_its_disable_switch():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _model("qwen2"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    with torch.no_grad():  # adapters that change the output (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    model.eval()
    assert lean_reason(model) is None
    ids, mask, positions = _inputs()
    real = mask.bool()
    with torch.no_grad():
        adapted = lean_logits(model, ids, mask, positions)
        # Packed weights are the base layers' only: the adapted projections run their own
        # forward, so decoding with them still applies the adapters.
        packed = lean_logits(model, ids, mask, positions, linear=PackedLinears(model, 5))
        torch.testing.assert_close(packed, adapted, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            adapted[real],
            model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[real],
            rtol=1e-5,
            atol=1e-5,
        )
        with model.disable_adapter():
            plain = lean_logits(model, ids, mask, positions)
            theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(plain[real], theirs[real], rtol=1e-5, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-3  # the adapters were really on, then off


def test_what_the_lean_path_cannot_run_exactly_is_refused_with_a_reason():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    assert "GPT2LMHeadModel is not one of" in lean_reason(gpt2)

    sliding = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding" in lean_reason(sliding)

    scaled = _model(
        "llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    )
    assert "rope_type 'linear'" in lean_reason(scaled)

    checkpointed = _model("qwen2")
    checkpointed.activation_checkpointing_enable()
    assert "checkpointing" in lean_reason(checkpointed)

    hooked = _model("qwen2")
    hooked.model.layers[1].register_forward_hook(lambda *a: None)
    assert "forward hooks" in lean_reason(hooked)

    eager = _model("qwen2", attn_implementation="eager")
    assert "attn_implementation 'eager'" in lean_reason(eager)

    dropout = _model("qwen2", attention_dropout=0.1)
    assert lean_reason(dropout.eval()) is None  # no dropout in eval mode
    assert "dropout" in lean_reason(dropout.train())


# A forward with gradients at the 25.8M benchmark model's layer shapes (4 of its 8 layers,
# 64 x 134 tokens), in a process whose malloc keeps freed memory (alignzoo.engine.malloc):
# how much the heap grew beyond what the forward keeps for the backward pass.
HEAP_HOLES = """
import ctypes, json, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from alignzoo.kernels import lean
from alignzoo.engine.malloc import keep_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
assert keep_freed_memory()
if sys.argv[1] == "plain":
    lean.RECOMPUTE_FROM = 1 << 62  # the plain autograd ops
torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(
    vocab_size=97, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256))
ids = torch.randint(0, 97, (64, 134))
mask = torch.ones_like(ids)
before = libc.mallinfo2()
logits = lean.lean_logits(model, ids, mask, mask.cumsum(1) - 1)
after = libc.mallinfo2()
print(json.dumps({
    "kept": after.uordblks - before.uordblks,
    "holes": (after.arena - after.uordblks) - (before.arena - before.uordblks),
}))
"""


def _heap_after_forward(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", HEAP_HOLES, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="reads glibc's mallinfo2")
def test_the_fused_training_forward_leaves_no_holes_in_the_heap():
    """Every large temporary of the fused forward (a chunk of silu(gate) * up, RoPE's half
    copy, a norm's chunk) is freed before the next kept activation is allocated, so the heap
    grows by what the forward keeps and little more. The plain ops free projection outputs,
    RoPE's four temporaries and the MLP's product after later activations were placed above
    them: holes that the next, larger activation does not fit."""
    fused = _heap_after_forward("fused")
    assert fused["holes"] < 0.1 * fused["kept"], fused
    plain = _heap_after_forward("plain")
    assert plain["holes"] > 3 * fused["holes"], (
        f"premise broken: the plain ops should leave more holes in the heap, got {plain} "
        f"against the fused forward's {fused}"
    )
    assert fused["kept"] < plain["kept"]  # the recomputing functions keep less, too
