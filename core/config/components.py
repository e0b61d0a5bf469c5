"""Building an arm's components from the validated spec, and what its algorithm requires.

Each component an arm names (algorithm, labeler, backend, device mapper, modifiers, ...) is
looked up in the registry by name, its ``params`` validated by the component's own ``Params``
model and an instance built; a problem is a located issue. :attr:`BuiltArm.requirements` is
the one place the checks ask what the arm's algorithm needs (reference, critic, kind of data,
weights, rollout correction).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pydantic import ValidationError

from alignzoo.config.locate import Locator
from alignzoo.config.schema import ArmSpec, ComponentRef
from alignzoo.config.yamlfile import FieldPath, non_finite_paths
from alignzoo.errors import ConfigIssue, RunError, UserError
from alignzoo.plugin import Component
from alignzoo.registry import Registry, build_plugin_manager
from alignzoo.types import AlgorithmRequirements

EVAL_LABELER = "evaluation.labeler"
"""The component slot of ``evaluation.labeler`` (in every arm's components when it is set)."""


def algorithm_requirements(algorithm: Component) -> AlgorithmRequirements:
    """What ``algorithm`` needs the engine to provide: its ``algorithm_requirements`` hook,
    called with the algorithm alone and checked as the engine checks a hook's answer.

    Raises:
        PluginLoadError: the algorithm's hook implementations do not match the hookspecs.
        UserError: the hook states no requirements.
        RunError: the hook raised, or returned something other than AlgorithmRequirements.
    """
    # The messages are those of the engine's Hooks over a manager of the algorithm alone.
    manager = build_plugin_manager([algorithm])
    implementer = type(algorithm).__name__
    try:
        value = manager.hook.algorithm_requirements()
    except (UserError, RunError):
        raise
    except Exception as exc:
        raise RunError(
            f"algorithm_requirements failed in {implementer}: {type(exc).__name__}: {exc}"
        ) from exc
    if value is None:
        raise UserError("the algorithm: the algorithm states no requirements")
    if not isinstance(value, AlgorithmRequirements):
        raise RunError(
            f"algorithm_requirements of {implementer} returned {type(value).__name__}; "
            "expected an AlgorithmRequirements"
        )
    return value


@dataclass
class BuiltArm:
    """One arm of the resolved experiment and the components built from it."""

    name: str
    spec: ArmSpec
    components: dict[str, Component]
    """slot -> instance: ``"algorithm"``, ``"labeler"``, ``"modifiers.0"``, ... (a component
    whose params were refused is missing)."""
    data_online: bool
    """The data section's ``online``, which the arm follows unless it sets its own."""

    @property
    def online(self) -> bool:
        """The arm's ``online`` setting, else the data section's; never for an arm whose
        algorithm imitates demonstrations (they are read, not sampled)."""
        requirements = self.loaded_requirements
        if requirements is not None and requirements.data == "demonstrations":
            return False
        return self.data_online if self.spec.online is None else self.spec.online

    @property
    def loaded_requirements(self) -> AlgorithmRequirements | None:
        """The requirements, or None when the algorithm was not built or its hooks do not load
        (what :func:`alignzoo.config.checks.arm_issues` reports, located, on its own)."""
        if "algorithm" not in self.components:
            return None
        try:
            return self.requirements
        except Exception:
            return None

    @functools.cached_property
    def requirements(self) -> AlgorithmRequirements:
        """What the arm's algorithm needs (:func:`algorithm_requirements`), asked once; only
        for an arm whose algorithm was built."""
        return algorithm_requirements(self.components["algorithm"])


def slot_field(arm: str, slot: str) -> FieldPath:
    """Where the experiment writes the component in ``slot`` of ``arm``: ``"modifiers.0"`` ->
    ``("arms", arm, "modifiers", 0)``."""
    return ("arms", arm, *(int(p) if p.isdigit() else p for p in slot.split(".")))


def build_arm(
    name: str,
    spec: ArmSpec,
    registry: Registry,
    locator: Locator,
    data_online: bool,
    evaluation_labeler: ComponentRef | None = None,
) -> tuple[BuiltArm, list[ConfigIssue]]:
    """Every component arm ``name`` names, built from its validated params, plus the modifiers
    that are on by default and the arm does not list; ``evaluation_labeler``, when the
    experiment sets one, is built into the arm's slot :data:`EVAL_LABELER`. Returns the arm
    and the located problems (an unknown name, refused params, a constructor that raised)."""
    built: dict[str, Component] = {}
    issues: list[ConfigIssue] = []
    refs: list[tuple[str, str, ComponentRef, FieldPath]] = [
        (kind, slot, ref, slot_field(name, slot)) for kind, slot, ref in spec.component_refs()
    ]
    if evaluation_labeler is not None:  # the same labeler evaluates every arm
        refs.append(("labeler", EVAL_LABELER, evaluation_labeler, ("evaluation", "labeler")))
    for kind, slot, ref, base in refs:
        try:
            cls = registry.get(kind, ref.name)
        except UserError as exc:
            issues.append(locator.issue((*base, "name"), str(exc)))
            continue
        try:
            given = dict(ref.params)
            # evaluation.labeler is one labeler for every arm: never filled in from an arm.
            given = given if slot == EVAL_LABELER else cls.params_for_arm(given, spec)
            params = cls.Params.model_validate(given)
        except ValidationError as exc:
            # Suggestions for misspelled params come from the component's own model.
            issues += locator.validation_issues(exc, cls.Params, (*base, "params"))
            continue
        bad = non_finite_paths(params.model_dump(mode="python"))
        if bad:
            for inner in bad:
                issues.append(
                    locator.issue(
                        (*base, "params", *inner),
                        "not a finite number (.inf and .nan make a run meaningless)",
                    )
                )
            continue
        try:
            built[slot] = cls(params)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a plugin's constructor, even sys.exit
            issues.append(
                locator.issue(
                    base,
                    f"constructing {registry.describe(kind, ref.name)} raised "
                    f"{type(exc).__name__}: {exc}",
                )
            )
    listed = {ref.name for ref in spec.modifiers}
    for entry in registry.load_all("modifier"):
        component = entry.component
        default_on = component is not None and getattr(component, "default_on", False)
        if default_on and entry.name not in listed:
            assert component is not None
            built[f"modifiers.default.{entry.name}"] = component()
    return BuiltArm(name, spec, built, data_online), issues
