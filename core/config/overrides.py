"""The layers over what an experiment file writes, applied before it is validated: ``--set``
overrides, sweeps expanded into one arm per combination of values, and the shared sections
(``training``, ``model``, ``defaults``) merged into every arm, which overrides them.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

import yaml

from alignzoo.config.yamlfile import FieldPath, safe_load
from alignzoo.errors import ConfigIssue, UserError


def deep_merge(base: Any, override: Any) -> Any:
    """``override`` on top of ``base``: mappings merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = copy.deepcopy(base)
        for key, value in override.items():
            merged[key] = deep_merge(merged[key], value) if key in merged else copy.deepcopy(value)
        return merged
    return copy.deepcopy(override)


def resolve_arms(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge the shared ``training``, ``model`` and ``defaults`` sections into every arm."""
    resolved = copy.deepcopy(raw)
    arms = raw.get("arms")
    if not isinstance(arms, dict):
        return resolved
    shared: dict[str, Any] = {}
    for section in ("training", "model"):
        if isinstance(raw.get(section), dict):
            shared[section] = raw[section]
    defaults = raw.get("defaults")
    if isinstance(defaults, dict):
        shared = deep_merge(shared, defaults)
    resolved["arms"] = {
        name: deep_merge(shared, arm) if isinstance(arm, dict) else arm
        for name, arm in arms.items()
    }
    return resolved


def parse_override(text: str) -> tuple[FieldPath, Any]:
    """``"training.lr=1e-5"`` -> (("training", "lr"), 1e-05): a dotted field (list items by
    index) and a YAML value."""
    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(_OVERRIDE_PART.fullmatch(p) for p in parts):
        raise UserError(
            f"--set {text!r}: expected FIELD=VALUE with a dotted field, e.g. "
            "training.lr=1e-5 or arms.grpo.algorithm.params.beta=0"
        )
    try:
        parsed = safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise UserError(f"--set {text!r}: the value is not YAML ({exc})") from None
    return tuple(int(p) if p.isdigit() else p for p in parts), parsed


_OVERRIDE_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-@]*|\d+")


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``raw`` with each ``--set FIELD=VALUE`` applied (a component given by name becomes
    ``{name: ...}`` when a field below it is set)."""
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node: Any = out
        for i, part in enumerate(path):
            where = ".".join(map(str, path[: i + 1]))
            if isinstance(node, list):
                if not isinstance(part, int) or part >= len(node):
                    raise UserError(f"--set {text!r}: {where} is not an item of that list")
            elif not isinstance(node, dict) or isinstance(part, int):
                raise UserError(f"--set {text!r}: {where}: nothing to set there")
            if i == len(path) - 1:
                node[part] = value
                break
            child = node.get(part) if isinstance(node, dict) else node[part]  # type: ignore[index]
            if isinstance(child, str) and not isinstance(path[i + 1], int):
                child = {"name": child}  # a component given by name, now with fields below
            elif child is None:
                child = [] if isinstance(path[i + 1], int) else {}
            node[part] = child
            node = child
    return out


def _sweep_label(key: str, value: Any) -> str:
    """``training.lr``, 1e-05 -> ``lr1e-05``: the part of a swept arm's name for one value."""
    text = f"{key.rsplit('.', 1)[-1]}{value}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def expand_sweeps(raw: dict[str, Any], file: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Arms with a ``sweep: {dotted.field: [values], ...}`` become one arm per combination of
    values, named ``<arm>-<field><value>...`` (e.g. ``grpo-lr1e-05``), in order; the
    baseline, if it was a swept arm, becomes its first. Returns the new raw experiment and
    each new arm's original."""
    arms = raw.get("arms")
    if not isinstance(arms, dict) or not any(
        isinstance(a, dict) and "sweep" in a for a in arms.values()
    ):
        return raw, {}
    out = copy.deepcopy(raw)
    expanded: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, arm in arms.items():
        if not isinstance(arm, dict) or "sweep" not in arm:
            expanded[name] = arm
            continue
        sweep = arm["sweep"]
        if (
            not isinstance(sweep, dict)
            or not sweep
            or not all(isinstance(v, list) and v for v in sweep.values())
        ):
            raise UserError(
                f"{file}: arms.{name}.sweep: expected a mapping of dotted fields to non-empty "
                f"lists of values, e.g. {{training.lr: [1.0e-5, 3.0e-5]}}, got {sweep!r}"
            )
        base = {k: v for k, v in arm.items() if k != "sweep"}
        keys = list(sweep)
        for combination in itertools.product(*(sweep[k] for k in keys)):
            label = "-".join(_sweep_label(k, v) for k, v in zip(keys, combination, strict=True))
            new = f"{name}-{label}"
            sets = [f"{k}={json.dumps(v)}" for k, v in zip(keys, combination, strict=True)]
            try:
                expanded[new] = apply_overrides(base, sets)
            except UserError as exc:
                raise UserError(f"{file}: arms.{name}.sweep: {exc}") from None
            origin[new] = name
    out["arms"] = expanded
    baseline = out.get("baseline")
    if isinstance(baseline, str) and baseline in arms and baseline not in expanded:
        out["baseline"] = next(n for n, o in origin.items() if o == baseline)
    return out, origin


def at_override(issue: ConfigIssue, overrides: Sequence[str]) -> ConfigIssue:
    """An issue in a field an override set is reported at that ``--set``."""
    for text in overrides:
        key = text.partition("=")[0].strip()
        related = (
            issue.path == key
            or issue.path.startswith(key + ".")  # inside what it set
            or key.startswith(issue.path + ".")  # the field it named is unknown
            or key.endswith("." + issue.path)
        )
        if related:
            return ConfigIssue(f"--set {text}", None, issue.path, issue.message)
    return issue
