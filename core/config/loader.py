"""Load an experiment YAML into an :class:`ExperimentSpec`, or say precisely what is wrong.

Every problem is reported with the file, the line, the dotted path, what was found and what
was expected, before any model is loaded. Validation has two phases: the schema (pydantic),
then each component's own ``Params`` model, looked up in the registry by name.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from alignzoo.config.schema import ArmSpec, ComponentRef, ExperimentSpec
from alignzoo.errors import ConfigError, ConfigIssue, PluginLoadError, UserError
from alignzoo.plugin import Component
from alignzoo.registry import Registry, build_plugin_manager, get_registry

Path_ = tuple[str | int, ...]


@dataclass
class LoadedExperiment:
    """A validated experiment: the spec, where it came from, and each arm's component instances."""

    spec: ExperimentSpec
    source: str
    components: dict[str, dict[str, Component]] = field(default_factory=dict)
    """arm name -> {"algorithm": ..., "labeler": ..., "backend": ..., "devices": ..., "modifiers.0": ...}"""
    locate: Callable[[Path_, str], ConfigIssue] | None = None
    """``locate(path, message)``: an issue about the resolved field ``path`` (("arms", "a",
    "labeler")), placed where the file writes it (the arm, ``defaults``, ``training``)."""

    def issue(self, path: Path_, message: str) -> ConfigIssue:
        """A located issue about the resolved field ``path`` (see :attr:`locate`)."""
        if self.locate is None:
            return ConfigIssue(self.source, None, ".".join(map(str, path)), message)
        return self.locate(path, message)


# ---------------------------------------------------------------------- YAML with line numbers


class _LineIndex:
    """Maps a dotted path in a YAML document to the line where it is written."""

    def __init__(self) -> None:
        self.lines: dict[Path_, int] = {}

    def line_of(self, path: Path_) -> int | None:
        # The deepest prefix that exists: a missing field is reported at its parent.
        for cut in range(len(path), -1, -1):
            if path[:cut] in self.lines:
                return self.lines[path[:cut]]
        return None


class _KeysAsWritten(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping key YAML 1.1 would read as a boolean (``on``,
    ``off``, ``yes``, ``no``, ``y``, ``n``, ``true``, ``false``) stays the text it was written
    as: ``labeling.on`` is the key ``"on"``, not ``True``. Values are read as before."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag == BOOL_TAG:
                key_node.tag = STR_TAG
        return super().construct_mapping(node, deep=deep)


BOOL_TAG = "tag:yaml.org,2002:bool"
STR_TAG = "tag:yaml.org,2002:str"


def safe_load(text: str) -> Any:
    """``yaml.safe_load``, with mapping keys such as ``on`` kept as written (YAML 1.1 would
    make them booleans); every YAML file alignzoo reads goes through it."""
    return yaml.load(text, Loader=_KeysAsWritten)


def _index_node(node: yaml.Node, path: Path_, index: _LineIndex, issues: list[str]) -> None:
    index.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                issues.append(f"{key_node.start_mark.line + 1}:{'.'.join(map(str, (*path, key)))}")
            seen.add(key)
            index.lines[(*path, key)] = key_node.start_mark.line + 1
            _index_node(value_node, (*path, key), index, issues)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            index.lines[(*path, i)] = item.start_mark.line + 1
            _index_node(item, (*path, i), index, issues)


MAX_FILE_BYTES = 1 << 20
"""An experiment file is a few kilobytes; anything above 1 MiB is refused unread."""
MAX_NODES = 100_000
"""The most YAML nodes a file may expand to, aliases counted at every use (an alias bomb)."""
MAX_DEPTH = 64
"""The deepest nesting of mappings and sequences a file may have."""


def _check_size(node: yaml.Node, file: str) -> None:
    """Refuse documents that expand to more than MAX_NODES nodes or nest beyond MAX_DEPTH.

    Aliases share their node in the composed graph, so the expanded size is counted once per
    distinct node (memoised) while the count itself is what every later walk would visit.
    """
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int, bool]] = [(node, 1, False)]
    while stack:
        current, depth, children_done = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(
                [
                    ConfigIssue(
                        file,
                        current.start_mark.line + 1,
                        "",
                        f"nested more than {MAX_DEPTH} levels deep; an experiment file needs "
                        "a handful",
                    )
                ]
            )
        if isinstance(current, yaml.MappingNode):
            children = [n for pair in current.value for n in pair]
        elif isinstance(current, yaml.SequenceNode):
            children = list(current.value)
        else:
            sizes[id(current)] = 1
            continue
        if id(current) in sizes:
            continue
        if not children_done:
            stack.append((current, depth, True))
            stack += [(c, depth + 1, False) for c in children if id(c) not in sizes]
            continue
        total = 1 + sum(sizes.get(id(c), 1) for c in children)
        if total > MAX_NODES:
            raise ConfigError(
                [
                    ConfigIssue(
                        file,
                        current.start_mark.line + 1,
                        "",
                        f"expands to more than {MAX_NODES} values (aliases are counted at every "
                        "use); an experiment file needs a few hundred",
                    )
                ]
            )
        sizes[id(current)] = total


def _non_finite(data: Any, path: Path_ = ()) -> list[Path_]:
    """Dotted paths of every float in ``data`` that is inf or nan."""
    if isinstance(data, float) and not math.isfinite(data):
        return [path]
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in _non_finite(v, (*path, k))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in _non_finite(v, (*path, i))]
    return []


def read_yaml(path: str | Path) -> tuple[dict[str, Any], _LineIndex]:
    """Parse a YAML mapping and index its lines; raise UserError/ConfigError on any problem.

    Bounded: a file above :data:`MAX_FILE_BYTES`, a document expanding to more than
    :data:`MAX_NODES` values (an alias bomb) or nesting deeper than :data:`MAX_DEPTH` is
    refused with a message, before anything walks it. Non-finite numbers (``.inf``, ``.nan``)
    are refused wherever they are written.
    """
    file = str(path)
    p = Path(path)
    if not p.exists():
        raise UserError(f"experiment file not found: {file}")
    if p.is_dir():
        raise UserError(f"expected an experiment YAML file, got a directory: {file}")
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise UserError(
                f"{file}: {size} bytes; an experiment file may have at most {MAX_FILE_BYTES} "
                "(is this the right file?)"
            )
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{file}: not a UTF-8 text file (byte {exc.start}); expected an experiment YAML"
        ) from None
    except OSError as exc:
        raise UserError(f"cannot read experiment file {file}: {exc.strerror or exc}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _check_size(node, file)
        data = safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([ConfigIssue(file, line, "", f"YAML syntax error: {problem}")]) from None
    except RecursionError:
        raise ConfigError(
            [ConfigIssue(file, None, "", f"nested more than {MAX_DEPTH} levels deep")]
        ) from None
    if not isinstance(data, dict):
        found = "an empty file" if data is None else f"a {type(data).__name__}"
        raise ConfigError(
            [ConfigIssue(file, 1, "", f"expected a mapping of sections, found {found}")]
        )
    index = _LineIndex()
    duplicates: list[str] = []
    assert node is not None
    _index_node(node, (), index, duplicates)
    if duplicates:
        issues = []
        for item in duplicates:
            line, dotted = item.split(":", 1)
            issues.append(
                ConfigIssue(
                    file,
                    int(line),
                    dotted,
                    "duplicate key (the first value would be silently lost)",
                )
            )
        raise ConfigError(issues)
    bad = _non_finite(data)
    if bad:
        raise ConfigError(
            [
                ConfigIssue(
                    file,
                    index.line_of(where),
                    ".".join(map(str, where)),
                    "not a finite number (.inf and .nan make a run meaningless); give a "
                    "finite value",
                )
                for where in bad
            ]
        )
    return data, index


def load_yaml_model(path: str | Path, model: type[BaseModel], what: str) -> Any:
    """A small YAML file (a labeler spec, a server config) validated by ``model``; UserError
    naming the file, the field and what was expected."""
    file = Path(path)
    try:
        data = safe_load(file.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what} file not found: {file}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{file}: not a YAML {what} file ({exc})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"])) or "<top level>"
        raise UserError(f"{file}: {where}: {err['msg']}") from None


# ---------------------------------------------------------------------- merging


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


# ---------------------------------------------------------------------- error reporting


def _fields_at(model: type[BaseModel], loc: Path_) -> list[str]:
    """Field names of the pydantic model reached by walking ``loc`` (list indexes skipped)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        if part not in current.model_fields:
            return []
        current = _unwrap(current.model_fields[part].annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    """The pydantic model inside ``X | None``, ``list[X]`` or ``dict[str, X]``, else the annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation) or ():
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


def _strip_dict_keys(model: type[BaseModel], loc: Path_) -> Path_:
    """Drop the arm-name part when walking fields: arms.<name>.x -> arms.x for field lookup."""
    if len(loc) >= 2 and loc[0] == "arms":
        return ("arms", *loc[2:])
    return loc


def _describe_error(err: Any, known_fields: list[str]) -> str:
    kind = err["type"]
    loc = err["loc"]
    if kind == "extra_forbidden":
        key = str(loc[-1]) if loc else "?"
        message = f"unknown field {key!r}"
        close = difflib.get_close_matches(key, known_fields, n=1, cutoff=0.6)
        if close:
            message += f"; did you mean {close[0]!r}?"
        elif known_fields:
            message += f"; expected one of: {', '.join(known_fields)}"
        return message
    if kind == "missing":
        return "required field is missing"
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if "input" in err and kind not in ("missing",) and not isinstance(err["input"], dict):
        message += f" (found {err['input']!r})"
    return message


def written_at(
    full: Path_, index: _LineIndex, fallbacks: dict[Path_, Path_] | None
) -> tuple[Path_, int | None]:
    """Where the value at resolved path ``full`` is written, and its line: an arm's field that
    the arm leaves to ``defaults`` (or to the shared ``training`` / ``model``, or to the arm a
    sweep came from) is written there, so a problem in it is reported once, at its own place,
    rather than at every arm that inherits it."""

    def unwritten(path: Path_) -> int:  # levels of ``path`` below its deepest written prefix
        return next(
            (len(path) - cut for cut in range(len(path), 0, -1) if path[:cut] in index.lines),
            len(path),
        )

    def scalar_above(path: Path_) -> bool:  # a shorthand (``labeler: name``) replaces it all
        cut = len(path) - unwritten(path)
        return 0 < cut < len(path) and not any(
            len(key) > cut and key[:cut] == path[:cut] for key in index.lines
        )

    # The arm's own path first, then defaults, then the shared sections: what the merge lets
    # win when two write the value equally deep.
    best, best_unwritten = full, unwritten(full)
    if best_unwritten == 0 or scalar_above(full):
        return full, index.line_of(full)
    for src, dst in sorted((fallbacks or {}).items(), key=lambda item: len(item[0])):
        if full[: len(src)] == src:
            written = (*dst, *full[len(src) :])
            if unwritten(written) < best_unwritten:
                best, best_unwritten = written, unwritten(written)
    line = index.lines.get(best)
    return best, line if line is not None else index.line_of(best)


def issue_at(
    file: str,
    index: _LineIndex,
    fallbacks: dict[Path_, Path_] | None,
    path: Path_,
    message: str,
) -> ConfigIssue:
    """A :class:`ConfigIssue` about the value at resolved ``path``, placed where it is written
    (:func:`written_at`)."""
    written, line = written_at(path, index, fallbacks)
    return ConfigIssue(file, line, ".".join(map(str, written)), message)


def issues_from_validation(
    exc: ValidationError,
    model: type[BaseModel],
    file: str,
    index: _LineIndex,
    prefix: Path_ = (),
    fallback_prefixes: dict[Path_, Path_] | None = None,
) -> list[ConfigIssue]:
    """Convert a pydantic ValidationError into located ConfigIssues."""
    issues: list[ConfigIssue] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        full = (*prefix, *loc)
        known = _fields_at(model, _strip_dict_keys(model, loc[:-1])) if loc else []
        # A value merged from `training:` / `defaults:` is reported where it is written.
        issues.append(issue_at(file, index, fallback_prefixes, full, _describe_error(err, known)))
    # One wrong shared value is inherited by every arm: report it once.
    return list(dict.fromkeys(issues))


# ---------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[tuple[str | int, ...], Any]:
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
    import itertools

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


def _load(
    file: str,
    raw: dict[str, Any],
    index: _LineIndex,
    registry: Registry | None,
    arms: list[str] | None,
    overrides: list[str],
) -> LoadedExperiment:
    raw, swept = expand_sweeps(raw, file)
    resolved = resolve_arms(raw)
    if overrides:
        resolved["overrides"] = overrides
    fallbacks: dict[Path_, Path_] = {}
    for arm_name in resolved.get("arms", {}) if isinstance(resolved.get("arms"), dict) else {}:
        for section in ("training", "model"):
            fallbacks[("arms", arm_name, section)] = (section,)
        fallbacks[("arms", arm_name)] = ("defaults",)
        if arm_name in swept:  # a problem in a swept arm is reported at the arm it came from
            fallbacks[("arms", arm_name)] = ("arms", swept[arm_name])
            for section in ("training", "model"):
                fallbacks[("arms", arm_name, section)] = ("arms", swept[arm_name], section)
    try:
        spec = ExperimentSpec.model_validate(resolved)
    except ValidationError as exc:
        raise ConfigError(
            issues_from_validation(exc, ExperimentSpec, file, index, fallback_prefixes=fallbacks)
        ) from None

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
            arm_name, arm, registry, file, index, fallbacks, spec.evaluation.labeler,
            spec.data.online,
        )  # fmt: skip
        # The evaluation labeler's problems are the same for every arm: said once.
        issues += [i for i in arm_issues if i not in issues]
    if spec.evaluation.metric is None:
        spec = spec.model_copy(
            update={"evaluation": spec.evaluation.model_copy(update=default_metric(components))}
        )
    issues += _check_eval_metric(spec, components, file, index)
    issues += _check_model_paths(spec, file, index, fallbacks)
    if issues:
        raise ConfigError(issues)
    return LoadedExperiment(
        spec=spec,
        source=file,
        components=components,
        locate=functools.partial(issue_at, file, index, fallbacks),
    )


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


def _check_model_paths(
    spec: ExperimentSpec, file: str, index: _LineIndex, fallbacks: dict[Path_, Path_]
) -> list[ConfigIssue]:
    """Every local model folder an arm names exists (hub ids cannot be checked offline), and
    so does every data file or folder."""
    issues: dict[str, ConfigIssue] = {}
    for arm_name, arm in spec.arms.items():
        for field_name in ("policy", "reward_model"):
            value = getattr(arm.model, field_name)
            if not value or value == "embedded" or not _looks_local(value):
                continue
            folder = Path(value).expanduser()
            if folder.is_dir():
                continue
            at: Path_ = ("arms", arm_name, "model", field_name)
            line = index.lines.get(at) or index.lines.get(("model", field_name))
            state = "is a file, not a model folder" if folder.exists() else "does not exist"
            issues.setdefault(
                f"{field_name}:{value}",
                ConfigIssue(
                    file,
                    line or index.line_of(at),
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
        issues[f"data:{field_name}"] = ConfigIssue(
            file,
            index.line_of(("data", field_name)),
            f"data.{field_name}",
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
    spec: ExperimentSpec,
    components: dict[str, dict[str, Component]],
    file: str,
    index: _LineIndex,
) -> list[ConfigIssue]:
    """``evaluation.metric`` is one that evaluation produces for every arm's labeler."""
    from alignzoo import metrics as canonical

    ev = spec.evaluation
    metric = ev.metric if "/" in ev.metric else f"eval/{ev.metric}"
    where: Path_ = ("evaluation", "metric")
    line = index.line_of(where)
    counted = [canonical.EVAL_EXACT_MATCH] + ([f"eval/pass@{ev.pass_at_k}"] if ev.pass_at_k else [])
    known = [canonical.EVAL_SCORE, canonical.EVAL_RESPONSE_LENGTH, *counted]
    if metric not in known:
        hint = difflib.get_close_matches(metric, known, n=1, cutoff=0.6)
        return [
            ConfigIssue(
                file,
                line,
                "evaluation.metric",
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
        ConfigIssue(
            file,
            line,
            "evaluation.metric",
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
    file: str,
    index: _LineIndex,
    fallbacks: dict[Path_, Path_],
    evaluation_labeler: ComponentRef | None = None,
    spec_online: bool = True,
) -> tuple[dict[str, Component], list[ConfigIssue]]:
    built: dict[str, Component] = {}
    issues: list[ConfigIssue] = []
    refs: list[tuple[str, str, ComponentRef, Path_]] = [
        (kind, field_path, ref, ("arms", arm_name, *_path_parts(field_path)))
        for kind, field_path, ref in arm.component_refs()
    ]
    if evaluation_labeler is not None:  # the same labeler evaluates every arm
        refs.append(("labeler", EVAL_LABELER, evaluation_labeler, ("evaluation", "labeler")))
    for kind, field_path, ref, base in refs:
        try:
            cls = registry.get(kind, ref.name)
        except UserError as exc:
            issues.append(issue_at(file, index, fallbacks, (*base, "name"), str(exc)))
            continue
        try:
            given = dict(ref.params)
            # evaluation.labeler is one labeler for every arm: never filled in from an arm.
            given = given if field_path == EVAL_LABELER else cls.params_for_arm(given, arm)
            params = cls.Params.model_validate(given)
        except ValidationError as exc:
            # Suggestions for misspelled params come from the component's own model.
            issues += issues_from_validation(
                exc, cls.Params, file, index, (*base, "params"), fallbacks
            )
            continue
        bad = _non_finite(params.model_dump(mode="python"))
        if bad:
            for inner in bad:
                issues.append(
                    issue_at(
                        file,
                        index,
                        fallbacks,
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
                issue_at(
                    file,
                    index,
                    fallbacks,
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
            base_path: Path_ = ("arms", arm_name, "online")
            issues.append(
                issue_at(
                    file,
                    index,
                    fallbacks,
                    base_path,
                    f"{arm.algorithm.name} learns from sampled rollouts; 'online: false' applies "
                    "only to preference or unpaired-feedback algorithms (dpo, simpo, kto, ...)",
                )
            )
    issues += _environment_issues(file, index, fallbacks, arm_name, arm, built)
    if arm.training.sampling.temperature == 0 and algorithm is not None:
        from alignzoo.engine.hooks import Hooks

        requirements = Hooks(build_plugin_manager([algorithm])).algorithm_requirements()
        online = arm.online if arm.online is not None else spec_online
        if requirements.data == "online" or online:
            greedy_path: Path_ = ("arms", arm_name, "training", "sampling", "temperature")
            issues.append(
                issue_at(
                    file,
                    index,
                    fallbacks,
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
            level_path: Path_ = ("arms", arm_name, "training", "rollout_correction", "level")
            issues.append(
                issue_at(
                    file,
                    index,
                    fallbacks,
                    level_path,
                    f"{correction!r} needs an online policy-gradient algorithm (grpo, ppo, rloo, "
                    f"reinforce_pp); {arm.algorithm.name} applies no importance weights to a "
                    "sampled surrogate; set level off",
                )
            )
    if arm.training.parallel == "fsdp2" and arm.model.lora is not None:
        parallel_path: Path_ = ("arms", arm_name, "training", "parallel")
        issues.append(
            issue_at(
                file,
                index,
                fallbacks,
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
            where: Path_ = (
                "arms",
                arm_name,
                *(int(p) if p.isdigit() else p for p in slot.split(".")),
            )
            issues.append(issue_at(file, index, fallbacks, where, str(exc)))
    issues += _weights_without_a_taker(file, index, fallbacks, arm_name, arm, built)
    return built, issues


def _environment_issues(
    file: str,
    index: _LineIndex,
    fallbacks: dict[Path_, Path_],
    arm_name: str,
    arm: ArmSpec,
    built: dict[str, Any],
) -> list[ConfigIssue]:
    """An arm with an environment samples episodes: its algorithm must learn from sampled
    rollouts and its backend must sample from token ids (``generate_ids``)."""
    if arm.environment is None:
        return []
    out = []
    where: Path_ = ("arms", arm_name, "environment")
    algorithm, backend = built.get("algorithm"), built.get("backend")
    try:
        if algorithm is not None:
            data = build_plugin_manager([algorithm]).hook.algorithm_requirements().data
            if data != "online":
                out.append(
                    issue_at(
                        file,
                        index,
                        fallbacks,
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
                issue_at(
                    file,
                    index,
                    fallbacks,
                    where,
                    f"backend {arm.backend.name!r} does not implement generate_ids (sampling "
                    "a turn from token ids), which episodes need; use the hf or vllm backend",
                )
            )
    except Exception:  # a component's own problem: reported by the checks above
        return out
    return out


def _weights_without_a_taker(
    file: str,
    index: _LineIndex,
    fallbacks: dict[Path_, Path_],
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
        where: Path_ = ("arms", arm_name, "modifiers", i)
        out.append(
            issue_at(
                file,
                index,
                fallbacks,
                where,
                f"modifier {name!r} sets sample weights, but algorithm {arm.algorithm.name!r} "
                "does not declare that its loss multiplies them in (AlgorithmRequirements"
                "(weights=True)): the weights would apply to nothing; drop the modifier or make "
                "the algorithm honour batch.weights",
            )
        )
    return out
