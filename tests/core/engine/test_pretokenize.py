"""Offline rows are tokenised once before training: the batches are the same as tokenising
each step, the tokenizer is not called again, and nothing is written to disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
import torch

from alignzoo.config.schema import DataConfig
from alignzoo.engine.datasets import load_split
from alignzoo.engine.modes.preference import OfflinePreference, preference_batch
from alignzoo.engine.modes.unpaired import OfflineUnpaired, unpaired_batch
from alignzoo.engine.tokenize import is_token_column, token_column
from alignzoo.world.tokenizer import build_tokenizer

TENSORS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "labels")


class CountingTokenizer:
    """The embedded tokenizer, counting how often it is asked to encode."""

    def __init__(self) -> None:
        self.inner = build_tokenizer()
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


CASES = [
    ("preference", OfflinePreference, preference_batch, ("prompt", "chosen", "rejected")),
    ("unpaired", OfflineUnpaired, unpaired_batch, ("prompt", "completion")),
]


@pytest.mark.parametrize(("kind", "mode_cls", "build", "texts"), CASES)
def test_pretokenised_rows_give_the_batch_tokenising_each_step_gives(
    kind, mode_cls, build, texts
) -> None:
    tokenizer = CountingTokenizer()
    raw = load_split(DataConfig(), "train", kind, tokenizer.inner)
    mapped = mode_cls().tokenize(raw, tokenizer)
    assert {token_column(c) for c in texts} <= set(mapped.column_names)
    assert tokenizer.calls >= 1  # the whole column, before training
    rows_raw = [raw[i] for i in range(12)]
    rows_ids = [mapped[i] for i in range(12)]

    expected = build(tokenizer, rows_raw, 8)  # cut to 8 tokens: the cut applies to read ids too
    calls = tokenizer.calls
    got = build(tokenizer, rows_ids, 8)
    assert tokenizer.calls == calls, "a step over pretokenised rows called the tokenizer"
    for name in TENSORS:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.extras == expected.extras
    assert not any(is_token_column(k) for extra in got.extras for k in extra)
    assert got.prompts == expected.prompts and got.responses == expected.responses


def test_pretokenising_writes_no_cache_file(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        '{"prompt": "1+2=", "chosen": "3", "rejected": "4"}\n'
        '{"prompt": "2+2=", "chosen": "4", "rejected": "5"}\n'
    )
    cache = tmp_path / "hf-cache"
    raw = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache)
    before = sorted(p for p in tmp_path.rglob("*"))
    mapped = OfflinePreference().tokenize(raw, build_tokenizer())
    assert sorted(p for p in tmp_path.rglob("*")) == before
    # The texts stay in the dataset's own (memory-mapped) file; only the ids are new, in memory.
    assert raw.cache_files and mapped.cache_files == raw.cache_files
    tokenizer = build_tokenizer()
    assert mapped[0][token_column("prompt")] == tokenizer("1+2=")["input_ids"]
    assert (
        mapped[1][token_column("chosen")] == tokenizer("4", add_special_tokens=False)["input_ids"]
    )


def test_an_online_mode_leaves_its_prompts_as_text() -> None:
    from alignzoo.engine.modes.samples import OnlineSamples

    raw = load_split(DataConfig(), "train", "online")
    assert OnlineSamples().tokenize(raw, build_tokenizer()) is raw
