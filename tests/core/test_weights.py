"""The weight stream a backend receives: the plain checkpoint's names, LoRA merged, nothing
of the training weights touched, any dtype, and a model loaded from it equals the trained one."""

from __future__ import annotations

import copy

import pytest
import torch

from alignzoo.weights import PolicyWeights


def tiny_qwen(tied: bool = True) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=48,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_a_plain_model_streams_its_own_state_dict(tied):
    model = tiny_qwen(tied)
    weights = PolicyWeights(model, 7)
    assert weights.version == 7 and repr(weights) == "PolicyWeights(version=7)"
    expected = model.state_dict()
    streamed = weights.state_dict()
    assert list(streamed) == list(expected) == weights.names()
    for name, tensor in streamed.items():
        assert torch.equal(tensor, expected[name]) and not tensor.requires_grad, name
    half = weights.state_dict(dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_lora_is_merged_without_touching_the_training_weights():
    peft = pytest.importorskip("peft")
    base = tiny_qwen()
    lora = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_()  # adapters that change the model (B starts at zero)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    streamed = PolicyWeights(lora, 1).state_dict()
    assert set(streamed) == set(base.state_dict())  # no peft names, no adapter tensors
    merged = copy.deepcopy(lora).merge_and_unload().state_dict()
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)
    changed = [n for n in streamed if not torch.equal(streamed[n], base.state_dict()[n])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
    for name, tensor in lora.state_dict().items():  # the training weights are as they were
        assert torch.equal(tensor, before[name]), name
    # A plain model loaded from the stream computes what the adapted one does.
    plain = tiny_qwen()
    plain.load_state_dict(streamed)
    ids = torch.randint(0, 48, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, lora(ids).logits, atol=1e-5, rtol=0)


def test_adapters_switched_off_stream_the_base_weights():
    peft = pytest.importorskip("peft")
    base = tiny_qwen()
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.fill_(1.0)
    with lora.disable_adapter():
        streamed = PolicyWeights(lora, 0).state_dict()
    for name, tensor in base.state_dict().items():
        assert torch.equal(streamed[name], tensor), name


def test_wrappers_are_looked_through():
    model = tiny_qwen()
    compiled = torch.compile(model)  # wraps without compiling until called
    assert PolicyWeights(compiled, 0).names() == list(model.state_dict())
