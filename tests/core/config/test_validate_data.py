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


REWARDS = """\
def reward_len(completions, **kwargs):  # TRL's documented example, verbatim
    return [-abs(20 - len(completion)) for completion in completions]

def needs_solution(prompts, completions, solution):
    return [1.0 for _ in completions]

def positional(p, c, **kwargs):  # positional names, as a non-TRL function might
    return [1.0 for _ in c]

def one_number(completions, **kwargs):
    return 1.0

def seen_as_trl_sees_it(prompts, completions, completion_ids, trainer_state, answer, **kw):
    assert isinstance(completion_ids[0], list) and trainer_state.global_step == 1
    return [float(c == a) for c, a in zip(completions, answer)]
"""


def python_arm(tmp_path, labeler):
    (tmp_path / "rewards.py").write_text(REWARDS)
    train = jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    path = tmp_path / "exp.yaml"
    path.write_text(
        "name: v\nseeds: [0]\nbudget: {steps: 1}\n"
        f"data: {{train: {train}, eval: {train}}}\n"
        f"arms:\n  a: {{algorithm: grpo, labeler: {json.dumps(labeler)}}}\n"
    )
    return path


def fn(name, **params):
    return {"name": "python", "params": {"function": f"rewards.py:{name}", **params}}


def test_validate_calls_each_python_reward_function_once_on_a_real_row(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    good = {"name": "combine", "params": {"labelers": [fn("reward_len"),
                                                        fn("seen_as_trl_sees_it")]}}  # fmt: skip
    assert main(["validate", str(python_arm(tmp_path, good))]) == 0, capsys.readouterr().err
    capsys.readouterr()

    parts = [fn("reward_len"), fn("needs_solution"), fn("positional"), fn("one_number")]
    bad = {"name": "combine", "params": {"labelers": parts}}
    assert main(["validate", str(python_arm(tmp_path, bad))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "arms.a.labeler.params.labelers.0" not in err  # the TRL function is fine
    assert "arms.a.labeler.params.labelers.1" in err and "asks for solution" in err
    assert "arms.a.labeler.params.labelers.2" in err and "take **kwargs" in err
    assert "arms.a.labeler.params.labelers.3" in err and "returned float" in err
    assert "Traceback" not in err

    skipped = fn("needs_solution", validate_call=False)  # a paid API can opt out
    assert main(["validate", str(python_arm(tmp_path, skipped))]) == 0
