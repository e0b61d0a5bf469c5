"""reasoning-gym's procedural tasks: prompts generated from a task's config and seed, scored by
the task's own scorer (the ``reasoning-gym`` extra: ``pip install 'alignzoo[reasoning-gym]'``).

``data.train: {reasoning_gym: {task: basic_arithmetic, size: 2000, seed: 1, config: {...}}}``
(or ``tasks: [{name, weight, config}, ...]`` for a weighted composite) becomes rows with
``prompt`` (the entry through ``template``), ``answer`` (the reference answer),
``reasoning_gym_task`` (the entry's own task, also inside a composite) and
``reasoning_gym_entry`` (the whole entry as JSON, what the task's scorer reads), so the
``reasoning_gym`` labeler can score a response exactly as reasoning-gym does.

When ``data.eval`` is generated too, the training rows drop every prompt of the eval split
(different seeds can draw the same prompt, and a small task has few), so the evaluation is
held out.

Task names and configurations are checked when the data is opened, which ``alignzoo validate``
does before any model loads: an unknown task gets the closest names, a config field the task
does not have gets its error, both naming the field.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from typing import TYPE_CHECKING, Any

from alignzoo.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Callable

    from alignzoo.config.schema import ReasoningGymSpec

EXTRA = "pip install 'alignzoo[reasoning-gym]'"
TASK_COLUMN = "reasoning_gym_task"
ENTRY_COLUMN = "reasoning_gym_entry"


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(f"reasoning-gym is not installed; {EXTRA}") from None
    return reasoning_gym


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


def generate(spec: ReasoningGymSpec, field: str) -> list[dict[str, Any]]:
    """The rows of ``spec`` (see the module docstring); ``field`` (``data.train``) starts every
    error message."""
    rg = _library()
    where = f"{field}.reasoning_gym"
    try:
        if spec.task is not None:
            _check_task(spec.task, f"{where}.task")
            dataset = rg.create_dataset(spec.task, size=spec.size, seed=spec.seed, **spec.config)
        else:
            from reasoning_gym.composite import DatasetSpec

            assert spec.tasks is not None
            for i, task in enumerate(spec.tasks):
                _check_task(task.name, f"{where}.tasks.{i}.name")
            parts = [DatasetSpec(t.name, t.weight, dict(t.config)) for t in spec.tasks]
            dataset = rg.create_dataset("composite", size=spec.size, seed=spec.seed, datasets=parts)
    except UserError:
        raise
    except Exception as exc:  # the task's Config refuses a field or a value
        raise UserError(f"{where}: reasoning-gym refused it: {type(exc).__name__}: {exc}") from None
    rows = []
    for entry in dataset:
        try:
            prompt = spec.template.format(question=entry["question"], metadata=entry["metadata"])
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise UserError(
                f"{where}.template: {spec.template!r} cannot be filled from an entry "
                f"({type(exc).__name__}: {exc}); fields: {{question}}, {{metadata[KEY]}} with "
                f"KEY one of {', '.join(sorted(entry['metadata']))}"
            ) from None
        metadata = entry["metadata"]
        rows.append(
            {
                "prompt": prompt,
                "answer": str(entry["answer"]),
                TASK_COLUMN: str(metadata.get("source_dataset", spec.task)),
                ENTRY_COLUMN: json.dumps(entry, default=str, sort_keys=True),
            }
        )
    return rows


@cache
def scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The task's own ``score_answer(answer, entry)``."""
    rg = _library()
    _check_task(task, "reasoning_gym labeler")
    fn: Callable[[str | None, dict[str, Any]], float] = rg.get_score_answer_fn(task)
    return fn


def extract_answer_tag(text: str, tag: str) -> str | None:
    """reasoning-gym's own reading of ``<tag>...</tag>`` (the last one), or None."""
    _library()
    from reasoning_gym.utils import extract_answer

    found: str | None = extract_answer(text, tag)
    return found
