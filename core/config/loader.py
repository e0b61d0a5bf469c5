"""Load an experiment YAML into an :class:`ExperimentSpec`, or say precisely what is wrong.

Every problem is reported with the file, the line, the dotted path, what was found and what
was expected, before any model is loaded. Validation has two phases: the schema (pydantic),
then each component's own ``Params`` model, looked up in the registry by name. A
:class:`~alignzoo.config.locate.Locator`, built once per file, places every problem where the
file writes it.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from alignzoo.config.locate import Locator
from alignzoo.config.overrides import apply_overrides, at_override, expand_sweeps, resolve_arms
from alignzoo.config.schema import ArmSpec, ComponentRef, ExperimentSpec
from alignzoo.config.yamlfile import FieldPath, LineIndex, non_finite_paths, read_yaml
from alignzoo.errors import ConfigError, ConfigIssue, PluginLoadError, UserError
from alignzoo.plugin import Component
from alignzoo.registry import Registry, build_plugin_manager, get_registry


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


# ---------------------------------------------------------------------- loading


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
    for arm_name, arm in spec.arms.items():
        components[arm_name], arm_issues = _build_components(
            arm_name, arm, registry, locator, spec.evaluation.labeler, spec.data.online
        )
        # The evaluation labeler's problems are the same for every arm: said once.
        issues += [i for i in arm_issues if i not in issues]
    if spec.evaluation.metric is None:
        spec = spec.model_copy(
            update={"evaluation": spec.evaluation.model_copy(update=default_metric(components))}
        )
    issues += _check_eval_metric(spec, components, locator)
    issues += _check_model_paths(spec, locator)
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


def _looks_local(value: str) -> bool:
    """A path rather than a hub id ('org/name'): absolute, relative with ./ or ../, ~, or
    more than one '/'."""
    return value.startswith(("/", "./", "../", "~", ".\\")) or value.count("/") > 1


def _check_model_paths(spec: ExperimentSpec, locator: Locator) -> list[ConfigIssue]:
    """Every local model folder an arm names exists (hub ids cannot be checked offline), and
    so does every data file or folder. A model an arm inherits is one problem, reported at
    ``model.<field>`` on the line where the arm or the shared ``model`` section writes it."""
    lines = locator.index.lines
    issues: dict[str, ConfigIssue] = {}
    for arm_name, arm in spec.arms.items():
        for field_name in ("policy", "reward_model"):
            value = getattr(arm.model, field_name)
            if not value or value == "embedded" or not _looks_local(value):
                continue
            folder = Path(value).expanduser()
            if folder.is_dir():
                continue
            at: FieldPath = ("arms", arm_name, "model", field_name)
            line = lines.get(at) or lines.get(("model", field_name))
            state = "is a file, not a model folder" if folder.exists() else "does not exist"
            issues.setdefault(
                f"{field_name}:{value}",
                ConfigIssue(
                    locator.file,
                    line or locator.index.line_of(at),
                    f"model.{field_name}",
                    f"{value!r} {state} (a folder written by save_pretrained is expected)",
                ),
            )
    for field_name in ("train", "eval"):
        value = getattr(spec.data, field_name)
        if not isinstance(
            value, str
        ):  # a generator (reasoning_gym, verifiers): checked when opened
            continue
        if value == "embedded" or Path(value).expanduser().exists():
            continue
        issues[f"data:{field_name}"] = locator.issue(
            ("data", field_name),
            f"{value!r} does not exist (give 'embedded', a jsonl / parquet file or a dataset "
            "folder written by save_to_disk)"
            + (
                "; it looks like a Hugging Face Hub dataset id, which alignzoo does not "
                f"download: save it once with datasets.load_dataset({value!r}).save_to_disk(DIR)"
                " and give DIR"
                if value.count("/") == 1 and not value.startswith((".", "/", "~"))
                else ""
            ),
        )
    return list(issues.values())


def _check_eval_metric(
    spec: ExperimentSpec, components: dict[str, dict[str, Component]], locator: Locator
) -> list[ConfigIssue]:
    """``evaluation.metric`` is one that evaluation produces for every arm's labeler."""
    from alignzoo import metrics as canonical

    ev = spec.evaluation
    metric = ev.metric if "/" in ev.metric else f"eval/{ev.metric}"
    where: FieldPath = ("evaluation", "metric")
    counted = [canonical.EVAL_EXACT_MATCH] + ([f"eval/pass@{ev.pass_at_k}"] if ev.pass_at_k else [])
    known = [canonical.EVAL_SCORE, canonical.EVAL_RESPONSE_LENGTH, *counted]
    if metric not in known:
        hint = difflib.get_close_matches(metric, known, n=1, cutoff=0.6)
        return [
            locator.issue(
                where,
                f"evaluation produces no metric {ev.metric!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + f" (it produces {', '.join(known)}"
                + ("" if ev.pass_at_k else "; eval/pass@k with evaluation.pass_at_k set")
                + ")",
            )
        ]
    if metric != canonical.EVAL_EXACT_MATCH:
        return []
    scorers = [
        arm
        for arm, built in components.items()
        if getattr(built.get(EVAL_LABELER, built.get("labeler")), "marks_correct", None) is False
    ]
    if not scorers:
        return []
    return [
        locator.issue(
            where,
            f"exact_match counts the responses a labeler marks correct, and the labeler of "
            f"arm(s) {', '.join(scorers)} only scores; compare on 'score' instead",
        )
    ]


EVAL_LABELER = "evaluation.labeler"
"""The component slot of ``evaluation.labeler`` (in every arm's components when it is set)."""


def _path_parts(field_path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in field_path.split(".")]


def _build_components(
    arm_name: str,
    arm: ArmSpec,
    registry: Registry,
    locator: Locator,
    evaluation_labeler: ComponentRef | None = None,
    spec_online: bool = True,
) -> tuple[dict[str, Component], list[ConfigIssue]]:
    built: dict[str, Component] = {}
    issues: list[ConfigIssue] = []
    refs: list[tuple[str, str, ComponentRef, FieldPath]] = [
        (kind, field_path, ref, ("arms", arm_name, *_path_parts(field_path)))
        for kind, field_path, ref in arm.component_refs()
    ]
    if evaluation_labeler is not None:  # the same labeler evaluates every arm
        refs.append(("labeler", EVAL_LABELER, evaluation_labeler, ("evaluation", "labeler")))
    for kind, field_path, ref, base in refs:
        try:
            cls = registry.get(kind, ref.name)
        except UserError as exc:
            issues.append(locator.issue((*base, "name"), str(exc)))
            continue
        try:
            given = dict(ref.params)
            # evaluation.labeler is one labeler for every arm: never filled in from an arm.
            given = given if field_path == EVAL_LABELER else cls.params_for_arm(given, arm)
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
            built[field_path] = cls(params)
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
    algorithm = built.get("algorithm")
    if arm.online is False and algorithm is not None:
        from alignzoo.engine.hooks import Hooks

        requirements = Hooks(build_plugin_manager([algorithm])).algorithm_requirements()
        if requirements.data == "online":
            base_path: FieldPath = ("arms", arm_name, "online")
            issues.append(
                locator.issue(
                    base_path,
                    f"{arm.algorithm.name} learns from sampled rollouts; 'online: false' applies "
                    "only to preference or unpaired-feedback algorithms (dpo, simpo, kto, ...)",
                )
            )
    issues += _environment_issues(locator, arm_name, arm, built)
    if arm.training.sampling.temperature == 0 and algorithm is not None:
        from alignzoo.engine.hooks import Hooks

        requirements = Hooks(build_plugin_manager([algorithm])).algorithm_requirements()
        online = arm.online if arm.online is not None else spec_online
        if requirements.data == "online" or online:
            greedy_path: FieldPath = ("arms", arm_name, "training", "sampling", "temperature")
            issues.append(
                locator.issue(
                    greedy_path,
                    f"0 samples greedily, and {arm.algorithm.name} trains on the log-probs of "
                    "what it sampled: a greedy policy gives every sample of a prompt the same "
                    "response and no distribution to learn from; give a temperature above 0 "
                    "(evaluation decodes greedily on its own)",
                )
            )
    correction = arm.training.rollout_correction.level
    if correction != "off" and algorithm is not None:
        from alignzoo.engine.hooks import Hooks

        requirements = Hooks(build_plugin_manager([algorithm])).algorithm_requirements()
        if not requirements.rollout_correction:
            level_path: FieldPath = ("arms", arm_name, "training", "rollout_correction", "level")
            issues.append(
                locator.issue(
                    level_path,
                    f"{correction!r} needs an online policy-gradient algorithm (grpo, ppo, rloo, "
                    f"reinforce_pp); {arm.algorithm.name} applies no importance weights to a "
                    "sampled surrogate; set level off",
                )
            )
    if arm.training.parallel == "fsdp2" and arm.model.lora is not None:
        parallel_path: FieldPath = ("arms", arm_name, "training", "parallel")
        issues.append(
            locator.issue(
                parallel_path,
                "fsdp2 does not shard LoRA adapters yet; use parallel: ddp for a LoRA arm "
                "(its adapters are small), or drop model.lora",
            )
        )
    listed = {ref.name for ref in arm.modifiers}
    for entry in registry.load_all("modifier"):
        component = entry.component
        default_on = component is not None and getattr(component, "default_on", False)
        if default_on and entry.name not in listed:
            assert component is not None
            built[f"modifiers.default.{entry.name}"] = component()
    # Each component's hook implementations must match the hookspecs (a misspelled hook or
    # argument): found here, by `alignzoo validate`, rather than when the run is assembled.
    for slot, component in built.items():
        try:
            build_plugin_manager([component])
        except PluginLoadError as exc:
            where: FieldPath = (
                "arms",
                arm_name,
                *(int(p) if p.isdigit() else p for p in slot.split(".")),
            )
            issues.append(locator.issue(where, str(exc)))
    issues += _weights_without_a_taker(locator, arm_name, arm, built)
    return built, issues


def _environment_issues(
    locator: Locator,
    arm_name: str,
    arm: ArmSpec,
    built: dict[str, Any],
) -> list[ConfigIssue]:
    """An arm with an environment samples episodes: its algorithm must learn from sampled
    rollouts and its backend must sample from token ids (``generate_ids``)."""
    if arm.environment is None:
        return []
    out = []
    where: FieldPath = ("arms", arm_name, "environment")
    algorithm, backend = built.get("algorithm"), built.get("backend")
    try:
        if algorithm is not None:
            data = build_plugin_manager([algorithm]).hook.algorithm_requirements().data
            if data != "online":
                out.append(
                    locator.issue(
                        where,
                        f"algorithm {arm.algorithm.name!r} learns from {data} data; an "
                        "environment's episodes train an online algorithm (grpo, rloo, "
                        "reinforce_pp, ppo)",
                    )
                )
        if (
            backend is not None
            and not build_plugin_manager([backend]).hook.generate_ids.get_hookimpls()
        ):
            out.append(
                locator.issue(
                    where,
                    f"backend {arm.backend.name!r} does not implement generate_ids (sampling "
                    "a turn from token ids), which episodes need; use the hf or vllm backend",
                )
            )
    except Exception:  # a component's own problem: reported by the checks above
        return out
    return out


def _weights_without_a_taker(
    locator: Locator,
    arm_name: str,
    arm: ArmSpec,
    built: dict[str, Any],
) -> list[ConfigIssue]:
    """A modifier that sets sample weights around an algorithm that does not declare it
    multiplies them in (``AlgorithmRequirements.weights``): the weights would change nothing."""
    algorithm = built.get("algorithm")
    setters = [
        (i, ref.name)
        for i, ref in enumerate(arm.modifiers)
        if getattr(built.get(f"modifiers.{i}"), "sets_weights", False)
    ]
    if algorithm is None or not setters:
        return []
    try:
        requirements = build_plugin_manager([algorithm]).hook.algorithm_requirements()
    except Exception:  # reported by the checks above, or when the run is assembled
        return []
    if getattr(requirements, "weights", False):
        return []
    out = []
    for i, name in setters:
        where: FieldPath = ("arms", arm_name, "modifiers", i)
        out.append(
            locator.issue(
                where,
                f"modifier {name!r} sets sample weights, but algorithm {arm.algorithm.name!r} "
                "does not declare that its loss multiplies them in (AlgorithmRequirements"
                "(weights=True)): the weights would apply to nothing; drop the modifier or make "
                "the algorithm honour batch.weights",
            )
        )
    return out
