"""What every command module shares: the consoles, the --debug state, list options, --set."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from alignzoo.errors import UserError

console = Console(soft_wrap=True)  # long paths and messages stay on one line in logs
err_console = Console(stderr=True, soft_wrap=True)
state = {"debug": False, "restart_for_huge_pages": False}
"""``--debug``; and whether this process is the ``alignzoo`` program itself (the console script
or ``python -m alignzoo``, not ``main([...])`` called from Python), which a training command
may restart (:func:`alignzoo.engine.malloc.restart_with_huge_pages`)."""


def parse_list(value: str | None, cast: type = str, option: str = "") -> list | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        return [cast(v) for v in items]
    except ValueError:
        raise UserError(
            f"{option} expects a comma-separated list of {cast.__name__}s, got {value!r}"
        ) from None


SetOption = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer reads the annotation at run time
    typer.Option(
        "--set",
        help="Override a field, e.g. --set training.lr=1e-5 or "
        "--set arms.grpo.algorithm.params.beta=0 (repeatable; validated like the file).",
    ),
]


def restart_for_huge_pages() -> None:
    """Where this process is the ``alignzoo`` program (``state``), restart it once with glibc's
    huge-page tunable if that helps here (:func:`alignzoo.engine.malloc.restart_with_huge_pages`);
    ``alignzoo run`` calls it once the experiment is read, before anything is written."""
    if state["restart_for_huge_pages"]:
        from alignzoo.engine.malloc import restart_with_huge_pages

        restart_with_huge_pages()
