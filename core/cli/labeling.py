"""`alignzoo serve-labeler` and `alignzoo labeler swap|promote`: labelers served and changed
in a live run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from alignzoo.cli.common import console, err_console

labeler_app = typer.Typer(
    help="Change a live run's labeler between steps (hot swap, shadow mode).",
    no_args_is_help=True,
)


def serve_labeler(
    config: Annotated[Path, typer.Argument(help="YAML: labeler, batching, token_env, limits.")],
    host: Annotated[
        str,
        typer.Option(
            help="Interface to bind. An address other than loopback needs token_env in the "
            "YAML, or --insecure."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8765,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Serve a non-loopback --host without a token (anyone who can reach it can "
            "use the labeler); prints a warning.",
        ),
    ] = False,
) -> None:
    """Serve a labeler plugin over HTTP (protocol v1: POST /v1/score, /health, /metrics)."""
    from alignzoo.labeling.service import serve

    def say(line: str) -> None:
        err_console.print(line, markup=False, highlight=False)

    serve(config, host=host, port=port, insecure=insecure, say=say)


@labeler_app.command("swap")
def labeler_swap(
    run_dir: Annotated[Path, typer.Argument(help="A run folder or an experiment folder.")],
    labeler: Annotated[Path, typer.Argument(help="YAML: {name: <labeler>, params: {...}}.")],
    shadow: Annotated[
        bool,
        typer.Option(help="Score alongside the current labeler, not trained on, until promoted."),
    ] = False,
    at_step: Annotated[
        Optional[int],  # noqa: UP045 - typer reads the annotation at run time
        typer.Option(min=1, help="Apply before this training step (default: the next one)."),
    ] = None,
) -> None:
    """Validate a new labeler and ask every unfinished run under RUN_DIR to use it."""
    from alignzoo.labeling.swap import request

    runs = request(run_dir, "shadow" if shadow else "swap", labeler, at_step=at_step)
    what = "shadow labeler" if shadow else "labeler swap"
    console.print(f"{what} requested for {len(runs)} run(s); applied before {_when(at_step)}")


def _when(at_step: int | None) -> str:
    return "their next step" if at_step is None else f"step {at_step}"


@labeler_app.command("promote")
def labeler_promote(
    run_dir: Annotated[Path, typer.Argument(help="A run folder or an experiment folder.")],
    at_step: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(min=1, help="Apply before this training step (default: the next one)."),
    ] = None,
) -> None:
    """Make the shadow labeler the labeler of every unfinished run under RUN_DIR."""
    from alignzoo.labeling.swap import request

    runs = request(run_dir, "promote", at_step=at_step)
    console.print(f"promotion requested for {len(runs)} run(s); applied before {_when(at_step)}")
