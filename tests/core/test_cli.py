"""The command line: exit codes, messages without tracebacks, listings, schema, version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from alignzoo import cli
from alignzoo.registry import Registry
from tests.core.helpers import entry_point

# Only components of the outside test package, so these tests do not depend on built-ins.
GOOD = """\
name: clitest
seeds: [0, 1]
budget: {steps: 3}
defaults:
  labeler: {name: keyword, params: {keyword: "4"}}
  backend: canned
  devices: all_cpu
arms:
  a:
    algorithm: {name: vanilla_pg, params: {baseline: true}}
  b:
    algorithm: vanilla_pg
    modifiers: [{name: loss_scale, params: {factor: 3}}]
"""


def alignzoo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "alignzoo.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def exp(tmp_path):
    def make(text: str = GOOD):
        path = tmp_path / "exp.yaml"
        path.write_text(textwrap.dedent(text))
        return path

    return make


def assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_validate_ok(exp):
    result = alignzoo("validate", str(exp()))
    assert result.returncode == 0, result.stderr
    assert "experiment 'clitest'" in result.stdout


@pytest.mark.parametrize(
    ("old", "new", "fragments"),
    [
        (
            "vanilla_pg, params",
            "vanila_pg, params",
            ["arms.a.algorithm.name", "did you mean 'vanilla_pg'", ":10"],
        ),
        (
            "baseline: true",
            "baselin: true",
            ["arms.a.algorithm.params.baselin", "did you mean 'baseline'"],
        ),
        ("factor: 3", "factor: big", ["arms.b.modifiers.0.params.factor", "valid number", "'big'"]),
        (
            "budget: {steps: 3}",
            "budget: {steps: 3}\ntraining: {lr: -1}",
            ["training.lr", ":4", "greater than or equal to 0"],
        ),
        ("seeds: [0, 1]", "seeds: [zero]", ["seeds.0", ":2", "integer"]),
        ("budget: {steps: 3}", "budget: {steps: 3", ["YAML syntax error", "exp.yaml:"]),
    ],
)
def test_validate_errors_exit_2_with_location(exp, old, new, fragments):
    assert_user_error(
        alignzoo("validate", str(exp(GOOD.replace(old, new)))), "exp.yaml", *fragments
    )


def test_no_arms(exp):
    text = GOOD.split("arms:")[0] + "arms: {}\n"
    assert_user_error(alignzoo("validate", str(exp(text))), "arms", "at least 1")


def test_missing_file(tmp_path):
    assert_user_error(
        alignzoo("validate", str(tmp_path / "missing.yaml")), "not found", "missing.yaml"
    )


def test_debug_shows_the_traceback(tmp_path):
    result = alignzoo("--debug", "validate", str(tmp_path / "missing.yaml"))
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_plugin_whose_import_raises_exits_2(exp, tmp_path, monkeypatch, capsys):
    (tmp_path / "exploding_plugin.py").write_text("raise ImportError('needs libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry(entry_points=[entry_point("algorithm.exploding", "exploding_plugin:Algo")])
    for ep in ("labeler.keyword", "backend.canned", "device_mapper.all_cpu"):
        kind, name = ep.split(".")
        registry.register(__import__("alignzoo").get_registry().get(kind, name), name)
    monkeypatch.setattr("alignzoo.config.loader.get_registry", lambda: registry)
    path = exp(
        GOOD.replace("vanilla_pg, params: {baseline: true}", "exploding").replace(
            "    algorithm: vanilla_pg\n    modifiers: [{name: loss_scale, params: {factor: 3}}]\n",
            "    algorithm: exploding\n",
        )
    )
    code = cli.main(["validate", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        "exploding_plugin:Algo" in err and "needs libfoo" in err and "arms.a.algorithm.name" in err
    )
    assert "Traceback" not in err


def test_plugins_lists_outside_components_with_provider():
    result = alignzoo("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)}
    row = rows[("modifier", "loss_scale")]
    assert row["provider"] == "alignzoo-testplugin" and row["version"] == "0.3.1"
    assert row["summary"].startswith("Multiplies any algorithm's loss")
    assert row["status"] == "ok"


def test_plugins_kind_filter_and_bad_kind():
    result = alignzoo("plugins", "--kind", "device_mapper", "--json")
    assert {r["kind"] for r in json.loads(result.stdout)} == {"device_mapper"}
    assert_user_error(alignzoo("plugins", "--kind", "algo"), "unknown kind 'algo'")


def test_plugins_fits_80_columns_one_line_each_and_shows_one_in_full():
    env = {"COLUMNS": "80"}
    listing = alignzoo("plugins", env=env)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    count = len(json.loads(alignzoo("plugins", "--json").stdout))
    assert sum(1 for line in lines if line.split()[:1] and line.split()[0] in {
        "algorithm", "labeler", "backend", "device_mapper", "modifier", "environment"}) == count  # fmt: skip
    for row in json.loads(alignzoo("plugins", "--json").stdout):  # kind and provider kept
        assert any(line.split()[:3] == [row["kind"], row["name"], row["provider"]]
                   for line in lines), row  # fmt: skip
    long = alignzoo("plugins", "--long", "--kind", "labeler", env={"COLUMNS": "200"})
    assert "alignzoo.plugins.labelers.human:HumanLabeler" in long.stdout
    one = alignzoo("plugins", "human", env={"COLUMNS": "120"})
    assert one.returncode == 0, one.stderr
    assert "labeler.human = alignzoo.plugins.labelers.human:HumanLabeler" in one.stdout
    for text in ("queue", "required", "wait_s", "60.0", "'mean' | 'median'"):
        assert text in one.stdout, text
    assert_user_error(alignzoo("plugins", "nothing_here"), "no component named 'nothing_here'")


def test_a_name_in_two_kinds_is_shown_for_each(monkeypatch, capsys):
    from alignzoo import registry as registry_module

    both = Registry(
        entry_points=[
            entry_point("algorithm.toy", "tests.core.helpers:ToyAlgorithm"),
            entry_point("labeler.toy", "tests.core.helpers:ToyLabeler"),
        ]
    )
    monkeypatch.setattr(registry_module, "get_registry", lambda: both)
    assert cli.main(["plugins", "toy"]) == 0
    out = capsys.readouterr().out
    assert "'toy' names 2 components (algorithm, labeler)" in out
    assert "algorithm.toy = tests.core.helpers:ToyAlgorithm" in out
    assert "labeler.toy = tests.core.helpers:ToyLabeler" in out
    assert cli.main(["plugins", "toy", "--kind", "labeler"]) == 0
    assert "ToyAlgorithm" not in capsys.readouterr().out


def test_schema_includes_component_params(tmp_path):
    out = tmp_path / "schema.json"
    result = alignzoo("schema", "--out", str(out))
    assert result.returncode == 0, result.stderr
    schema = json.loads(out.read_text())
    assert "arms" in schema["properties"]
    assert "factor" in schema["$defs"]["modifier.loss_scale.params"]["properties"]


def test_schema_validates_a_real_experiment_file(exp):
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    schema = json.loads(alignzoo("schema").stdout)
    document = yaml.safe_load(GOOD)
    jsonschema.validate(document, schema)
    document["arms"]["b"]["modifiers"][0]["params"]["factor"] = "big"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, schema)


def test_version():
    result = alignzoo("--version")
    assert result.returncode == 0 and result.stdout.startswith("alignzoo ")


def test_bad_option_is_a_usage_error():
    result = alignzoo("run")
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_report_on_missing_folder(tmp_path):
    assert_user_error(alignzoo("report", str(tmp_path / "nothing")), "run folder not found")


def test_doctor_reports_versions_devices_and_plugins():
    result = alignzoo("doctor")
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout and "2.13" in result.stdout
    assert "devices" in result.stdout and "cpu" in result.stdout
    assert "plugins" in result.stdout and "load" in result.stdout


def test_repeated_seeds_on_the_command_line_are_a_user_error(exp, tmp_path, capsys):
    # The file's seeds are validated as distinct; --seeds must keep that rule, not run twice.
    code = cli.main(["run", str(exp()), "--seeds", "3,1,3", "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--seeds repeats 3" in err and "Traceback" not in err


def test_schema_into_a_missing_folder_is_a_user_error(tmp_path):
    result = alignzoo("schema", "--out", str(tmp_path / "no" / "such" / "schema.json"))
    assert_user_error(result, "cannot write")


def test_the_user_environment_holds_no_test_doubles():
    """make setup installs alignzoo only; the test plugin package lives in .test-plugins/,
    which the tests put on the path for themselves."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listing = subprocess.run(
        [sys.executable, "-m", "alignzoo.cli", "plugins", "--json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    providers = {r["provider"] for r in json.loads(listing.stdout)}
    assert "alignzoo-testplugin" not in providers
    names = {r["name"] for r in json.loads(alignzoo("plugins", "--json").stdout)}
    assert {"canned", "keyword", "loss_scale"} <= names  # the tests still see them


def test_the_ray_executor_without_ray_says_how_to_install_it(exp, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "o"
    code = cli.main(["run", str(exp()), "--executor", "ray", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "pip install 'alignzoo[ray]'" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was written
