"""verifiers, the real package (in its own environment: make test-verifiers): a taskset's tasks
as a data source whose rows carry their task, checked before any model loads (an unknown
taskset, a config field it lacks, scoring that needs a runtime); the task's own in-process
rewards as a labeler (their weighted sum, an episode's transcript included); a tiny experiment
end to end. Where verifiers is not installed, the data source says which extra to install."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import DataConfig
from alignzoo.engine.datasets import load_split
from alignzoo.errors import UserError
from alignzoo.types import LabelRequest

from ..test_cli import alignzoo, assert_user_error

INSTALLED = importlib.util.find_spec("verifiers") is not None
needs_verifiers = [
    pytest.mark.verifiers,
    pytest.mark.skipif(
        not INSTALLED, reason="verifiers is not installed here (make test-verifiers runs these)"
    ),
]
TASKSETS = Path(__file__).parent / "verifiers_tasksets"


@pytest.fixture
def tasksets(monkeypatch):
    """The test tasksets importable by id, as an installed taskset package would be (in this
    process and in the commands it starts)."""
    monkeypatch.syspath_prepend(str(TASKSETS))
    paths = [str(TASKSETS), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    return TASKSETS


def source(taskset="az_sums", **spec):
    return {"verifiers": {"taskset": taskset, **spec}}


def rows_of(**spec):
    return load_split(DataConfig(train=source(**spec)), "train", "online")


@pytest.mark.skipif(INSTALLED, reason="verifiers is installed here")
def test_without_the_extra_the_data_source_says_what_to_install():
    with pytest.raises(UserError, match=r"alignzoo\[verifiers\].*openenv"):
        rows_of()


def verifiers_test(fn):
    """Marked ``verifiers`` (make test-verifiers) and skipped where it is not installed."""
    for mark in needs_verifiers:
        fn = mark(fn)
    return fn


@verifiers_test
def test_rows_are_the_selected_tasks_as_verifiers_iterates_them(tasksets):
    import verifiers.v1 as vf
    from verifiers.v1.utils import loaders

    rows = rows_of(config={"size": 30, "seed": 3}, select={"skip": 5, "limit": 10})
    config = loaders.taskset_config_type("az_sums").model_validate(
        {"id": "az_sums", "size": 30, "seed": 3}
    )
    direct = list(loaders.load_taskset(config).select(vf.SelectConfig(skip=5, limit=10)))
    assert rows["prompt"] == [t.data.prompt for t in direct]
    assert rows["answer"] == [t.data.answer for t in direct]  # the task data's scalar fields
    assert "operands" not in rows.column_names  # a list is not a column
    assert rows["verifiers_index"] == list(range(10))
    assert rows["verifiers_key"] == [t.key for t in direct]
    assert len(set(rows["verifiers_source"])) == 1


@verifiers_test
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"taskset": "az_nothing"}, r"data\.train\.verifiers\.taskset: .*az_nothing"),
        ({"config": {"sise": 3}}, r"data\.train\.verifiers\.config: sise"),
        ({"select": {"limit": -1}}, r"data\.train\.verifiers\.select: limit"),
        ({"select": {"skip": 1000}}, r"data\.train\.verifiers\.select: the selection holds no"),
        (
            {"taskset": "az_sandboxed"},
            r"data\.train\.verifiers\.taskset: ShellTask's scoring cannot run in process: "
            r"'tests_pass' needs a runtime",
        ),
    ],
)
def test_a_taskset_that_cannot_be_used_is_refused_naming_the_field(tasksets, spec, message):
    with pytest.raises(UserError, match=message):
        rows_of(**spec)


def request_for(row, response, **extra):
    columns = {k: v for k, v in row.items() if k != "prompt"}
    return LabelRequest(prompt=row["prompt"], response=response, extra={**columns, **extra})


@verifiers_test
def test_the_labeler_runs_the_tasks_own_rewards_weighted(tasksets):
    from alignzoo.plugins.labelers.verifiers import VerifiersLabeler

    row = rows_of(config={"size": 4})[0]
    labeler = VerifiersLabeler(VerifiersLabeler.Params(correct_at=1.0))
    right = labeler.score(request_for(row, row["answer"]))
    assert right.value == pytest.approx(1.2)  # exact (weight 1) + digits only (weight 0.2)
    assert right.info["rewards"] == {"exact": 1.0, "digits_only": 0.2}
    assert right.info["metrics"] == {"turns": 1.0} and right.info["correct"] is True
    wrong = labeler.score(request_for(row, str(int(row["answer"]) + 1)))
    assert wrong.value == pytest.approx(0.2) and wrong.info["correct"] is False
    assert labeler.score(request_for(row, "forty")).value == 0.0
    unsaid = VerifiersLabeler().score(request_for(row, row["answer"]))
    assert "correct" not in unsaid.info


@verifiers_test
def test_an_episode_is_scored_on_its_whole_transcript(tasksets):
    from alignzoo.plugins.labelers.verifiers import VerifiersLabeler

    row = rows_of(config={"size": 4})[0]
    transcript = [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": "[calc]"},
        {"role": "tool", "content": row["answer"], "name": "calculator"},
        {"role": "assistant", "content": row["answer"]},
    ]
    score = VerifiersLabeler().score(request_for(row, row["answer"], messages=transcript))
    assert score.value == pytest.approx(1.2) and score.info["metrics"]["turns"] == 2.0


@verifiers_test
def test_a_row_whose_task_changed_is_refused(tasksets):
    from alignzoo.plugins.labelers.verifiers import VerifiersLabeler

    row = rows_of(config={"size": 4})[0]
    with pytest.raises(UserError, match="the taskset changed"):
        VerifiersLabeler().score(request_for(row, "1", verifiers_key="0" * 64))
    with pytest.raises(UserError, match="use it with data from"):
        VerifiersLabeler().score(LabelRequest(prompt="1+1=", response="2"))


EXPERIMENT = {
    "name": "verifiers_sums",
    "seeds": [0],
    "budget": {"steps": 2},
    "model": {
        "embedded": {
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "intermediate_size": 64,
            "sft_steps": 20,
            "sft_on": "train",
        }
    },
    "data": {
        "train": source(config={"size": 60}, select={"skip": 10}),
        "eval": source(config={"size": 60}, select={"limit": 10}),
    },
    "training": {"prompts_per_step": 4, "samples_per_prompt": 2, "checkpoint_every": 2},
    "evaluation": {"every": 2},
    "defaults": {"labeler": {"name": "verifiers", "params": {"correct_at": 1.0}}},
    "arms": {"grpo": {"algorithm": "grpo"}},
}


@verifiers_test
@pytest.mark.slow
def test_an_experiment_trains_on_a_taskset_end_to_end(tasksets, tmp_path, monkeypatch):
    from alignzoo.experiment.runner import run_experiment

    path = tmp_path / "sums.yaml"
    path.write_text(yaml.safe_dump(EXPERIMENT))
    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    result = alignzoo("validate", str(path))
    assert result.returncode == 0, result.stderr
    outcome = run_experiment(load_experiment(path), out_dir=tmp_path / "out")
    assert not outcome.failed, [r.error for r in outcome.runs]
    folder = tmp_path / "out" / "grpo" / "seed-0"
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2] and steps[0]["labeler/verifiers/calls"] > 0
    evals = [json.loads(line) for line in (folder / "eval.jsonl").open()]
    assert all("eval/exact_match" in e for e in evals)


@verifiers_test
def test_validate_refuses_a_taskset_scored_by_a_runtime_before_any_model_loads(tasksets, tmp_path):
    spec = {**EXPERIMENT, "data": {"train": source("az_sandboxed"), "eval": "embedded"}}
    path = tmp_path / "sandboxed.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert_user_error(alignzoo("validate", str(path)), "needs a runtime")
