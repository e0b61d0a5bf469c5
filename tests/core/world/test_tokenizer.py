"""The embedded tokenizer round-trips text, also after a reload from a Qwen2/Llama model folder."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from alignzoo.config.schema import EmbeddedModelConfig
from alignzoo.world.model import build_model, save_policy
from alignzoo.world.tokenizer import build_tokenizer

PRINTABLE = st.text(alphabet=string.printable, max_size=60)

TINY = dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def reloaded(request, tmp_path_factory):
    tok = build_tokenizer()
    model = build_model(EmbeddedModelConfig(architecture=request.param, **TINY), tok)
    folder = save_policy(model, tok, tmp_path_factory.mktemp("tok") / "policy")
    return tok, AutoTokenizer.from_pretrained(folder)


def test_each_digit_and_printable_char_is_one_token():
    tok = build_tokenizer()
    for ch in string.printable:
        assert len(tok(ch, add_special_tokens=False)["input_ids"]) == 1, repr(ch)
    ids = tok("12+7=19", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7
    assert len(set(tok(d)["input_ids"][0] for d in string.digits)) == 10


def test_special_tokens_and_padding_side():
    tok = build_tokenizer()
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1
    assert tok.padding_side == "left"
    batch = tok(["1+1=", "12+34="], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]  # left padded
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    assert tok.decode(tok("9=")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "9="


@settings(max_examples=200, deadline=None)
@given(text=PRINTABLE)
def test_roundtrip_fresh(text):
    tok = build_tokenizer()
    assert tok.decode(tok(text)["input_ids"]) == text


@settings(max_examples=200, deadline=None)
@given(text=PRINTABLE)
def test_roundtrip_after_reload(reloaded, text):
    fresh, loaded = reloaded
    ids = loaded(text)["input_ids"]
    assert ids == fresh(text)["input_ids"]
    assert loaded.decode(ids) == text


def test_reload_keeps_spaces_and_specials(reloaded):
    fresh, loaded = reloaded
    text = "  12 + 7 =  19 "
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.eos_token_id) == (fresh.pad_token_id, fresh.eos_token_id)
    assert len(loaded) == len(fresh)
