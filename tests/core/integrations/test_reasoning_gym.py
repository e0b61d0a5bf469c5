"""reasoning-gym, the real package: its tasks as a data source whose rows carry their entry,
checked (did-you-mean, config errors) before any model loads; its scorers as a labeler, all or
nothing unless partial credit is asked for; a warm start on the task's own rows; and a tiny
experiment end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import DataConfig, EmbeddedModelConfig, TaskConfig
from alignzoo.engine.datasets import load_split
from alignzoo.engine.policy import warm_start_examples
from alignzoo.errors import UserError
from alignzoo.experiment.runner import run_experiment
from alignzoo.plugins.labelers.reasoning_gym import ReasoningGymLabeler
from alignzoo.types import LabelRequest
from alignzoo.world.warmstart import cache_key

from ..test_cli import alignzoo, assert_user_error

rg = pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not installed")

ROOT = Path(__file__).resolve().parents[3]
ADDITION = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
            "operators": ["+"], "allow_negation": False, "allow_parentheses": False}  # fmt: skip


def source(**spec):
    return {"reasoning_gym": {"size": 20, "seed": 1, **spec}}


def test_rows_carry_the_prompt_answer_task_and_entry_as_reasoning_gym_makes_them():
    data = DataConfig(train=source(task="basic_arithmetic", config=ADDITION))
    rows = load_split(data, "train", "online")
    direct = rg.create_dataset("basic_arithmetic", size=20, seed=1, **ADDITION)
    assert rows["prompt"] == [e["question"] for e in direct]
    assert rows["answer"] == [str(e["answer"]) for e in direct]
    assert set(rows["reasoning_gym_task"]) == {"basic_arithmetic"}
    assert rows["question"] == rows["prompt"] and rows["reasoning_gym_index"] == list(range(20))
    assert len(set(rows["reasoning_gym_source"])) == 1  # the spec, to rebuild the entries from
    again = load_split(data, "train", "online")
    assert again["prompt"] == rows["prompt"]  # the seed fixes the data
    templated = DataConfig(
        train=source(task="basic_arithmetic", config=ADDITION, template="{metadata[expression]} =")
    )
    assert (
        load_split(templated, "train", "online")["prompt"][0]
        == direct[0]["metadata"]["expression"] + " ="
    )


def test_training_rows_never_repeat_an_eval_prompt():
    small = {**ADDITION, "max_digits": 1}  # 1-digit sums: few distinct prompts, many repeats
    data = DataConfig(
        train=source(task="basic_arithmetic", config=small, size=300),
        eval=source(task="basic_arithmetic", config=small, seed=2, size=20),
    )
    train = load_split(data, "train", "online")["prompt"]
    held_out = set(load_split(data, "eval", "online")["prompt"])
    everything = rg.create_dataset("basic_arithmetic", size=300, seed=1, **small)
    assert any(e["question"] in held_out for e in everything)  # premise: the seeds overlap
    assert train and not set(train) & held_out
    # Compared by question: another template for the eval split holds the same questions out.
    data = DataConfig(
        train=source(task="basic_arithmetic", config=small, size=300),
        eval=source(
            task="basic_arithmetic", config=small, seed=2, size=20, template="Q: {question}"
        ),
    )
    assert not set(load_split(data, "train", "online")["prompt"]) & held_out
    everything_held_out = DataConfig(
        train=source(task="basic_arithmetic", config=small, size=5, seed=2),
        eval=source(task="basic_arithmetic", config=small, seed=2, size=20),
    )
    with pytest.raises(UserError, match="every generated training prompt is also an eval"):
        load_split(everything_held_out, "train", "online")


def test_a_weighted_composite_mixes_tasks_and_each_row_names_its_own():
    tasks = [{"name": "basic_arithmetic", "weight": 3, "config": ADDITION},
             {"name": "chain_sum", "weight": 1, "config": {}}]  # fmt: skip
    rows = load_split(DataConfig(train=source(tasks=tasks, size=200)), "train", "online")
    counts = {t: rows["reasoning_gym_task"].count(t) for t in ("basic_arithmetic", "chain_sum")}
    assert sum(counts.values()) == 200 and counts["basic_arithmetic"] > counts["chain_sum"] > 0


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ({"task": "basic_arithmetc"}, ["reasoning_gym.task", "did you mean basic_arithmetic"]),
        ({"task": "basic_arithmetic", "config": {"nope": 1}}, ["reasoning-gym refused it", "nope"]),
        ({"tasks": [{"name": "chain_sum"}, {"name": "chainsum"}]}, ["tasks.1.name", "chain_sum"]),
        (
            {"task": "basic_arithmetic", "template": "{metadata[nope]}"},
            ["template", "expression"],
        ),
    ],
)
def test_a_bad_source_is_a_user_error_naming_the_field(spec, fragments):
    with pytest.raises(UserError) as caught:
        load_split(DataConfig(train=source(**spec)), "train", "online")
    assert all(f in str(caught.value) for f in fragments), str(caught.value)


def test_validate_refuses_an_unknown_task_before_any_model_loads(tmp_path):
    experiment = yaml.safe_load((ROOT / "experiments" / "reasoning_gym.yaml").read_text())
    experiment["data"]["eval"]["reasoning_gym"]["task"] = "basic_arithmetc"
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(experiment))
    result = alignzoo("validate", str(path), env={"ALIGNZOO_CACHE": str(tmp_path / "cache")})
    assert_user_error(result, "data.eval", "did you mean basic_arithmetic")
    assert not (tmp_path / "cache").exists()  # no warm start was built


def test_preference_arms_are_told_that_this_data_is_prompts():
    with pytest.raises(UserError, match=r"data\.online: true"):
        load_split(DataConfig(train=source(task="basic_arithmetic")), "train", "preference")


def rows_of(**spec):
    return load_split(DataConfig(train=source(**spec)), "train", "online").to_list()


def request(response, row):
    extra = {k: v for k, v in row.items() if k != "prompt"}
    return LabelRequest(prompt=row["prompt"], response=response, extra=extra)


@pytest.mark.parametrize(
    ("task", "config"),
    [
        ("basic_arithmetic", ADDITION),
        ("chain_sum", {}),
        ("arc_agi", {}),  # answers are grids: compared as reasoning-gym's tuples, not JSON lists
        ("decimal_arithmetic", {"min_num_decimal_places": 1, "max_num_decimal_places": 1}),
    ],
)
def test_every_generated_rows_own_answer_scores_full_marks(task, config):
    labeler = ReasoningGymLabeler({"extract": "full"})
    for row in rows_of(task=task, config=config, size=4):
        scored = labeler.score(request(row["answer"], row))
        assert scored.value == 1.0 and scored.info["correct"], (task, row["answer"], scored)


def test_the_tasks_own_scorer_all_or_nothing_unless_partial_credit():
    row = rows_of(task="chain_sum", size=1, seed=0)[0]
    answer = row["answer"]
    # The trap: chain_sum gives partial credit to a wrong answer that contains the right one.
    chain = rg.create_dataset("chain_sum", size=1, seed=0)
    partial = chain.score_answer(answer + "0", chain[0])
    assert 0 < partial < 1, "premise: chain_sum's scorer gives partial credit"
    strict = ReasoningGymLabeler({"extract": "full"})
    lenient = ReasoningGymLabeler({"extract": "full", "partial_credit": True})
    right = strict.score(request(answer, row))
    assert right.value == 1.0 and right.info["correct"] is True
    wrong = strict.score(request(answer + "0", row))
    assert wrong.value == 0.0 and wrong.info["correct"] is False
    assert wrong.info["task_score"] == pytest.approx(partial)
    kept = lenient.score(request(answer + "0", row))
    assert kept.value == pytest.approx(partial) and kept.info["correct"] is False


def test_the_answer_is_read_as_asked():
    row = rows_of(task="basic_arithmetic", config=ADDITION, size=1, seed=3)[0]
    answer = row["answer"]
    tagged = ReasoningGymLabeler()  # <answer>...</answer>, reasoning-gym's convention
    assert tagged.score(request(f"think... <answer>{answer}</answer>", row)).value == 1.0
    assert tagged.score(request(answer, row)).value == 0.0
    first = ReasoningGymLabeler({"extract": "first_line"})
    assert first.score(request(f"{answer}\nmore", row)).value == 1.0
    with pytest.raises(UserError, match="reasoning_gym_source"):
        first.score(LabelRequest(prompt="?", response="1", extra={"answer": "1"}))


def test_the_warm_start_can_learn_the_tasks_own_rows(tmp_path):
    evaluation = source(task="basic_arithmetic", config=ADDITION, seed=2, size=5)
    data = DataConfig(train=source(task="basic_arithmetic", config=ADDITION), eval=evaluation)
    examples = warm_start_examples(data)
    train = load_split(data, "train", "online")  # the eval prompts left out
    assert len(examples["eval"]) == 5 and 0 < len(examples["train"]) == len(train)
    assert [e["answer"] for e in examples["train"]] == train["answer"]
    assert examples["train"][0]["prompt"].startswith("Calculate")
    on_train = EmbeddedModelConfig(sft_on="train")
    other = warm_start_examples(
        DataConfig(train=source(task="basic_arithmetic", seed=9), eval=evaluation)
    )
    assert cache_key(on_train, TaskConfig(), examples) != cache_key(on_train, TaskConfig(), other)
    no_answers = tmp_path / "prompts.jsonl"
    no_answers.write_text('{"prompt": "hi"}\n')
    with pytest.raises(UserError, match="no 'answer' column"):
        warm_start_examples(DataConfig(train=str(no_answers), eval=evaluation))


@pytest.mark.slow
def test_the_reasoning_gym_experiment_runs_end_to_end_at_a_tiny_size(tmp_path, monkeypatch):
    spec = yaml.safe_load((ROOT / "experiments" / "reasoning_gym.yaml").read_text())
    spec["seeds"] = [0, 1]
    spec["budget"] = {"steps": 2}
    spec["model"]["embedded"].update(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_steps=40
    )
    spec["data"]["train"]["reasoning_gym"]["size"] = 64
    spec["data"]["eval"]["reasoning_gym"]["size"] = 8
    spec["training"].update(prompts_per_step=4, samples_per_prompt=2, checkpoint_every=2)
    spec["evaluation"].update(every=2)
    path = tmp_path / "rg.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    result = run_experiment(load_experiment(path), out_dir=tmp_path / "out")
    assert not result.failed, [r.error for r in result.runs]
    folder = tmp_path / "out" / "grpo" / "seed-0"
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2] and "labeler/reasoning_gym/calls" in steps[0]
    evals = [json.loads(line) for line in (folder / "eval.jsonl").open()]
    assert all("eval/exact_match" in e for e in evals)  # the labeler says what is correct
    metadata = json.loads(
        next((tmp_path / "cache" / "embedded").glob("*/alignzoo_world.json")).read_text()
    )
    trained = load_split(load_experiment(path).spec.data, "train", "online")
    assert metadata["sft_demonstrations"] == len(trained) and metadata["eval_size"] == 8
    assert "grpo" in (tmp_path / "out" / "report.md").read_text()
