"""--set FIELD=VALUE overrides (validated like the file, reported at the --set, recorded) and
arm sweeps that expand into named arms."""

from __future__ import annotations

import textwrap

import pytest

from alignzoo.cli import main
from alignzoo.config.loader import load_experiment
from alignzoo.errors import ConfigError, UserError

BASE = """\
name: o
seeds: [0]
budget: {steps: 2}
training: {lr: 1.0e-4}
arms:
  grpo: {algorithm: grpo}
  ppo: {algorithm: ppo}
"""


def write(tmp_path, text=BASE):
    path = tmp_path / "exp.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_overrides_change_shared_and_arm_fields_and_are_recorded(tmp_path):
    spec = load_experiment(
        write(tmp_path),
        overrides=["training.lr=1e-5", "arms.grpo.algorithm.params.beta=0", "seeds=[1, 2]"],
    ).spec
    assert spec.arms["grpo"].training.lr == 1e-5 and spec.arms["ppo"].training.lr == 1e-5
    assert spec.arms["grpo"].algorithm.name == "grpo"
    assert spec.arms["grpo"].algorithm.params == {"beta": 0}
    assert spec.seeds == [1, 2]
    assert spec.overrides == [
        "training.lr=1e-5",
        "arms.grpo.algorithm.params.beta=0",
        "seeds=[1, 2]",
    ]


def test_a_bad_override_is_reported_at_the_set(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_experiment(write(tmp_path), overrides=["arms.grpo.algorithm.params.bta=0"])
    [issue] = info.value.issues
    assert issue.file == "--set arms.grpo.algorithm.params.bta=0" and "beta" in issue.message
    with pytest.raises(UserError, match="expected FIELD=VALUE"):
        load_experiment(write(tmp_path), overrides=["training.lr"])


def test_the_cli_takes_set_and_exits_2_on_a_bad_one(tmp_path, capsys):
    path = write(tmp_path)
    assert main(["validate", str(path), "--set", "training.lr=3e-5"]) == 0
    assert main(["validate", str(path), "--set", "training.lr=-1"]) == 2
    assert "--set training.lr=-1: training.lr" in capsys.readouterr().err


def test_a_sweep_expands_into_named_arms(tmp_path):
    text = BASE.replace(
        "  grpo: {algorithm: grpo}",
        "  grpo:\n    algorithm: grpo\n    sweep: {training.lr: [1.0e-5, 3.0e-5], algorithm.params.beta: [0.0, 0.04]}",
    ) + "baseline: grpo\n"  # fmt: skip
    spec = load_experiment(write(tmp_path, text)).spec
    names = list(spec.arms)
    assert names == [
        "grpo-lr1e-05-beta0.0",
        "grpo-lr1e-05-beta0.04",
        "grpo-lr3e-05-beta0.0",
        "grpo-lr3e-05-beta0.04",
        "ppo",
    ]
    assert spec.arms["grpo-lr3e-05-beta0.04"].training.lr == 3e-5
    assert spec.arms["grpo-lr3e-05-beta0.04"].algorithm.params == {"beta": 0.04}
    assert spec.baseline == "grpo-lr1e-05-beta0.0"  # the swept baseline: its first arm
    loaded = load_experiment(write(tmp_path, text), arms=["grpo-lr3e-05-beta0.0"])  # a worker
    assert list(loaded.spec.arms) == ["grpo-lr3e-05-beta0.0"]


def test_a_bad_sweep_says_what_was_expected(tmp_path):
    text = BASE.replace(
        "  grpo: {algorithm: grpo}", "  grpo: {algorithm: grpo, sweep: {training.lr: 1}}"
    )
    with pytest.raises(UserError, match=r"arms\.grpo\.sweep: expected a mapping of dotted fields"):
        load_experiment(write(tmp_path, text))
    text = BASE.replace(
        "  grpo: {algorithm: grpo}", "  grpo: {algorithm: grpo, sweep: {training.lrr: [1]}}"
    )
    with pytest.raises(ConfigError, match="lrr"):
        load_experiment(write(tmp_path, text))


def test_model_reward_model_is_the_reward_model_labelers_default_path(tmp_path):
    folder = tmp_path / "rm"
    folder.mkdir()
    text = f"""\
name: r
seeds: [0]
budget: {{steps: 1}}
arms:
  a: {{algorithm: grpo, labeler: reward_model, model: {{reward_model: {folder}}}}}
  b: {{algorithm: grpo, labeler: {{name: reward_model, params: {{path: {folder}/other}}}},
      model: {{reward_model: {folder}}}}}
"""
    loaded = load_experiment(write(tmp_path, text))
    assert loaded.components["a"]["labeler"].params.path == str(folder)
    assert loaded.components["b"]["labeler"].params.path == f"{folder}/other"  # its own wins
    with pytest.raises(ConfigError, match=r"labeler\.params\.path"):
        load_experiment(write(tmp_path, BASE.replace("{algorithm: grpo}",
                                                     "{algorithm: grpo, labeler: reward_model}")))  # fmt: skip
