"""The embedded policy: warm start, cache (key, reuse, atomicity, locking) and exact match."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignzoo.config.schema import EmbeddedModelConfig, ModelConfig, TaskConfig
from alignzoo.errors import UserError
from alignzoo.world import warmstart
from alignzoo.world.model import METADATA_FILE, build_model
from alignzoo.world.task import make_examples
from alignzoo.world.tokenizer import build_tokenizer
from alignzoo.world.warmstart import (
    IGNORE_INDEX,
    _encode_sft,
    cache_key,
    ensure_policy,
    greedy_exact_match,
    read_metadata,
    supervised_warm_start,
)

TINY = EmbeddedModelConfig(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_steps=40, sft_batch_size=16
)
TASK = TaskConfig(train_size=200, eval_size=20)


class Log(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in self)


def _tiny_model_cfg(**changes) -> ModelConfig:
    return ModelConfig(embedded=TINY.model_copy(update=changes))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    log = Log()
    folder = ensure_policy(_tiny_model_cfg(), TASK, cache_dir=cache, log=log)
    return cache, folder, log


def test_build_writes_a_loadable_policy(built):
    _, folder, log = built
    assert log.has("building")
    for name in ("config.json", "model.safetensors", "tokenizer.json", METADATA_FILE):
        assert (folder / name).is_file(), name
    meta = read_metadata(folder)
    assert meta["embedded"] == TINY.model_dump(mode="json")
    assert meta["task"] == TASK.model_dump(mode="json")
    assert 0.0 <= meta["eval_exact_match"] <= 1.0 and meta["eval_size"] == 20
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.hidden_size == 32 and model.config.model_type == "qwen2"
    enc = tok(["12+7="], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]
    # The stored exact match is what the reloaded model scores.
    examples = make_examples(TASK, "eval")
    assert greedy_exact_match(model, tok, examples, 5) == pytest.approx(meta["eval_exact_match"])


def test_second_call_uses_the_cache(built):
    cache, folder, _ = built
    weights = folder / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    log = Log()
    again = ensure_policy(_tiny_model_cfg(), TASK, cache_dir=cache, log=log)
    assert again == folder
    assert log.has("using cached") and not log.has("building")
    assert weights.stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("model.safetensors", lambda b: b[: len(b) // 2]),  # a copy cut short
        ("model.safetensors", lambda b: b""),
        (METADATA_FILE, lambda b: b"\x00\xff"),
        ("config.json", None),  # removed
    ],
)
def test_a_damaged_cache_entry_is_rebuilt(tmp_path, name, damage):
    cfg = _tiny_model_cfg(sft_steps=5)
    folder = ensure_policy(cfg, TASK, cache_dir=tmp_path, log=Log())
    target = folder / name
    if damage is None:
        target.unlink()
    else:
        target.write_bytes(damage(target.read_bytes()))
    log = Log()
    again = ensure_policy(cfg, TASK, cache_dir=tmp_path, log=log)
    assert again == folder
    assert log.has("damaged") and log.has(name if damage is not None else "config.json")
    assert log.has("building")
    AutoModelForCausalLM.from_pretrained(folder)  # whole again
    assert read_metadata(folder)["embedded"]["sft_steps"] == 5


def test_cache_key_depends_on_both_configs():
    base = cache_key(TINY, TASK)
    assert base == cache_key(TINY.model_copy(), TaskConfig(train_size=200, eval_size=20))
    assert cache_key(TINY.model_copy(update={"seed": 1}), TASK) != base
    assert cache_key(TINY.model_copy(update={"sft_steps": 41}), TASK) != base
    assert cache_key(TINY, TASK.model_copy(update={"digits": 3})) != base


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "envcache"))
    assert warmstart.cache_root() == tmp_path / "envcache"
    monkeypatch.delenv("ALIGNZOO_CACHE")
    assert warmstart.cache_root() == Path.home() / ".cache" / "alignzoo"


def test_path_policy_passes_through(tmp_path):
    assert ensure_policy(ModelConfig(policy=str(tmp_path)), TASK) == tmp_path
    with pytest.raises(UserError, match=r"model\.policy"):
        ensure_policy(ModelConfig(policy=str(tmp_path / "missing")), TASK)


def test_failed_build_leaves_no_folder(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("killed while saving")

    monkeypatch.setattr(type(build_tokenizer()), "save_pretrained", boom)
    cfg = _tiny_model_cfg(sft_steps=2)
    with pytest.raises(RuntimeError, match="killed"):
        ensure_policy(cfg, TASK, cache_dir=tmp_path, log=Log())
    folder = tmp_path / "embedded" / cache_key(cfg.embedded, TASK)
    assert not folder.exists()
    assert [p.name for p in (tmp_path / "embedded").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    log = Log()
    assert ensure_policy(cfg, TASK, cache_dir=tmp_path, log=log) == folder
    assert log.has("building") and (folder / METADATA_FILE).is_file()


def test_concurrent_builds_of_one_key_build_once(tmp_path):
    cfg = _tiny_model_cfg(sft_steps=5)
    log = Log()
    results: list[Path] = []

    def build():
        results.append(ensure_policy(cfg, TASK, cache_dir=tmp_path, log=log))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert sum("building" in line for line in log) == 1
    assert sum("using cached" in line for line in log) == 1


def test_sft_labels_only_answer_and_eos():
    tok = build_tokenizer()
    ids, mask, labels = _encode_sft(
        tok, [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+20=", "answer": "30"}]
    )
    assert ids.shape == (2, 9) and mask[0].tolist() == [1] * 6 + [0] * 3
    eos = tok.eos_token_id
    assert labels[0].tolist()[:4] == [IGNORE_INDEX] * 4
    assert labels[0].tolist()[4:6] == [tok.convert_tokens_to_ids("3"), eos]
    assert labels[0].tolist()[6:] == [IGNORE_INDEX] * 3
    assert labels[1].tolist()[:6] == [IGNORE_INDEX] * 6
    assert tok.decode(labels[1, 6:8]) == "30" and labels[1, 8] == eos


def test_warm_start_memorises_and_exact_match_measures_it():
    tok = build_tokenizer()
    cfg = EmbeddedModelConfig(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        sft_steps=150,
        sft_lr=1e-2,
        sft_batch_size=8,
        seed=3,
    )
    examples = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(10, 16)]
    model = build_model(cfg, tok)
    assert greedy_exact_match(model, tok, examples, 4) == 0.0
    loss = supervised_warm_start(model, tok, examples, cfg, log=Log())
    assert loss < 0.1
    assert not model.training
    assert greedy_exact_match(model, tok, examples, 4, batch_size=4) == 1.0
    wrong = [{**ex, "answer": str(int(ex["answer"]) + 1)} for ex in examples]
    assert greedy_exact_match(model, tok, wrong, 4) == 0.0
    half = examples[:3] + wrong[3:]
    assert greedy_exact_match(model, tok, half, 4) == 0.5


def test_warm_start_is_seeded():
    tok = build_tokenizer()
    cfg = TINY.model_copy(update={"sft_steps": 5})
    examples = make_examples(TASK, "train")
    a, b = build_model(cfg, tok), build_model(cfg, tok)
    supervised_warm_start(a, tok, examples, cfg, log=Log())
    supervised_warm_start(b, tok, examples, cfg, log=Log())
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.slow
def test_default_warm_start_reaches_target(tmp_path):
    log = Log()
    folder = ensure_policy(ModelConfig(), TaskConfig(), cache_dir=tmp_path, log=log)
    meta = read_metadata(folder)
    assert meta["eval_exact_match"] >= 0.15, log


def test_sft_of_a_calculator_trace_labels_the_models_part_and_not_the_tools():
    from alignzoo.world.calculator import tool_trace

    tok = build_tokenizer()
    trace = {"prompt": "12*34=", "segments": tool_trace("12*34=")}
    ids, _, labels = _encode_sft(tok, [trace])
    text = tok.decode(ids[0])
    assert text == "12*34=[12*34]=408\n408<|endoftext|>"
    trained = tok.decode([t for t in labels[0].tolist() if t != IGNORE_INDEX])
    assert trained == "[12*34]408<|endoftext|>"  # the prompt and '=408\n' are not trained on


def test_fields_added_later_keep_the_cache_key_of_policies_built_before_them():
    import hashlib
    import json

    from alignzoo.config.schema import TaskConfig
    from alignzoo.world.warmstart import FORMAT_VERSION, cache_key

    task = TaskConfig()
    plain = EmbeddedModelConfig()
    assert cache_key(plain, task) == cache_key(EmbeddedModelConfig(sft_tool_share=0.0), task)
    assert cache_key(plain, task) != cache_key(EmbeddedModelConfig(sft_tool_share=0.2), task)
    assert cache_key(plain, task) != cache_key(EmbeddedModelConfig(sft_on="train"), task, {})
    # The key as it was computed before the fields existed.
    added = ("sft_tool_share", "sft_on")
    fields = {k: v for k, v in plain.model_dump(mode="json").items() if k not in added}
    payload = {"format": FORMAT_VERSION, "embedded": fields, "task": task.model_dump(mode="json")}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    assert cache_key(plain, task) == digest
