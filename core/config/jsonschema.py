"""JSON Schema of experiment files, with each installed component's params (for editors).

The base schema comes from :class:`ExperimentSpec`; for every component slot of an arm it adds
``if name == X then params follows X's Params schema``, so an editor that understands JSON
Schema completes and checks component parameters too.
"""

from __future__ import annotations

from typing import Any

from alignzoo.config.schema import ExperimentSpec
from alignzoo.registry import Registry, get_registry

_SLOTS = {
    "algorithm": "algorithm",
    "labeler": "labeler",
    "backend": "backend",
    "devices": "device_mapper",
}


def _params_rules(registry: Registry, kind: str, defs: dict[str, Any]) -> list[dict[str, Any]]:
    rules = []
    for entry in registry.load_all(kind):
        if entry.component is None:
            continue
        params_schema = entry.component.Params.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(params_schema.pop("$defs", {}))
        key = f"{kind}.{entry.name}.params"
        defs[key] = params_schema
        rules.append(
            {
                "if": {
                    "properties": {
                        "name": {"const": entry.name, "description": f"{kind} {entry.name}"}
                    },
                    "required": ["name"],
                },
                "then": {
                    "properties": {
                        "params": {
                            "$ref": f"#/$defs/{key}",
                            "description": f"Params of {kind} {entry.name}: "
                            + entry.component.summary(),
                        }
                    }
                },
            }
        )
    return rules


def experiment_json_schema(registry: Registry | None = None) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of an experiment YAML, component params included."""
    registry = registry or get_registry()
    schema = ExperimentSpec.model_json_schema(ref_template="#/$defs/{model}")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    arm = defs["ArmSpec"]
    arm.pop("required", None)  # `defaults:` may supply the algorithm
    ref_schemas: dict[str, dict[str, Any]] = {}
    for slot, kind in [*_SLOTS.items(), ("modifiers", "modifier"), ("environment", "environment")]:
        name = f"{kind}.ref"
        ref_schemas[slot] = {
            "anyOf": [
                {"type": "string", "enum": registry.names(kind)},
                {"allOf": [{"$ref": "#/$defs/ComponentRef"}, *_params_rules(registry, kind, defs)]},
            ]
        }
        defs[name] = ref_schemas[slot]
    for slot in _SLOTS:
        described = arm["properties"][slot].get("description", "")
        arm["properties"][slot] = {"$ref": f"#/$defs/{_SLOTS[slot]}.ref", "description": described}
    arm["properties"]["environment"] = {  # optional: an arm without one samples single turns
        "anyOf": [{"$ref": "#/$defs/environment.ref"}, {"type": "null"}],
        "description": arm["properties"]["environment"].get("description", ""),
    }
    arm["properties"]["modifiers"] = {
        "type": "array",
        "items": {"$ref": "#/$defs/modifier.ref"},
        "description": arm["properties"]["modifiers"].get("description", ""),
    }
    # evaluation.labeler: a labeler reference like an arm's (or null).
    evaluation = defs["EvaluationConfig"]["properties"]["labeler"]
    evaluation_labeler = {"anyOf": [{"$ref": "#/$defs/labeler.ref"}, {"type": "null"}]}
    defs["EvaluationConfig"]["properties"]["labeler"] = {
        **evaluation_labeler,
        "default": None,
        "description": evaluation.get("description", ""),
    }
    # `defaults:` holds any arm field (merged into every arm): typed like an arm, so editors
    # check it too.
    described = schema["properties"]["defaults"].get("description", "")
    schema["properties"]["defaults"] = {"$ref": "#/$defs/ArmSpec", "description": described}
    # Exactly one budget: steps, samples or wall_clock_s.
    defs["Budget"]["oneOf"] = [
        {
            "required": [key],
            "properties": {key: {"not": {"type": "null"}, "description": f"The budget in {key}."}},
        }
        for key in ("steps", "samples", "wall_clock_s")
    ]
    return schema
