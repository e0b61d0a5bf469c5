"""`alignzoo validate` (and `alignzoo run`, once, before anything is written) opens every data
source each arm reads and exits 2 naming the file, the row and the column."""

from __future__ import annotations

import json
import textwrap

import datasets

from alignzoo.cli import main

EXPERIMENT = """\
name: v
seeds: [0]
budget: {{steps: 1}}
data: {{train: {train}, eval: {eval}, online: {online}}}
arms:
  a: {{algorithm: {algorithm}}}
"""


def experiment(tmp_path, train, evaluation=None, algorithm="grpo", online="true"):
    path = tmp_path / "exp.yaml"
    text = EXPERIMENT.format(train=train, eval=evaluation or train, online=online,
                             algorithm=algorithm)  # fmt: skip
    path.write_text(textwrap.dedent(text))
    return path


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_wrong_column_is_named_with_its_file_and_row(tmp_path, capsys):
    train = jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1="}, {"prompt": 7}])
    assert main(["validate", str(experiment(tmp_path, train))]) == 2
    err = capsys.readouterr().err
    assert "data.train" in err and "t.jsonl: row 2 (line 2): column 'prompt'" in err


def test_preference_data_missing_a_column_for_an_offline_arm(tmp_path, capsys):
    train = jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a"}])
    evaluation = jsonl(tmp_path / "e.jsonl", [{"prompt": "q"}])
    path = experiment(tmp_path, train, evaluation, algorithm="dpo", online="false")
    assert main(["validate", str(path)]) == 2
    assert "missing column(s) rejected for preference data" in capsys.readouterr().err


def test_messages_for_a_policy_without_a_chat_template(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    train = jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    assert main(["validate", str(experiment(tmp_path, train))]) == 2
    err = capsys.readouterr().err
    assert "c.jsonl: the data holds messages" in err and "no chat template" in err
    assert not (tmp_path / "cache").exists()  # nothing was built or loaded


def test_a_missing_split_is_named(tmp_path, capsys):
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"prompt": "q"}]),
         "other": datasets.Dataset.from_list([{"prompt": "q"}])}
    ).save_to_disk(str(folder))  # fmt: skip
    assert main(["validate", str(experiment(tmp_path, folder))]) == 2
    err = capsys.readouterr().err
    assert "data.eval" in err and "expected a split named 'eval' or 'validation' or 'test'" in err


def test_run_checks_the_data_before_writing_anything(tmp_path, capsys):
    train = jsonl(tmp_path / "t.jsonl", [{"prompt": ""}])
    out = tmp_path / "runs"
    assert main(["run", str(experiment(tmp_path, train)), "--out", str(out)]) == 2
    assert "empty prompt" in capsys.readouterr().err
    assert not out.exists()


def test_a_hub_dataset_id_is_reported_as_such(tmp_path, capsys):
    assert main(["validate", str(experiment(tmp_path, "trl-lib/tldr"))]) == 2
    err = capsys.readouterr().err
    assert "looks like a Hugging Face Hub dataset id" in err and "save_to_disk" in err
