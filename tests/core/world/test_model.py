"""The embedded model saves with save_pretrained and reloads through the Auto classes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignzoo.config.schema import EmbeddedModelConfig
from alignzoo.world.model import build_model, save_policy
from alignzoo.world.tokenizer import build_tokenizer

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_save_reload_identical_logits_and_generates(tmp_path, arch):
    tok = build_tokenizer()
    cfg = EmbeddedModelConfig(architecture=arch, **TINY)
    model = build_model(cfg, tok).eval()
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok)
    assert model.get_input_embeddings().weight.data_ptr() == model.lm_head.weight.data_ptr()
    folder = save_policy(model, tok, tmp_path / "policy")
    assert (folder / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".policy.tmp-*"))

    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ltok = AutoTokenizer.from_pretrained(folder)
    batch = ltok(["12+7=", "3+45="], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = model(**batch).logits
        b = loaded(**batch).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)

    out = loaded.generate(**batch, max_new_tokens=5, do_sample=False)
    prompt_len = batch["input_ids"].shape[1]
    assert torch.equal(out[:, :prompt_len], batch["input_ids"])
    assert prompt_len < out.shape[1] <= prompt_len + 5
    # Greedy generation of the reloaded model matches the original.
    assert torch.equal(out, model.generate(**batch, max_new_tokens=5, do_sample=False))


def test_seed_determines_weights():
    tok = build_tokenizer()
    a = build_model(EmbeddedModelConfig(seed=1, **TINY), tok)
    b = build_model(EmbeddedModelConfig(seed=1, **TINY), tok)
    c = build_model(EmbeddedModelConfig(seed=2, **TINY), tok)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_model(EmbeddedModelConfig(**TINY), build_tokenizer())
    assert torch.equal(torch.rand(3), expected)


def test_save_policy_replaces_existing_folder(tmp_path):
    tok = build_tokenizer()
    folder = tmp_path / "p"
    save_policy(build_model(EmbeddedModelConfig(seed=1, **TINY), tok), tok, folder)
    (folder / "stale.txt").write_text("old")
    m2 = build_model(EmbeddedModelConfig(seed=2, **TINY), tok)
    save_policy(m2, tok, folder)
    assert not (folder / "stale.txt").exists()
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(loaded.lm_head.weight, m2.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["p"]


def test_indivisible_heads_rejected():
    with pytest.raises(ValueError, match="divisible"):
        build_model(EmbeddedModelConfig(hidden_size=30, num_heads=4), build_tokenizer())
