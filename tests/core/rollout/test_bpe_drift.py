"""No drift with a real chat model's tokenizer (hf backend): on a Qwen2-style BPE tokenizer with
merges and a Qwen2.5-style tool-calling template, random episodes train on exactly the ids the
backend sampled, with the environment's answers tokenised once between them, and the trainer's
log-probs of the sampled ids equal the sampler's. The vLLM backend's run of the same property
is in tests/plugins/backends/test_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignzoo.config.schema import EpisodeConfig
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.registry import build_plugin_manager
from alignzoo.rollout.multiturn import Episodes
from alignzoo.types import SamplingParams

from .bpe_chat import Answers, Recorder, check_token_in_token_out, save_bpe_chat_policy


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
    folder = save_bpe_chat_policy(tmp_path_factory.mktemp("bpe") / "policy")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)  # as a user loads a checkpoint
    return model, tokenizer


def run_episodes(chat_policy, rows, seeds, max_new_tokens, temperature=1.0):
    model, tokenizer = chat_policy
    backend = HFBackend()
    backend.on_run_start(
        run=SimpleNamespace(device=lambda role: "cpu", actor=model, tokenizer=tokenizer)
    )
    recorder = Recorder(backend)
    pm = build_plugin_manager([recorder, Answers()])
    episodes = Episodes(EpisodeConfig(max_turns=4, max_tokens=160), tokenizer)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    prompts = [r["prompt"] for r in rows]
    batch, metrics = episodes.run(pm, prompts, rows, 2, sampling, seeds)
    return batch, metrics, recorder


def test_the_template_is_read_as_hermes_and_offers_the_tools(chat_policy):
    _, tokenizer = chat_policy
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and len(tokenizer) > 600  # merges
    episodes = Episodes(EpisodeConfig(), tokenizer)
    assert episodes.codec.name == "hermes"
    assert tokenizer.convert_ids_to_tokens(episodes.stop_ids) == ["<|im_end|>"]
    start = episodes.renderer.start([{"role": "user", "content": "2*3?"}], [{"type": "function",
        "function": {"name": "calculator", "parameters": {}}}])  # fmt: skip
    assert "<tools>" in start and '"calculator"' in start and start.endswith("assistant\n")


texts = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=0, max_size=24
)


@settings(max_examples=12, deadline=None)
@given(
    answers=st.lists(st.lists(texts, min_size=0, max_size=3), min_size=2, max_size=2),
    seeds=st.lists(st.integers(0, 2**31), min_size=2, max_size=2),
    max_new_tokens=st.integers(1, 12),
)
def test_random_episodes_train_on_exactly_the_sampled_ids(
    chat_policy, answers, seeds, max_new_tokens
):
    rows = [
        {"prompt": "What is 12*34?", "answers": answers[0]},
        {"prompt": "Weather in Paris, then add 3 and 4.", "answers": answers[1]},
    ]
    batch, metrics, recorder = run_episodes(chat_policy, rows, seeds, max_new_tokens)
    model, tokenizer = chat_policy
    assert batch.size == 4 and metrics["env/error_frac"] == 0.0
    check_token_in_token_out(batch, recorder, tokenizer, model)


def test_re_tokenising_these_episodes_would_drift(chat_policy):
    """The premise that makes the property above meaningful: with this tokenizer, the text of
    sampled episodes does not encode back to their ids, so appending ids is what keeps them."""
    rows = [{"prompt": "What is 12*34?", "answers": ["408", "the result"]}] * 2
    batch, _, recorder = run_episodes(chat_policy, rows, [1, 2], 12)
    model, tokenizer = chat_policy
    drifted = check_token_in_token_out(batch, recorder, tokenizer, model)
    assert drifted >= 1, "premise broken: every sampled episode re-tokenises to its own ids"
