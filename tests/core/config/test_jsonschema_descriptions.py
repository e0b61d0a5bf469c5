"""Every field of the experiment's JSON Schema says what it means (arm fields, every section,
and the params of every built-in component), so an editor can show it."""

from __future__ import annotations

from alignzoo.config.jsonschema import experiment_json_schema
from alignzoo.registry import get_registry

TEST_DOUBLES = {(e.kind, e.name) for e in get_registry().load_all() if e.distribution != "alignzoo"}


def _undescribed(node, path, out):
    if isinstance(node, dict):
        for key, value in (node.get("properties") or {}).items():
            if isinstance(value, dict) and not value.get("description"):
                out.append(f"{path}.{key}")
        for key, value in node.items():
            _undescribed(value, f"{path}/{key}", out)
    elif isinstance(node, list):
        for value in node:
            _undescribed(value, path, out)


def test_every_schema_field_has_a_description():
    schema = experiment_json_schema()
    outside = {f"{kind}.{name}.params" for kind, name in TEST_DOUBLES}
    missing: list[str] = []
    for name, definition in schema["$defs"].items():
        if name not in outside:
            _undescribed(definition, name, missing)
    _undescribed({"properties": schema["properties"]}, "experiment", missing)
    assert missing == []
    arm = schema["$defs"]["ArmSpec"]["properties"]
    assert "kind labeler" in arm["labeler"]["description"]
    assert "device_mapper" in arm["devices"]["description"]


def test_the_schema_checks_defaults_and_the_one_budget_rule():
    from pathlib import Path

    import jsonschema
    import yaml

    validator = jsonschema.Draft202012Validator(experiment_json_schema())
    root = Path(__file__).resolve().parents[3]
    for path in sorted((root / "experiments").glob("*.yaml")):
        experiment = yaml.safe_load(path.read_text())
        assert [e.message for e in validator.iter_errors(experiment)] == [], path.name
    experiment = yaml.safe_load((root / "experiments" / "quickstart.yaml").read_text())
    two = {**experiment, "budget": {"steps": 3, "samples": 10}}
    assert list(validator.iter_errors(two))
    none = {**experiment, "budget": {}}
    assert list(validator.iter_errors(none))
    typo = {**experiment, "defaults": {"labeler": "no_such_labeler"}}
    assert list(validator.iter_errors(typo))
    tools = yaml.safe_load((root / "experiments" / "tool_use.yaml").read_text())
    tools["arms"]["tool"]["environment"] = "no_such_environment"
    assert list(validator.iter_errors(tools))  # environments are named like any component
    tools["arms"]["tool"]["environment"] = {"name": "calculator", "params": {"enabled": "no"}}
    assert list(validator.iter_errors(tools))  # and their params checked
