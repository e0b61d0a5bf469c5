"""Every YAML and Python block of README.md and docs/*.md is exercised: experiment YAML (whole
files and fragments) validates against the schema and each component's Params, other YAML
against the model of the file it shows, Python compiles, and a reward function shown for the
``python`` labeler scores through it as written.

A fragment is completed the way a user would paste it: top-level experiment keys (``arms``,
``data``, ``evaluation``, ...) into a small experiment, arm keys (``labeler``, ``labeling``,
...) into one of its arms. A block that is not experiment YAML says which file it shows with
``<!-- snippet: NAME -->`` on the line before it (NAME a key of ``OTHER_MODELS``), or why it is
not checked with ``<!-- snippet: not checked: REASON -->``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from alignzoo.config.overrides import deep_merge, resolve_arms
from alignzoo.config.schema import ArmSpec, ExperimentSpec
from alignzoo.config.yamlfile import safe_load
from alignzoo.labeling import LabelRequest
from alignzoo.registry import get_registry

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
MARK = re.compile(r"<!-- snippet: (.+?) -->\s*$")

BASE = {
    "name": "snippet",
    "seeds": [0],
    "budget": {"steps": 1},
    "arms": {"a": {"algorithm": "grpo", "labeler": "arithmetic"}},
}


def _service_config() -> type:
    from alignzoo.labeling.service import ServeConfig

    return ServeConfig


OTHER_MODELS = {"serve-labeler config": _service_config}
"""Marked YAML blocks that show another file than an experiment: the model that reads it."""


@dataclass
class Block:
    document: Path
    line: int
    language: str
    text: str
    mark: str | None

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in FENCE.finditer(text):
            indent, language, body = match.groups()
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            found.append(
                Block(
                    document,
                    line,
                    language,
                    textwrap.dedent(body) if indent else body,
                    mark.group(1) if mark else None,
                )
            )
    return found


ALL = blocks()
YAML = [b for b in ALL if b.language in ("yaml", "yml")]
PYTHON = [b for b in ALL if b.language in ("python", "py")]


def _duplicate_keys(node: yaml.Node) -> list[str]:
    """Keys written twice in one mapping (YAML keeps the last silently)."""
    found: list[str] = []
    if isinstance(node, yaml.MappingNode):
        keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
        found += sorted({k for k in keys if keys.count(k) > 1})
        for _, value in node.value:
            found += _duplicate_keys(value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found += _duplicate_keys(item)
    return found


def as_experiment(data: dict[str, Any]) -> dict[str, Any]:
    """A fragment completed into an experiment (a whole file is returned as it is)."""
    if "arms" in data and "name" in data:
        return data
    arm_keys = set(ArmSpec.model_fields)
    if set(data) <= arm_keys:
        return deep_merge(BASE, {"arms": {"a": data}})
    top_keys = set(ExperimentSpec.model_fields)
    unknown = set(data) - top_keys
    assert not unknown, f"keys {sorted(unknown)} are neither experiment nor arm fields"
    return deep_merge(BASE, data) if "arms" not in data else deep_merge(BASE | {"arms": {}}, data)


def check_components(spec: ExperimentSpec) -> None:
    """Each component named exists and its params validate (files it names are not opened)."""
    registry = get_registry()
    for arm in spec.arms.values():
        for kind, _, ref in arm.component_refs():
            cls = registry.get(kind, ref.name)
            cls.Params.model_validate(cls.params_for_arm(dict(ref.params), arm))


def test_the_documents_have_snippets_to_check():
    assert len(YAML) >= 6 and len(PYTHON) >= 8, (len(YAML), len(PYTHON))
    marks = {b.mark for b in ALL if b.mark}
    for mark in marks:
        assert mark in OTHER_MODELS or mark.startswith("not checked: "), mark


@pytest.mark.parametrize("block", YAML, ids=[b.where for b in YAML])
def test_yaml_snippet_validates(block: Block):
    if block.mark and block.mark.startswith("not checked: "):
        pytest.skip(block.mark)
    duplicates = _duplicate_keys(yaml.compose(block.text))
    assert not duplicates, f"{block.where}: key(s) written twice: {duplicates}"
    data = safe_load(block.text)
    assert isinstance(data, dict), f"{block.where}: not a mapping"
    if block.mark:
        OTHER_MODELS[block.mark]().model_validate(data)
        return
    spec = ExperimentSpec.model_validate(resolve_arms(as_experiment(data)))
    check_components(spec)


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_snippet_compiles(block: Block):
    compile(block.text, block.where, "exec")


def test_the_trl_reward_function_of_the_labeling_guide_scores_as_written(tmp_path, monkeypatch):
    from alignzoo.plugins.labelers.python_fn import PythonLabeler

    [block] = [b for b in PYTHON if "def reward_len(completions, **kwargs)" in b.text]
    (tmp_path / "rewards.py").write_text(block.text)
    monkeypatch.chdir(tmp_path)
    labeler = PythonLabeler(PythonLabeler.Params(function="rewards.py:reward_len"))
    requests = [LabelRequest("q", "x" * n, {"answer": "2"}, [1] * n, step=1) for n in (5, 20)]
    assert [s.value for s in labeler.score_batch(requests)] == [-15.0, 0.0]
