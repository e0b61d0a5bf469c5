"""The ``alignzoo`` command line: run, validate, init, plugins, schema, report, relabel, doctor,
check.

Exit codes: 0 success; 2 a user error (bad config, unknown plugin, missing file), printed as a
short message without traceback unless ``--debug``; 1 a failure inside a run.

The commands live in modules by subsystem (experiments, labeling, plugins, annotate, train_rm);
each parses its options, calls its subsystem and prints. This module assembles them into
``app``, in the order ``alignzoo --help`` lists them, and ``main`` maps errors to exit codes.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from alignzoo import __version__
from alignzoo.cli import annotate, experiments, labeling, plugins, train_rm
from alignzoo.cli.common import console, err_console, state
from alignzoo.errors import AlignzooError, ConfigError, UserError

__all__ = ["app", "main"]

app = typer.Typer(
    name="alignzoo",
    help="LLM post-training algorithms as plugins, compared in fair A/B experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(plugins.check_app, name="check")
app.add_typer(labeling.labeler_app, name="labeler")
app.add_typer(plugins.new_app, name="new")
app.add_typer(annotate.annotate_app, name="annotate")


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"alignzoo {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        Optional[bool],  # noqa: UP045 - typer needs Optional here
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ] = None,
) -> None:
    state["debug"] = debug


app.command()(experiments.validate)
app.command()(experiments.run)
app.command()(experiments.relabel)
app.command("serve-labeler")(labeling.serve_labeler)
app.command()(experiments.report)
app.command()(plugins.plugins)
app.command()(plugins.schema)
app.command()(plugins.doctor)
app.command()(experiments.export)
app.command()(experiments.init)
app.command("train-rm")(train_rm.train_rm)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit code.

    Without ``argv`` (the console script, ``python -m alignzoo``) this process is the
    ``alignzoo`` program, and ``alignzoo run`` restarts it once with glibc's huge-page tunable
    where that helps, for an experiment whose runs keep their freed CPU memory
    (:func:`alignzoo.engine.malloc.restart_with_huge_pages`; ``ALIGNZOO_HUGE_PAGES=0`` keeps it
    from doing so); with ``argv`` it never restarts."""
    state["restart_for_huge_pages"] = argv is None
    try:
        return _run_app(argv)
    finally:
        state["restart_for_huge_pages"] = False


def _run_app(argv: list[str] | None) -> int:
    try:
        try:
            # Standalone mode: typer/click report usage errors themselves (exit 2) and raise
            # SystemExit.
            app(args=argv, standalone_mode=True)
        finally:
            from alignzoo import distributed

            distributed.shutdown()  # under torchrun: every rank leaves the group, on any path
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except AlignzooError as exc:
        if state["debug"]:
            raise
        _print_error(exc)
        return exc.exit_code
    except Exception as exc:  # a bug: one line without --debug, the traceback with it
        if state["debug"]:
            raise
        err_console.print("[red]internal error:[/red] ", end="")
        err_console.print(
            f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback, and please "
            "report it)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return 1
    return 0


def _print_error(exc: AlignzooError) -> None:
    if isinstance(exc, ConfigError):
        err_console.print(f"[red]error:[/red] {len(exc.issues)} problem(s) in the experiment:")
        for issue in exc.issues:
            err_console.print(f"  {issue}", markup=False, highlight=False, soft_wrap=True)
        return
    label = "error" if isinstance(exc, UserError) else "run failed"
    err_console.print(f"[red]{label}:[/red] ", end="")
    err_console.print(str(exc), markup=False, highlight=False, soft_wrap=True)
