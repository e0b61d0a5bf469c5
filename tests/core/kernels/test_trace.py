"""The update's backward pass against the decode loop's activations (alignzoo.kernels.trace)
gives the gradient of autograd through the lean forward, for Qwen2 and Llama, grouped KV heads,
biases, padded prompts, responses that end early and any subset of the rows in any order; a
trace never serves a batch it did not record or weights that changed since."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from alignzoo.kernels import trace as decode_trace
from alignzoo.kernels.forward import policy_outputs
from alignzoo.plugins.backends.hf import PACK_FROM_NEW_TOKENS, HFBackend
from alignzoo.types import SamplingParams
from alignzoo.world.tokenizer import build_tokenizer

PROMPTS = ["12+7=", "3+45=", "100+250="]  # different lengths: left padding
NEW_TOKENS = PACK_FROM_NEW_TOKENS


def _model(arch: str, tokenizer, kv_heads: int = 4) -> torch.nn.Module:
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=arch == "qwen2",
    )
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **common))
    with torch.no_grad():  # random biases and norm weights: a backward that skipped one differs
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
            elif name.endswith("proj.weight"):
                p.mul_(4.0)  # context-dependent logits: attention and MLP matter
        eos = model.get_input_embeddings().weight
        eos[tokenizer.eos_token_id] *= 3.0  # some responses end early, at varied lengths
    return model


def _sample(
    model, tokenizer, n: int = 3, record: bool = True, new_tokens: int = NEW_TOKENS, **params
):
    backend = HFBackend(params)
    backend.on_run_start(
        SimpleNamespace(tokenizer=tokenizer, device=lambda role: "cpu", actor=model)
    )
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    with decode_trace.recording(record):
        batch = backend.generate(PROMPTS, [], n, sampling, seeds=[1, 2, 3])
    batch.sampling = torch.tensor([[1.0, 0.0, 1.0]]).expand(batch.size, -1).clone()
    return batch


def _loss_and_grads(
    model, batch, weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = policy_outputs(model, batch, entropy=True)
    mask = batch.response_mask
    loss = (out.logprobs * weights * mask).sum() + 0.1 * (out.entropy * mask).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), grads


def _forbid_the_forward(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the lean forward ran where the trace should serve")

    monkeypatch.setattr("alignzoo.kernels.forward.lean_hidden", refuse)
    monkeypatch.setattr("alignzoo.kernels.forward.lean_logits", refuse)


def _assert_traced_equals_forward(model, batch, seed: int, monkeypatch) -> None:
    """The traced pass's log-probs and every gradient (the lean forward forbidden) equal the
    lean forward's once the trace is released."""
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(seed))
    with monkeypatch.context() as patched:
        _forbid_the_forward(patched)
        traced_logprobs, traced = _loss_and_grads(model, batch, weights)
    decode_trace.release()
    logprobs, expected = _loss_and_grads(model, batch, weights)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(traced_logprobs[mask], logprobs[mask], rtol=1e-5, atol=1e-5)
    assert set(traced) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(traced[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("arch", "kv_heads"), [("qwen2", 4), ("qwen2", 2), ("llama", 1)])
def test_the_traced_gradient_equals_autograd_through_the_forward(arch, kv_heads, monkeypatch):
    tokenizer = build_tokenizer()
    model = _model(arch, tokenizer, kv_heads)
    batch = _sample(model, tokenizer)
    lengths = batch.response_mask.sum(1)
    assert lengths.min() < lengths.max(), "premise: responses of different lengths"
    assert decode_trace.current() is not None, "premise: the decode loop recorded a trace"
    _assert_traced_equals_forward(model, batch, 0, monkeypatch)


@pytest.mark.parametrize("kv_heads", [4, 2])  # the flash kernel's backward, and the matmuls'
def test_a_micro_batch_is_any_subset_of_the_rows_in_any_order(kv_heads, monkeypatch):
    tokenizer = build_tokenizer()
    model = _model("qwen2", tokenizer, kv_heads)
    batch = _sample(model, tokenizer)
    _assert_traced_equals_forward(model, batch.select([7, 0, 4, 2]), 1, monkeypatch)


def test_without_gradients_the_trace_gives_the_forwards_log_probs(monkeypatch):
    """A no-grad pass over a traced batch (the behaviour's) reads the recorded hidden states."""
    tokenizer = build_tokenizer()
    model = _model("qwen2", tokenizer)
    batch = _sample(model, tokenizer)
    with torch.no_grad(), monkeypatch.context() as patched:
        _forbid_the_forward(patched)
        traced = policy_outputs(model, batch).logprobs
    decode_trace.release()
    with torch.no_grad():
        expected = policy_outputs(model, batch).logprobs
    mask = batch.response_mask.bool()
    torch.testing.assert_close(traced[mask], expected[mask], rtol=1e-5, atol=1e-5)


def test_a_trace_never_serves_changed_weights_or_samples_it_did_not_record():
    tokenizer = build_tokenizer()
    model = _model("qwen2", tokenizer)
    batch = _sample(model, tokenizer)
    trace = decode_trace.current()
    assert trace is not None and decode_trace.traced_hidden(model, batch) is not None

    other = batch.select(list(range(batch.size)))
    other.response_ids = other.response_ids.clone()
    other.response_ids[2, 0] = (other.response_ids[2, 0] + 1) % len(tokenizer)
    assert decode_trace.traced_hidden(model, other) is None, "a sample it did not record"
    wider = batch.select([0, 1])
    wider.response_ids = torch.nn.functional.pad(wider.response_ids, (0, 1), value=0)
    assert decode_trace.traced_hidden(model, wider) is None, "another layout"
    assert decode_trace.traced_hidden(_model("qwen2", tokenizer), batch) is None, "another model"

    holed = batch.select(list(range(batch.size)))
    holed.response_mask = holed.response_mask.clone()
    holed.response_mask[0, 3] = 0.0  # a token cut since sampling: the forward skips it as a key
    assert decode_trace.traced_hidden(model, holed) is None, "a mask it did not record"
    attending = batch.select([0, 1])
    attending.response_attention = attending.response_mask.long()
    assert decode_trace.traced_hidden(model, attending) is None, "an episode's attention"

    model.train()
    model.config.attention_dropout = 0.1  # in train mode the lean forward would refuse it
    assert decode_trace.traced_hidden(model, batch) is None, "attention dropout in training"
    model.config.attention_dropout = 0.0
    assert decode_trace.traced_hidden(model, batch) is not None

    with torch.no_grad():  # the LM head alone changed: its input is still recorded, but
        model.lm_head.weight.add_(1e-3)  # any weight that changed ends the trace
    assert decode_trace.traced_hidden(model, batch) is None, "changed weights"


def test_one_recording_block_records_its_first_decode_loop_only():
    """A later loop in the block (a labeler sampling the policy) leaves the batch's trace."""
    tokenizer = build_tokenizer()
    model = _model("qwen2", tokenizer)
    backend = HFBackend({})
    backend.on_run_start(
        SimpleNamespace(tokenizer=tokenizer, device=lambda role: "cpu", actor=model)
    )
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    with decode_trace.recording():
        first = backend.generate(PROMPTS, [], 2, sampling, seeds=[1, 2, 3])
        kept = decode_trace.current()
        backend.generate(PROMPTS[:1], [], 2, sampling, seeds=[4])
    assert kept is not None and decode_trace.current() is kept
    assert decode_trace.traced_hidden(model, first) is not None


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("outside recording", None),
        ("fewer new tokens", None),
        ("several decode loops", None),
        ("frozen layers", "no layer weight is trained"),
        ("bf16 autocast", "autocast"),
        ("recording", "recorded"),
    ],
)
def test_what_records_a_trace(setting, expected):
    tokenizer = build_tokenizer()
    model = _model("qwen2", tokenizer)
    decode_trace.release()
    if setting == "frozen layers":
        model.model.layers.requires_grad_(False)
    if setting == "bf16 autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert decode_trace.why_not(model) == "autocast"
        return
    if expected is not None and expected != "recorded":
        assert decode_trace.why_not(model) == expected
    _sample(
        model,
        tokenizer,
        record=setting != "outside recording",
        new_tokens=NEW_TOKENS - 1 if setting == "fewer new tokens" else NEW_TOKENS,
        max_batch_size=2 if setting == "several decode loops" else 64,
    )
    assert (decode_trace.current() is not None) == (expected == "recorded")


def test_an_adapter_is_refused_with_a_reason():
    from peft import LoraConfig, get_peft_model

    tokenizer = build_tokenizer()
    model = get_peft_model(_model("qwen2", tokenizer), LoraConfig(r=2, target_modules=["q_proj"]))
    assert decode_trace.why_not(model) == "Linear is not a bare nn.Linear (an adapter)"


def test_data_parallel_and_a_backend_with_its_own_copy_record_nothing(tmp_path):
    tokenizer = build_tokenizer()
    model = _model("qwen2", tokenizer)
    decode_trace.release()
    _sample(model, tokenizer, weights="copy")  # samples with a copy the trainer never trains
    assert decode_trace.current() is None
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1
    )
    try:
        assert decode_trace.why_not(model).startswith("data parallel")
    finally:
        torch.distributed.destroy_process_group()
    assert decode_trace.why_not(model) is None
