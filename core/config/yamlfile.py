"""Reading YAML: the experiment file with a line for every field, within limits, and small
YAML files validated by a model.

:func:`read_yaml` refuses a file above 1 MiB, an alias bomb or deep nesting before anything
walks the document, then a duplicate key, ``.inf`` or ``.nan``, and indexes the line of every
field, which :mod:`alignzoo.config.locate` uses to place an error. Every YAML file alignzoo
reads goes through :func:`safe_load`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from alignzoo.errors import ConfigError, ConfigIssue, UserError

FieldPath = tuple[str | int, ...]
"""A field of the document: mapping keys and list indexes from the top (``("arms", "a", "lr")``)."""


class LineIndex:
    """Maps a dotted path in a YAML document to the line where it is written."""

    def __init__(self) -> None:
        self.lines: dict[FieldPath, int] = {}
        """Every field the document writes (keys and list items) -> its 1-based line."""

    def line_of(self, path: FieldPath) -> int | None:
        """The line of ``path``, or of its deepest written prefix: a missing field is reported
        at its parent (None when nothing of it is written)."""
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


def _index_node(node: yaml.Node, path: FieldPath, index: LineIndex, issues: list[str]) -> None:
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


def non_finite_paths(data: Any, path: FieldPath = ()) -> list[FieldPath]:
    """Dotted paths of every float in ``data`` that is inf or nan."""
    if isinstance(data, float) and not math.isfinite(data):
        return [path]
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in non_finite_paths(v, (*path, k))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in non_finite_paths(v, (*path, i))]
    return []


def read_yaml(path: str | Path) -> tuple[dict[str, Any], LineIndex]:
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
    index = LineIndex()
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
    bad = non_finite_paths(data)
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
