"""`alignzoo validate` holds an algorithm that weighs a labeler's rewards apart (GRPO's
multi_objective_aggregation: normalize_then_sum, reward_weights) against a labeler whose
rewards are known (a combine's parts): one weight per part, the parts' own weights left at 1,
no labeling.normalize, the same parts along the fallback chain. Each refusal names its field."""

from __future__ import annotations

import json

import pytest

from alignzoo.cli import main

PARTS = [{"name": "regex", "params": {"pattern": "1"}}, "format"]


def experiment(tmp_path, algorithm: dict, labeler: dict, labeling: dict | None = None):
    train = tmp_path / "t.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    arm = {
        "algorithm": algorithm,
        "labeler": labeler,
        **({"labeling": labeling} if labeling else {}),
    }
    path = tmp_path / "exp.yaml"
    path.write_text(
        "name: v\nseeds: [0]\nbudget: {steps: 1}\n"
        f"data: {{train: {train}, eval: {train}}}\n"
        f"arms:\n  a: {json.dumps(arm)}\n"
    )
    return path


def grpo(**params) -> dict:
    return {"name": "grpo", "params": params}


def combine(**params) -> dict:
    return {"name": "combine", "params": {"labelers": PARTS, **params}}


def validate(path, capsys) -> tuple[int, str]:
    code = main(["validate", str(path)])
    return code, " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    "algorithm",
    [
        grpo(multi_objective_aggregation="normalize_then_sum"),
        grpo(multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.2]),
        grpo(reward_weights=[2.0, 1.0]),
        grpo(),  # the score only: combine's weights are what it trains on
    ],
)
def test_one_weight_per_part_is_accepted(tmp_path, capsys, algorithm) -> None:
    labeler = combine() if algorithm["params"] else combine(weights=[1.0, 0.2])
    code, err = validate(experiment(tmp_path, algorithm, labeler), capsys)
    assert code == 0, err


def test_another_number_of_weights_than_parts_is_refused_naming_reward_weights(
    tmp_path, capsys
) -> None:
    path = experiment(tmp_path, grpo(reward_weights=[1.0, 2.0, 3.0]), combine())
    code, err = validate(path, capsys)
    assert code == 2 and "arms.a.algorithm.params.reward_weights" in err
    assert (
        "reward_weights has 3 weights, and labeler 'combine' reports 2 rewards (regex, format)"
        in err
    )
    assert "Traceback" not in err


def test_the_parts_own_weights_are_refused_when_the_algorithm_weighs_them(tmp_path, capsys):
    algorithm = grpo(multi_objective_aggregation="normalize_then_sum")
    path = experiment(tmp_path, algorithm, combine(weights=[1.0, 0.2]))
    code, err = validate(path, capsys)
    assert code == 2 and "arms.a.labeler.params.weights" in err
    assert "move them to the algorithm's reward_weights" in err and "Traceback" not in err


def test_labeling_normalize_is_refused_in_front_of_the_parts(tmp_path, capsys) -> None:
    labeling = {"normalize": {"mode": "fixed", "scale": 2.0}}
    path = experiment(tmp_path, grpo(reward_weights=[1.0, 1.0]), combine(), labeling)
    code, err = validate(path, capsys)
    assert code == 2 and "arms.a.labeling.normalize" in err and "raw" in err


def test_a_fallback_with_other_parts_is_refused(tmp_path, capsys) -> None:
    other = {"name": "combine", "params": {"labelers": ["format", "length_penalty"]}}
    labeling = {"fallbacks": [other]}
    algorithm = grpo(multi_objective_aggregation="normalize_then_sum")
    code, err = validate(experiment(tmp_path, algorithm, combine(), labeling), capsys)
    assert code == 2 and "arms.a.labeling.fallbacks.0" in err
    assert "(format, length_penalty)" in err and "(regex, format)" in err


def test_normalize_then_sum_with_a_scale_it_does_not_read_is_refused(tmp_path, capsys) -> None:
    algorithm = grpo(multi_objective_aggregation="normalize_then_sum", scale_rewards="batch")
    code, err = validate(experiment(tmp_path, algorithm, combine()), capsys)
    assert code == 2 and "scale_rewards 'batch' is not read" in err


def test_a_fallback_that_reports_no_rewards_apart_is_refused(tmp_path, capsys) -> None:
    """A sample a plain fallback scores would have no rewards for the algorithm to read."""
    labeling = {"fallbacks": ["format"]}
    algorithm = grpo(multi_objective_aggregation="normalize_then_sum")
    code, err = validate(experiment(tmp_path, algorithm, combine(), labeling), capsys)
    assert code == 2 and "arms.a.labeling.fallbacks.0" in err
    assert "fallback 'format' reports no rewards apart" in err and "Traceback" not in err
    plain = experiment(tmp_path, grpo(), combine(), labeling)  # reads the score: fine
    assert validate(plain, capsys)[0] == 0
