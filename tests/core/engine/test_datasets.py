"""load_split: embedded data per mode, TRL-format files (jsonl, parquet, folder), errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignzoo.config.schema import DataConfig, TaskConfig
from alignzoo.engine.datasets import load_split
from alignzoo.errors import UserError
from alignzoo.world.task import is_correct, make_examples

TASK = TaskConfig(train_size=50, eval_size=10)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(train: str = "embedded", **kw) -> DataConfig:
    return DataConfig(train=train, eval=kw.pop("eval", "embedded"), task=TASK, **kw)


# --------------------------------------------------------------------------- embedded


def test_embedded_online_matches_task():
    ds = load_split(_cfg(), "train", "online")
    assert ds.column_names == ["prompt", "answer"]
    assert ds.to_list() == make_examples(TASK, "train")
    assert load_split(_cfg(), "eval", "online").to_list() == make_examples(TASK, "eval")


def test_embedded_preference_pairs():
    ds = load_split(_cfg(), "train", "preference")
    assert set(ds.column_names) == {"prompt", "chosen", "rejected", "answer"}
    assert len(ds) == 50
    for row in ds:
        assert is_correct(row["chosen"], row["answer"])
        assert not is_correct(row["rejected"], row["answer"])
        assert row["rejected"].lstrip("-").isdigit()
    assert ds.to_list() == load_split(_cfg(), "train", "preference").to_list()


def test_embedded_unpaired_has_both_labels_per_prompt():
    ds = load_split(_cfg(), "eval", "unpaired")
    assert set(ds.column_names) == {"prompt", "completion", "label", "answer"}
    assert ds.features["label"].dtype == "bool"
    assert len(ds) == 20
    for good, bad in zip(ds.select(range(0, 20, 2)), ds.select(range(1, 20, 2)), strict=True):
        assert good["prompt"] == bad["prompt"]
        assert good["label"] is True and is_correct(good["completion"], good["answer"])
        assert bad["label"] is False and not is_correct(bad["completion"], bad["answer"])


def test_sample_ratio_is_seeded_subset_of_train_only():
    full = load_split(_cfg(), "train", "online").to_list()
    half = load_split(_cfg(sample_ratio=0.5), "train", "online").to_list()
    assert len(half) == 25
    assert half == load_split(_cfg(sample_ratio=0.5), "train", "online").to_list()
    positions = [full.index(row) for row in half]
    assert positions == sorted(positions)  # order kept
    assert positions != list(range(25))  # a random subset, not a prefix
    assert len(load_split(_cfg(sample_ratio=0.5), "eval", "online")) == 10
    assert len(load_split(_cfg(sample_ratio=0.001), "train", "online")) == 1


# --------------------------------------------------------------------------- files

ROWS = {
    "online": [
        {"prompt": "2+2=", "answer": "4", "source": "a"},
        {"prompt": "3+3=", "answer": "6", "source": "b"},
    ],
    "preference": [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5", "answer": "4"},
        {"prompt": "3+3=", "chosen": "6", "rejected": "7", "answer": "6"},
    ],
    "unpaired": [
        {"prompt": "2+2=", "completion": "4", "label": True},
        {"prompt": "3+3=", "completion": "7", "label": False},
    ],
}


def _write(fmt: str, path: Path, rows: list[dict]) -> Path:
    if fmt == "jsonl":
        return _write_jsonl(path.with_suffix(".jsonl"), rows)
    if fmt == "json":
        target = path.with_suffix(".json")
        target.write_text(json.dumps(rows))
        return target
    if fmt == "parquet":
        target = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), target)
        return target
    if fmt == "folder":
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
        return path
    if fmt == "dictfolder":
        datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_list(rows),
                "eval": datasets.Dataset.from_list(rows[:1]),
            }
        ).save_to_disk(str(path))
        return path
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "folder", "dictfolder"])
@pytest.mark.parametrize("mode", ["online", "preference", "unpaired"])
def test_files_load_with_trl_columns_and_extras(tmp_path, fmt, mode):
    path = _write(fmt, tmp_path / "data", ROWS[mode])
    ds = load_split(_cfg(train=str(path)), "train", mode)
    assert ds.to_list() == ROWS[mode]  # columns unchanged, extras kept
    if mode == "unpaired":
        assert ds.features["label"].dtype == "bool"


def test_dataset_dict_folder_picks_the_split(tmp_path):
    path = _write("dictfolder", tmp_path / "d", ROWS["online"])
    cfg = _cfg(train=str(path), eval=str(path))
    assert len(load_split(cfg, "train", "online")) == 2
    assert len(load_split(cfg, "eval", "online")) == 1


def test_integer_labels_become_bool(tmp_path):
    path = _write_jsonl(
        tmp_path / "u.jsonl",
        [
            {"prompt": "a", "completion": "b", "label": 1},
            {"prompt": "c", "completion": "d", "label": 0},
        ],
    )
    ds = load_split(_cfg(train=str(path)), "train", "unpaired")
    assert ds["label"] == [True, False]


def test_sample_ratio_on_files(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    ds = load_split(_cfg(train=str(path), sample_ratio=0.25), "train", "online")
    assert len(ds) == 10 and all(row in rows for row in ds.to_list())


# --------------------------------------------------------------------------- errors


def _error(tmp_path: Path, rows: list[dict], mode: str = "online", name: str = "bad.jsonl") -> str:
    path = _write_jsonl(tmp_path / name, rows)
    with pytest.raises(UserError) as info:
        load_split(_cfg(train=str(path)), "train", mode)
    message = str(info.value)
    assert str(path) in message
    return message


def test_missing_columns_lists_expected_and_found(tmp_path):
    message = _error(tmp_path, [{"prompt": "1+1=", "chosen": "2"}], mode="preference")
    assert "rejected" in message
    assert "expected prompt, chosen, rejected" in message
    assert "found prompt, chosen" in message


def test_missing_prompt_column(tmp_path):
    message = _error(tmp_path, [{"question": "1+1="}])
    assert "missing column(s) prompt" in message and "found question" in message


def test_empty_prompt_names_the_row(tmp_path):
    message = _error(tmp_path, [{"prompt": "1+1="}, {"prompt": "2+2="}, {"prompt": "   "}])
    assert "row 3" in message and "empty prompt" in message


def test_non_text_value_names_row_and_column(tmp_path):
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "chosen": None, "rejected": "5"},
    ]
    message = _error(tmp_path, rows, mode="preference")
    assert "row 2" in message and "'chosen'" in message and "expected text" in message


def test_a_conversational_prompt_needs_a_tokenizer_with_a_chat_template(tmp_path):
    from alignzoo.world.tokenizer import build_tokenizer

    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "hi"}]}]), path)
    assert load_split(_cfg(train=str(path)), "train", "online")[0]["prompt"][0]["content"] == "hi"
    with pytest.raises(UserError, match=r"chat\.parquet: the data holds messages"):
        load_split(_cfg(train=str(path)), "train", "online", build_tokenizer())
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "text": "hi"}]}]), bad)
    with pytest.raises(UserError, match="row 1: column 'prompt': message 0 has no text content"):
        load_split(_cfg(train=str(bad)), "train", "online")


def test_numeric_prompt_column_in_parquet(tmp_path):
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"prompt": [1, 2]}), path)
    with pytest.raises(UserError, match=r"row 1: column 'prompt': expected text or .* got int"):
        load_split(_cfg(train=str(path)), "train", "online")


def test_bad_label(tmp_path):
    rows = [
        {"prompt": "a", "completion": "b", "label": True},
        {"prompt": "c", "completion": "d", "label": "yes"},
    ]
    message = _error(tmp_path, rows, mode="unpaired")
    assert "row 2" in message and "'label'" in message


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1="}\n\n{"prompt": \n')
    with pytest.raises(UserError, match=r"broken\.jsonl: line 3: invalid JSON"):
        load_split(_cfg(train=str(path)), "train", "online")


def test_mixed_types_in_a_column(tmp_path):
    _error(tmp_path, [{"prompt": "a", "answer": 4}, {"prompt": "b", "answer": "x"}])


def test_missing_file_unknown_format_and_empty(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_split(_cfg(train=str(tmp_path / "nope.jsonl")), "train", "online")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\nx\n")
    with pytest.raises(UserError, match=r"unsupported extension '\.csv'"):
        load_split(_cfg(train=str(csv)), "train", "online")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="no rows"):
        load_split(_cfg(train=str(empty)), "train", "online")
    with pytest.raises(UserError, match="not a dataset folder"):
        load_split(_cfg(eval=str(tmp_path)), "eval", "online")


def test_the_eval_split_of_a_datasetdict_is_eval_validation_or_test(tmp_path):
    import datasets

    def rows(tag):
        return datasets.Dataset.from_list([{"prompt": f"{tag} {i}"} for i in range(2)])

    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": rows("train"), "test": rows("test")}).save_to_disk(str(folder))
    cfg = _cfg(train=str(folder), eval=str(folder))
    assert load_split(cfg, "train", "online")["prompt"] == ["train 0", "train 1"]
    assert load_split(cfg, "eval", "online")["prompt"] == ["test 0", "test 1"]
    both = tmp_path / "both"
    splits = {"train": rows("train"), "test": rows("test"), "validation": rows("validation")}
    datasets.DatasetDict(splits).save_to_disk(str(both))
    evaluation = load_split(_cfg(train=str(both), eval=str(both)), "eval", "online")
    assert evaluation["prompt"] == ["validation 0", "validation 1"]  # preferred over test
