"""reasoning-gym's procedural tasks: prompts generated from a task's config and seed, scored by
the task's own scorer (the ``reasoning-gym`` extra: ``pip install 'alignzoo[reasoning-gym]'``).

``data.train: {reasoning_gym: {task: basic_arithmetic, size: 2000, seed: 1, config: {...}}}``
(or ``tasks: [{name, weight, config}, ...]`` for a weighted composite) becomes rows with
``prompt`` (the entry through ``template``), ``question``, ``answer`` (the reference answer),
``reasoning_gym_task`` (the entry's own task, also inside a composite), and
``reasoning_gym_source`` / ``reasoning_gym_index`` (the spec and the entry's index): the
``reasoning_gym`` labeler rebuilds the dataset from them and scores a response with the
dataset's own ``score_answer`` on the generated entry, with the task's config, as
reasoning-gym does (an entry is never rebuilt from JSON, which would turn tuples into lists).

When ``data.eval`` is generated too, the training rows drop every prompt of the eval split
(different seeds can draw the same prompt, and a small task has few), so the evaluation is
held out.

Task names and configurations are checked when the data is opened, which ``alignzoo validate``
does before any model loads: an unknown task gets the closest names, a config field the task
does not have gets its error, both naming the field.
"""

from __future__ import annotations

import difflib
from functools import cache
from typing import TYPE_CHECKING, Any

from alignzoo.errors import UserError
from alignzoo.integrations import require

if TYPE_CHECKING:
    from alignzoo.config.schema import ReasoningGymSpec

TASK_COLUMN = "reasoning_gym_task"
SOURCE_COLUMN = "reasoning_gym_source"
INDEX_COLUMN = "reasoning_gym_index"


def _library() -> Any:
    return require("reasoning_gym", "reasoning-gym", "reasoning-gym")


def task_names() -> list[str]:
    """Every task reasoning-gym registers, sorted."""
    _library()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _check_task(name: str, field: str) -> None:
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(names)} tasks)"
        raise UserError(f"{field}: reasoning-gym has no task {name!r}{hint}")


def _dataset(spec: ReasoningGymSpec, where: str) -> Any:
    """The reasoning-gym dataset ``spec`` names (checked: task names, the task's config)."""
    rg = _library()
    try:
        if spec.task is not None:
            _check_task(spec.task, f"{where}.task")
            return rg.create_dataset(spec.task, size=spec.size, seed=spec.seed, **spec.config)
        from reasoning_gym.composite import DatasetSpec

        assert spec.tasks is not None
        for i, task in enumerate(spec.tasks):
            _check_task(task.name, f"{where}.tasks.{i}.name")
        parts = [DatasetSpec(t.name, t.weight, dict(t.config)) for t in spec.tasks]
        return rg.create_dataset("composite", size=spec.size, seed=spec.seed, datasets=parts)
    except UserError:
        raise
    except Exception as exc:  # the task's Config refuses a field or a value
        raise UserError(f"{where}: reasoning-gym refused it: {type(exc).__name__}: {exc}") from None


def generate(spec: ReasoningGymSpec, field: str) -> list[dict[str, Any]]:
    """The rows of ``spec`` (see the module docstring); ``field`` (``data.train``) starts every
    error message."""
    where = f"{field}.reasoning_gym"
    dataset = _dataset(spec, where)
    source = spec.model_dump_json()
    rows = []
    for index, entry in enumerate(dataset):
        try:
            prompt = spec.template.format(question=entry["question"], metadata=entry["metadata"])
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise UserError(
                f"{where}.template: {spec.template!r} cannot be filled from an entry "
                f"({type(exc).__name__}: {exc}); fields: {{question}}, {{metadata[KEY]}} with "
                f"KEY one of {', '.join(sorted(entry['metadata']))}"
            ) from None
        rows.append(
            {
                "prompt": prompt,
                "question": str(entry["question"]),
                "answer": str(entry["answer"]),
                TASK_COLUMN: str(entry["metadata"].get("source_dataset", spec.task)),
                SOURCE_COLUMN: source,
                INDEX_COLUMN: index,
            }
        )
    return rows


@cache
def _scored_dataset(source: str) -> Any:
    from alignzoo.config.schema import ReasoningGymSpec

    return _dataset(ReasoningGymSpec.model_validate_json(source), "reasoning_gym labeler")


def score(source: str, index: int, answer: str | None) -> float:
    """``answer`` scored by the dataset of ``source`` (a row's spec, as generated) on its entry
    ``index``: the dataset is rebuilt from the spec and seed (once per process), so the entry
    is the generated one, with its own types, and the scorer has the task's own config (a
    composite scores each entry with its own task's)."""
    dataset = _scored_dataset(source)
    return float(dataset.score_answer(answer, dataset[index]))


def extract_answer_tag(text: str, tag: str) -> str | None:
    """reasoning-gym's own reading of ``<tag>...</tag>`` (the last one), or None."""
    _library()
    from reasoning_gym.utils import extract_answer

    found: str | None = extract_answer(text, tag)
    return found
