"""Load an experiment YAML into an :class:`ExperimentSpec`, or say precisely what is wrong.

Every problem is reported with the file, the line, the dotted path, what was found and what
was expected, before any model is loaded. The steps, each in its own module: read the YAML
with its line index (:mod:`~alignzoo.config.yamlfile`); apply ``--set`` overrides, expand
sweeps and merge the shared sections into every arm (:mod:`~alignzoo.config.overrides`);
validate the schema (pydantic); build each arm's components from their own ``Params`` models
(:mod:`~alignzoo.config.components`); check the combination (:mod:`~alignzoo.config.checks`).
A :class:`~alignzoo.config.locate.Locator` places every problem where the file writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from alignzoo.config.checks import arm_issues, eval_metric_issues, model_path_issues
from alignzoo.config.components import EVAL_LABELER, build_arm
from alignzoo.config.locate import Locator
from alignzoo.config.overrides import apply_overrides, at_override, expand_sweeps, resolve_arms
from alignzoo.config.schema import ExperimentSpec
from alignzoo.config.yamlfile import FieldPath, LineIndex, read_yaml
from alignzoo.errors import ConfigError, ConfigIssue, UserError
from alignzoo.plugin import Component
from alignzoo.registry import Registry, get_registry


@dataclass
class LoadedExperiment:
    """A validated experiment: the spec, where it came from, and each arm's component instances."""

    spec: ExperimentSpec
    source: str
    components: dict[str, dict[str, Component]] = field(default_factory=dict)
    """arm name -> {"algorithm": ..., "labeler": ..., "backend": ..., "devices": ..., "modifiers.0": ...}"""
    locator: Locator | None = None
    """Places an issue about a resolved field (("arms", "a", "labeler")) where the file writes
    it (the arm, ``defaults``, ``training``); None for an experiment not read from a file."""

    def issue(self, path: FieldPath, message: str) -> ConfigIssue:
        """A located issue about the resolved field ``path`` (see :attr:`locator`); without a
        locator, one naming :attr:`source` and the field, with no line."""
        return (self.locator or Locator(self.source)).issue(path, message)


def load_experiment(
    path: str | Path,
    registry: Registry | None = None,
    arms: list[str] | None = None,
    overrides: Sequence[str] = (),
) -> LoadedExperiment:
    """Read, merge and validate an experiment file, including every component's params.

    ``arms`` restricts the experiment to those arms (error if one is unknown). ``overrides``
    (``--set FIELD=VALUE``) change fields of the file before it is validated; a problem they
    cause is reported at ``--set ...``, and the resolved spec records them.
    """
    file = str(path)
    raw, index = read_yaml(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
    try:
        return _load(file, raw, index, registry, arms, list(overrides))
    except ConfigError as exc:
        if not overrides:
            raise
        raise ConfigError([at_override(i, overrides) for i in exc.issues]) from None


def _load(
    file: str,
    raw: dict[str, Any],
    index: LineIndex,
    registry: Registry | None,
    arms: list[str] | None,
    overrides: list[str],
) -> LoadedExperiment:
    raw, swept = expand_sweeps(raw, file)
    resolved = resolve_arms(raw)
    if overrides:
        resolved["overrides"] = overrides
    resolved_arms = resolved.get("arms")
    locator = Locator.for_experiment(
        file, index, resolved_arms if isinstance(resolved_arms, dict) else (), swept
    )
    try:
        spec = ExperimentSpec.model_validate(resolved)
    except ValidationError as exc:
        raise ConfigError(locator.validation_issues(exc, ExperimentSpec)) from None

    if arms:
        unknown = [a for a in arms if a not in spec.arms]
        if unknown:
            raise UserError(
                f"{file}: --arms names {', '.join(unknown)}, not arms of this experiment "
                f"(arms: {', '.join(spec.arms)})"
            )
        spec = spec.model_copy(update={"arms": {a: spec.arms[a] for a in arms}})
        if spec.baseline not in spec.arms:
            spec = spec.model_copy(update={"baseline": arms[0]})

    registry = registry or get_registry()
    components: dict[str, dict[str, Component]] = {}
    issues: list[ConfigIssue] = []
    for arm_name, arm_spec in spec.arms.items():
        arm, found = build_arm(
            arm_name, arm_spec, registry, locator, spec.data.online, spec.evaluation.labeler
        )
        found += arm_issues(arm, locator)
        components[arm_name] = arm.components
        # The evaluation labeler's problems are the same for every arm: said once.
        issues += [i for i in found if i not in issues]
    if spec.evaluation.metric is None:
        spec = spec.model_copy(
            update={"evaluation": spec.evaluation.model_copy(update=default_metric(components))}
        )
    issues += eval_metric_issues(spec, components, locator)
    issues += model_path_issues(spec, locator)
    if issues:
        raise ConfigError(issues)
    return LoadedExperiment(spec=spec, source=file, components=components, locator=locator)


def default_metric(components: dict[str, dict[str, Component]]) -> dict[str, str]:
    """``evaluation.metric`` when the file gives none: ``exact_match`` when every arm's labeler
    marks answers correct (``marks_correct``), else ``score``, the labeler's mean value."""
    marks = all(
        getattr(built.get(EVAL_LABELER, built.get("labeler")), "marks_correct", None) is True
        for built in components.values()
    )
    return {"metric": "exact_match" if marks else "score", "metric_chosen": "default"}
