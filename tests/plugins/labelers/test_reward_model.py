"""The reward-model labeler: loads any local sequence classifier, scores in batches, frozen."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from alignzoo.errors import UserError
from alignzoo.plugins.labelers.reward_model import RewardModelLabeler
from alignzoo.registry import build_plugin_manager
from alignzoo.types import LabelRequest
from alignzoo.world.tokenizer import build_tokenizer

REQUESTS = [
    LabelRequest("12+7=", "19"),
    LabelRequest("3+45=", "48", {"answer": "48"}),
    LabelRequest("1+1=", "11111111"),
    LabelRequest("100+250=", "350"),
    LabelRequest("9+9=", ""),
    LabelRequest("2+2=", "4 and some more words"),
    LabelRequest("7+8=", "15"),
]


def save_reward_model(folder, num_labels: int = 1):
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a score head large enough that different texts score differently
        model.score.weight.mul_(50)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def started(path, **params) -> RewardModelLabeler:
    labeler = RewardModelLabeler({"path": str(path), **params})
    labeler.on_run_start(SimpleNamespace(device=lambda role: {"labeler": "cpu"}[role]))
    return labeler


def direct_scores(path, texts: list[str]) -> list[float]:
    """Each text alone, unpadded, through the model loaded by the user's path."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_batched_scores_equal_one_by_one_and_a_direct_forward(rm_dir):
    batched = started(rm_dir, batch_size=3).score_batch(REQUESTS)
    single = started(rm_dir, batch_size=1).score_batch(REQUESTS)
    direct = direct_scores(rm_dir, [r.prompt + r.response for r in REQUESTS])
    assert len(batched) == len(REQUESTS)
    values = [s.value for s in batched]
    torch.testing.assert_close(values, [s.value for s in single], atol=1e-5, rtol=0)
    torch.testing.assert_close(values, direct, atol=1e-5, rtol=0)
    assert len({round(v, 3) for v in values}) > 3  # scores depend on the text
    assert all(s.valid and isinstance(s.value, float) for s in batched)


def test_model_is_frozen_in_eval_mode_and_runs_without_grad(rm_dir):
    labeler = started(rm_dir)
    model = labeler.model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    # Someone flips it to training with gradients: scoring restores eval mode and no grad.
    model.train()
    model.requires_grad_(True)
    seen = []
    model.register_forward_hook(
        lambda module, args, out: seen.append((module.training, torch.is_grad_enabled()))
    )
    first = labeler.score_batch(REQUESTS[:2])
    assert seen == [(False, False)]
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    # Deterministic (no dropout) and unchanged by the detour.
    assert [s.value for s in first] == [s.value for s in labeler.score_batch(REQUESTS[:2])]


def test_one_batch_forward_per_batch_size(rm_dir):
    labeler = started(rm_dir, batch_size=3)
    sizes = []
    labeler.model.register_forward_hook(lambda m, args, out: sizes.append(out.logits.shape[0]))
    labeler.score_batch(REQUESTS)
    assert sizes == [3, 3, 1]
    assert labeler.score_batch([]) == []


def test_truncation_keeps_the_end_of_the_response(rm_dir):
    long_prompt = "1+" * 40 + "1="
    request = LabelRequest(long_prompt, "41")
    [score] = started(rm_dir, max_length=8).score_batch([request])
    tail = (long_prompt + "41")[-8:]  # one token per character
    assert score.value == pytest.approx(direct_scores(rm_dir, [tail])[0], abs=1e-5)


def test_normalize_standardises_each_batch_and_keeps_raw(rm_dir):
    raw = started(rm_dir).score_batch(REQUESTS)
    norm = started(rm_dir, normalize=True).score_batch(REQUESTS)
    values = torch.tensor([s.value for s in norm])
    assert values.mean().abs() < 1e-5 and (values.std(unbiased=False) - 1).abs() < 1e-4
    assert [s.info["raw"] for s in norm] == pytest.approx([s.value for s in raw], abs=1e-6)


def test_scores_through_the_labeler_hooks(rm_dir):
    labeler = started(rm_dir, batch_size=4)
    pm = build_plugin_manager([labeler])
    via_hook = pm.hook.score_batch(requests=REQUESTS)
    assert [s.value for s in via_hook] == pytest.approx(
        [s.value for s in labeler.score_batch(REQUESTS)], abs=1e-6
    )
    one = labeler.score(REQUESTS[0])  # the per-item method scores like the batched hook
    assert one.value == pytest.approx(via_hook[0].value, abs=1e-5)


def test_missing_path_names_the_param(tmp_path):
    labeler = RewardModelLabeler({"path": str(tmp_path / "nope")})
    with pytest.raises(UserError, match=r"labeler\.params\.path.*nope.*does not exist"):
        labeler.on_run_start(SimpleNamespace(device=lambda role: "cpu"))


def test_path_without_a_model_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"labeler\.params\.path: cannot load"):
        started(tmp_path)


def test_more_than_one_label_is_refused(tmp_path):
    path = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(UserError, match="num_labels=2"):
        started(path)


def test_chat_template_requires_one(rm_dir):
    with pytest.raises(UserError, match="no chat template"):
        started(rm_dir, template="chat")


def test_unused_before_start():
    with pytest.raises(RuntimeError, match="before on_run_start"):
        RewardModelLabeler({"path": "x"}).score_batch(REQUESTS)
