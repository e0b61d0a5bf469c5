"""Experiment files: every mistake is located by file, line and dotted path before anything runs."""

from __future__ import annotations

import textwrap

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.errors import ConfigError, UserError
from alignzoo.types import AlgorithmRequirements
from tests.core.helpers import toy_registry

VALID = """\
name: demo
seeds: [0, 1]
budget:
  steps: 5
training:
  lr: 1.0e-4
defaults:
  labeler: arithmetic
arms:
  grpo:
    algorithm:
      name: grpo
      params:
        group_size: 8
  ppo:
    algorithm: ppo
    training:
      lr: 3.0e-4
"""


def write(tmp_path, text: str):
    path = tmp_path / "exp.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def load(tmp_path, text: str):
    return load_experiment(write(tmp_path, text), registry=toy_registry())


def only_issue(tmp_path, text: str):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert len(info.value.issues) == 1, info.value.issues
    return info.value.issues[0]


def test_valid_file_merges_shared_sections_into_arms(tmp_path):
    loaded = load(tmp_path, VALID)
    spec = loaded.spec
    assert spec.arms["grpo"].training.lr == pytest.approx(1e-4)
    assert spec.arms["ppo"].training.lr == pytest.approx(3e-4)
    assert spec.arms["ppo"].labeler.name == "arithmetic"
    assert spec.baseline_arm == "grpo"
    algo = loaded.components["grpo"]["algorithm"]
    assert algo.params.group_size == 8
    assert loaded.components["ppo"]["algorithm"].params.group_size == 4


def test_unknown_algorithm_names_line_and_suggests(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("name: grpo", "name: grop"))
    assert issue.path == "arms.grpo.algorithm.name"
    assert issue.line == 12
    assert "did you mean 'grpo'" in issue.message and "ppo" in issue.message


def test_misspelled_parameter_suggests_the_right_one(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("group_size: 8", "gruop_size: 8"))
    assert issue.path == "arms.grpo.algorithm.params.gruop_size"
    assert issue.line == 14
    assert "did you mean 'group_size'" in issue.message


def test_wrong_type_says_what_was_found(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("group_size: 8", "group_size: many"))
    assert issue.path == "arms.grpo.algorithm.params.group_size" and issue.line == 14
    assert "valid integer" in issue.message and "'many'" in issue.message


def test_negative_learning_rate_is_reported_once_at_the_shared_line(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("lr: 1.0e-4", "lr: -1.0e-4"))
    assert issue.line == 6
    assert issue.path.endswith("training.lr")
    assert "greater than or equal to 0" in issue.message


def test_arm_override_error_points_at_the_arm(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("lr: 3.0e-4", "lr: -3"))
    assert issue.path == "arms.ppo.training.lr" and issue.line == 18


def test_misspelled_section_field_suggests(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("  lr: 1.0e-4", "  learning_rate: 1.0e-4"))
    assert "unknown field 'learning_rate'" in issue.message
    assert issue.line == 6


def test_no_arms(tmp_path):
    text = VALID.split("arms:")[0] + "arms: {}\n"
    issue = only_issue(tmp_path, text)
    assert issue.path == "arms" and issue.line == 9
    assert "at least 1" in issue.message


def test_non_integer_seeds(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("seeds: [0, 1]", "seeds: [0, 1.5]"))
    assert issue.path == "seeds.1" and issue.line == 2
    assert "integer" in issue.message


def test_yaml_syntax_error_has_a_line(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("  steps: 5", "  steps: [5"))
    assert "YAML syntax error" in issue.message
    assert issue.line is not None and 4 <= issue.line <= 7


def test_duplicate_key_is_an_error_not_a_silent_overwrite(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("  steps: 5", "  steps: 5\n  steps: 6"))
    assert issue.path == "budget.steps" and issue.line == 5


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="experiment file not found"):
        load_experiment(tmp_path / "nope.yaml", registry=toy_registry())


def test_budget_needs_exactly_one_limit(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("  steps: 5", "  steps: 5\n  samples: 100"))
    assert issue.path == "budget" and "exactly one" in issue.message


def test_unknown_baseline(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("seeds: [0, 1]", "seeds: [0, 1]\nbaseline: dpo"))
    assert "baseline 'dpo' is not an arm" in issue.message


def test_arms_filter(tmp_path):
    loaded = load_experiment(write(tmp_path, VALID), registry=toy_registry(), arms=["ppo"])
    assert list(loaded.spec.arms) == ["ppo"] and loaded.spec.baseline_arm == "ppo"
    with pytest.raises(UserError, match="not arms of this experiment"):
        load_experiment(write(tmp_path, VALID), registry=toy_registry(), arms=["dpo"])


def test_several_problems_are_reported_together(tmp_path):
    text = VALID.replace("group_size: 8", "group_size: 0").replace(
        "name: demo", "name: demo\nfoo: 1"
    )
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    paths = {i.path for i in info.value.issues}
    assert "foo" in paths


def test_default_on_modifiers_join_every_arm_unless_listed(tmp_path):
    from alignzoo import Modifier

    class Watchdog(Modifier):
        """Always on."""

        default_on = True

    registry = toy_registry()
    registry.register(Watchdog, "watchdog")
    text = VALID + "    modifiers: [watchdog]\n"
    loaded = load_experiment(write(tmp_path, text), registry=registry)
    assert isinstance(loaded.components["grpo"]["modifiers.default.watchdog"], Watchdog)
    assert "modifiers.default.watchdog" not in loaded.components["ppo"]
    assert isinstance(loaded.components["ppo"]["modifiers.0"], Watchdog)


def test_offline_only_for_algorithms_that_read_datasets(tmp_path):
    issue = only_issue(
        tmp_path, VALID.replace("    algorithm: ppo\n", "    algorithm: ppo\n    online: false\n")
    )
    assert issue.path == "arms.ppo.online" and issue.line == 17
    assert "only to preference or unpaired" in issue.message


def test_hookimpl_that_does_not_match_its_hookspec_is_found_by_validation(tmp_path):
    from alignzoo import Modifier, hookimpl

    class Misspelled(Modifier):
        """Wraps compute_loss with a wrong argument name."""

        @hookimpl(wrapper=True)
        def compute_loss(self, batch, output):  # the hookspec says `outputs`
            return (yield)

    registry = toy_registry()
    registry.register(Misspelled, "misspelled")
    text = VALID + "    modifiers: [misspelled]\n"
    with pytest.raises(ConfigError) as info:
        load_experiment(write(tmp_path, text), registry=registry)
    [issue] = info.value.issues
    assert issue.path == "arms.ppo.modifiers.0" and issue.line == 19
    assert "compute_loss" in issue.message and "output" in issue.message


def test_unreadable_file_is_a_user_error(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(b"name: \xff\xfe demo\n")
    with pytest.raises(UserError, match="not a UTF-8 text file"):
        load_experiment(path, registry=toy_registry())


def test_the_labeling_on_key_loads_as_written_yaml_1_1_booleans_stay_keys(tmp_path):
    # YAML 1.1 reads the key `on` (and off, yes, no) as a boolean; the loader keeps keys as
    # written, so the documented `labeling.on:` works, while values still read as booleans.
    text = VALID.replace(
        "    algorithm: ppo\n",
        "    algorithm: ppo\n"
        "    labeling:\n"
        "      overlap: yes\n"
        "      on: {abstain: drop_sample, exhausted: fail}\n",
    )
    loaded = load_experiment(write(tmp_path, text), registry=toy_registry())
    labeling = loaded.spec.arms["ppo"].labeling
    assert labeling.on.abstain == "drop_sample" and labeling.on.exhausted == "fail"
    assert labeling.overlap is True
    from alignzoo.config.yamlfile import safe_load

    assert safe_load("on: 1\noff: [yes, no]\n") == {"on": 1, "off": [True, False]}


def test_a_weight_setting_modifier_around_an_algorithm_that_ignores_weights_is_refused(tmp_path):
    from alignzoo.plugins.modifiers.dataflow import Reweight
    from tests.core.helpers import ToyAlgorithm

    class Weighted(ToyAlgorithm):
        requirements = AlgorithmRequirements(weights=True)

    registry = toy_registry()
    registry.register(Reweight, "reweight", provider="toy")
    registry.register(Weighted, "weighted", provider="toy")
    text = VALID.replace("    algorithm: ppo\n", "    algorithm: ppo\n    modifiers: [reweight]\n")
    with pytest.raises(ConfigError) as info:
        load_experiment(write(tmp_path, text), registry=registry)
    [issue] = info.value.issues
    assert issue.path == "arms.ppo.modifiers.0"
    assert "'reweight' sets sample weights" in issue.message and "'ppo'" in issue.message
    ok = text.replace("    algorithm: ppo\n", "    algorithm: weighted\n")
    assert load_experiment(write(tmp_path, ok), registry=registry).spec.arms["ppo"].modifiers


def test_a_problem_in_defaults_is_reported_once_where_it_is_written(tmp_path):
    text = """\
    name: demo
    seeds: [0]
    budget: {steps: 1}
    training: {lr: -1.0}
    defaults:
      labeler: {name: arithmetic, params: {bogus: 1}}
    arms:
      a: {algorithm: grpo}
      b: {algorithm: rloo}
      c: {algorithm: grpo, labeler: nope}
      d:
        algorithm: grpo
        training: {lr: 1.0e-5}
    """
    with pytest.raises(ConfigError) as info:
        load_experiment(write(tmp_path, text))  # the installed components
    issues = {issue.path: issue for issue in info.value.issues}
    assert sorted(issues) == ["training.lr"], issues  # the schema is checked first
    assert issues["training.lr"].line == 4  # once, for the three arms that inherit it

    with pytest.raises(ConfigError) as info:
        load_experiment(write(tmp_path, text.replace("lr: -1.0", "lr: 1.0e-4")))
    issues = {issue.path: issue for issue in info.value.issues}
    assert sorted(issues) == ["arms.c.labeler.name", "defaults.labeler.params.bogus"], issues
    assert issues["defaults.labeler.params.bogus"].line == 6  # once, not per arm
    assert issues["arms.c.labeler.name"].line == 10  # the arm's own shorthand replaces it


def test_an_environment_needs_an_online_algorithm_and_a_token_backend(tmp_path):
    (tmp_path / "tools.py").write_text(
        'def add(a: int) -> int:\n    """Add.\n\n    Args:\n        a: A.\n    """\n    return a\n'
    )
    env = f"{{name: tools, params: {{functions: ['{tmp_path / 'tools.py'}:add']}}}}"
    text = f"""\
    name: demo
    seeds: [0]
    budget: {{steps: 1}}
    arms:
      ok: {{algorithm: grpo, environment: {env}}}
      pairs: {{algorithm: dpo, online: true, environment: {env}}}
      texts: {{algorithm: grpo, backend: canned, environment: {env}}}
    """
    with pytest.raises(ConfigError) as info:
        load_experiment(write(tmp_path, text))
    issues = {issue.path: issue.message for issue in info.value.issues}
    assert sorted(issues) == ["arms.pairs.environment", "arms.texts.environment"], issues
    assert "learns from preference data" in issues["arms.pairs.environment"]
    assert "does not implement generate_ids" in issues["arms.texts.environment"]


def test_each_arms_algorithm_is_asked_its_requirements_once(tmp_path, monkeypatch):
    # Every check that reads them runs here: online: false, the environment, a greedy
    # temperature, rollout correction, a weight-setting modifier (grpo multiplies weights in).
    from alignzoo.config import components

    asked = []
    ask = components.algorithm_requirements

    def counted(algorithm):
        asked.append(type(algorithm).__name__)
        return ask(algorithm)

    monkeypatch.setattr(components, "algorithm_requirements", counted)
    text = """\
    name: demo
    seeds: [0]
    budget: {steps: 1}
    training:
      sampling: {temperature: 0}
      rollout_correction: {level: token}
    arms:
      offline: {algorithm: grpo, online: false, modifiers: [reweight]}
      pairs: {algorithm: dpo, environment: calculator}
    """
    with pytest.raises(ConfigError) as info:
        load_experiment(write(tmp_path, text))
    assert sorted(asked) == ["DPO", "GRPO"]
    assert {issue.path for issue in info.value.issues} >= {
        "arms.offline.online",
        "arms.pairs.environment",
        "training.sampling.temperature",
        "training.rollout_correction.level",
    }
