"""`alignzoo plugins`, `schema`, `doctor`, `check *` and `new plugin`: the installed components,
checked and scaffolded."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from alignzoo import __version__
from alignzoo.cli.common import console
from alignzoo.errors import UserError

check_app = typer.Typer(
    help="Check an installed component against the contract suite.", no_args_is_help=True
)


new_app = typer.Typer(
    help="Create a ready package: `alignzoo new plugin NAME`.", no_args_is_help=True
)


def _type_name(annotation: Any) -> str:
    """``int``, ``str | None``, ``'mean' | 'median'``: a field's type as a user reads it."""
    import typing

    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def _params_table(cls: type) -> Table:
    """A component's Params: each field with its type, default and description."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    table = Table(title=f"{cls.__name__} params", title_justify="left")
    for column in ("param", "type", "default", "description"):
        table.add_column(column, overflow="fold")
    model = getattr(cls, "Params", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        for field_name, info in model.model_fields.items():
            if info.default is PydanticUndefined and info.default_factory is None:
                default = "[bold]required[/bold]"
            elif info.default_factory is not None:
                default = repr(info.default_factory())  # type: ignore[call-arg]
            else:
                default = repr(info.default)
            table.add_row(field_name, _type_name(info.annotation), default, info.description or "")
    return table


def _show_component(kind: str | None, name: str) -> None:
    """One component in full: provider, target, docstring, and its Params."""
    import inspect

    from alignzoo.registry import get_registry

    registry = get_registry()
    found = [e for e in registry.load_all(kind) if e.name == name]
    if not found:
        where = f"kind {kind}" if kind else "any kind"
        raise UserError(f"no component named {name!r} of {where}; see `alignzoo plugins`")
    if len(found) > 1:  # one name in several kinds (an algorithm and a labeler): show each
        kinds = ", ".join(e.kind for e in found)
        console.print(f"{name!r} names {len(found)} components ({kinds}); --kind shows one")
    broken = [e for e in found if e.component is None]
    for entry in found:
        if entry.component is None:
            console.print(
                f"[bold]{entry.kind} {name}[/bold]  [red]{escape(str(entry.error))}[/red]"
            )
            continue
        cls = entry.component
        console.print(f"[bold]{entry.kind} {name}[/bold]  {entry.distribution} {entry.version}")
        console.print(f"entry point: {entry.kind}.{name} = {entry.target}", markup=False)
        console.print(inspect.cleandoc(cls.__doc__ or ""), markup=False, highlight=False)
        console.print(_params_table(cls), soft_wrap=False)
    if broken:
        raise UserError(f"{broken[0].kind} {name}: {broken[0].error}")


def plugins(
    name: Annotated[
        Optional[str],  # noqa: UP045 - typer reads the annotation at run time
        typer.Argument(help="Show this component in full: its docs and Params."),
    ] = None,
    kind: Annotated[
        str | None, typer.Option(help="Only this kind (algorithm, labeler, ...).")
    ] = None,
    long: Annotated[
        bool, typer.Option("--long", help="Whole summaries and entry-point targets.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List every installed component (one line each: kind, name, provider, what it does), or
    show one with its Params."""
    from alignzoo.plugin import KINDS
    from alignzoo.registry import get_registry

    if kind is not None and kind not in KINDS:
        raise UserError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if name is not None and not as_json:
        _show_component(kind, name)
        return
    registry = get_registry()
    entries = registry.load_all(kind)
    rows = []
    for e in entries:
        if name is not None and e.name != name:
            continue
        status = "ok"
        summary = e.component.summary() if e.component is not None else ""
        if e.duplicates:
            status = "duplicate: also " + "; ".join(d.describe() for d in e.duplicates)
        elif e.error:
            status = f"error: {e.error}"
        rows.append(
            {
                "kind": e.kind,
                "name": e.name,
                "provider": e.distribution,
                "version": e.version,
                "target": e.target,
                "summary": summary,
                "status": status,
            }
        )
    for e in registry.malformed:
        rows.append(
            {
                "kind": "?",
                "name": e.name,
                "provider": e.distribution,
                "version": e.version,
                "target": e.target,
                "summary": "",
                "status": f"error: {e.error}",
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="alignzoo components", box=None if not long else box_style())
    widths = [max([len(c)] + [len(str(r[c])) for r in rows]) for c in ("kind", "name", "provider")]
    for column, width in zip(("kind", "name", "provider"), widths, strict=True):
        table.add_column(column, no_wrap=True, min_width=width)
    if long:
        table.add_column("target", overflow="fold")
        table.add_column("summary", ratio=1, overflow="fold")
    else:  # the summary gets what the terminal has left: kind, name and provider always show
        left = console.width - sum(widths) - 2 * (len(widths) + 1)
        table.add_column("summary", overflow="ellipsis", no_wrap=True, max_width=max(left, 8))
    for row in rows:
        summary = row["summary"] if row["status"] == "ok" else f"[red]{row['status']}[/red]"
        provider = f"{row['provider']} {row['version']}" if long else str(row["provider"])
        cells = [row["kind"], row["name"], provider]
        if long:
            cells.append(row["target"])
        table.add_row(*cells, summary)
    console.print(table, soft_wrap=False)  # fit the terminal: one line per component
    if not long:
        console.print("[dim]alignzoo plugins NAME: one component's Params; --long: in full[/dim]")


def box_style() -> Any:
    """The table border of ``alignzoo plugins --long``."""
    from rich import box

    return box.SIMPLE


def schema(
    out: Annotated[Path | None, typer.Option(help="Write to this file instead of stdout.")] = None,
) -> None:
    """Write the JSON Schema of experiment files (for editor autocompletion and checking)."""
    from alignzoo.config.jsonschema import experiment_json_schema

    text = json.dumps(experiment_json_schema(), indent=2)
    if out is None:
        print(text)
    else:
        try:
            out.write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
        console.print(f"wrote {out}")


def doctor() -> None:
    """Versions of torch, transformers and optional extras; devices found; which plugins load."""
    from importlib.metadata import PackageNotFoundError, version

    from alignzoo.registry import get_registry

    table = Table(title="alignzoo doctor")
    table.add_column("item")
    table.add_column("status")
    table.add_row("python", sys.version.split()[0])
    table.add_row("alignzoo", __version__)
    for dist in (
        "torch",
        "transformers",
        "tokenizers",
        "datasets",
        "peft",
        "pluggy",
        "pydantic",
        "vllm",
        "flash-attn",
        "wandb",
        "tensorboard",
        "ray",
        "trl",
        "reasoning-gym",
        "textarena",
        "openenv-core",
        "verifiers",
    ):
        try:
            table.add_row(dist, version(dist))
        except PackageNotFoundError:
            table.add_row(dist, "[dim]not installed[/dim]")
    import torch

    devices = ["cpu"] + [
        f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())
    ]
    table.add_row("devices", ", ".join(devices))
    entries = get_registry().load_all()
    broken = [e for e in entries if e.error or e.duplicates]
    table.add_row("plugins", f"{len(entries) - len(broken)} load, {len(broken)} broken")
    for e in broken:
        table.add_row(f"  {e.kind}.{e.name}", f"[red]{escape(str(e.error or 'duplicate'))}[/red]")
    console.print(table)


def _parse_option(text: str | None, option: str) -> dict | None:
    """A mapping given inline (JSON or YAML) or as the path of a YAML file."""
    if text is None:
        return None
    import yaml

    source = Path(text)
    try:
        raw = source.read_text(encoding="utf-8") if source.is_file() else text
        value = yaml.safe_load(raw)
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{option}: not JSON, YAML or a readable YAML file: {exc}") from None
    if not isinstance(value, dict):
        raise UserError(f"{option}: expected a mapping such as '{{\"key\": 1}}', got {text!r}")
    return value


def _report_checks(results: list) -> None:
    for r in results:
        mark = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
        console.print(f"{mark} {r.name}")
        if not r.passed:
            console.print(f"      {r.detail}", markup=False)
    if any(not r.passed for r in results):
        raise typer.Exit(1)


ParamsOption = Annotated[
    Optional[str],  # noqa: UP045 - typer reads the annotation at run time
    typer.Option("--params", help="The component's params: inline JSON/YAML or a YAML file."),
]
ExamplesOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option(help="Hypothesis examples per property (default: the suite's own)."),
]


@check_app.command("algorithm")
def check_algorithm(
    name: Annotated[str, typer.Argument(help="Registered algorithm name.")],
    max_examples: Annotated[int, typer.Option(help="Hypothesis examples per property.")] = 50,
    params: ParamsOption = None,
) -> None:
    """Run the algorithm contract suite (padding, permutation, finiteness, shapes) on NAME."""
    from alignzoo.testing.components import check_component

    _report_checks(
        check_component("algorithm", name, _parse_option(params, "--params"), max_examples)
    )


@check_app.command("labeler")
def check_labeler(
    name: Annotated[str, typer.Argument(help="Registered labeler name.")],
    params: ParamsOption = None,
    extra: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="The data columns of a request (inline JSON/YAML or a YAML file)."),
    ] = None,
    max_examples: ExamplesOption = None,
) -> None:
    """One Score per request for any model output, batch = items, determinism, on NAME."""
    from alignzoo.testing.components import check_labeler as run_suite

    results = run_suite(
        name,
        _parse_option(params, "--params"),
        max_examples=max_examples or 50,
        extra=_parse_option(extra, "--extra"),
    )
    _report_checks(results)


@check_app.command("backend")
def check_backend(
    name: Annotated[str, typer.Argument(help="Registered backend name.")],
    params: ParamsOption = None,
    max_examples: ExamplesOption = None,
) -> None:
    """Generate layout, greedy determinism, sampling log-probs and weight sync, on NAME."""
    from alignzoo.testing.components import check_component

    _report_checks(
        check_component("backend", name, _parse_option(params, "--params"), max_examples)
    )


@check_app.command("device_mapper")
@check_app.command("device-mapper", hidden=True)
def check_device_mapper(
    name: Annotated[str, typer.Argument(help="Registered device mapper name.")],
    params: ParamsOption = None,
    max_examples: ExamplesOption = None,
) -> None:
    """Every role placed on an available device (or a clear refusal), stably, by NAME."""
    from alignzoo.testing.components import check_component

    parsed = _parse_option(params, "--params")
    _report_checks(check_component("device_mapper", name, parsed, max_examples))


@check_app.command("modifier")
def check_modifier(
    name: Annotated[str, typer.Argument(help="Registered modifier name.")],
    params: ParamsOption = None,
    max_examples: ExamplesOption = None,
) -> None:
    """The algorithm contract around every built-in algorithm, and transform_batch's layout."""
    from alignzoo.testing.components import check_component

    _report_checks(
        check_component("modifier", name, _parse_option(params, "--params"), max_examples)
    )


@check_app.command("environment")
def check_environment(
    name: Annotated[str, typer.Argument(help="Registered environment name.")],
    params: ParamsOption = None,
    max_examples: ExamplesOption = None,
) -> None:
    """Episodes driven as the engine drives them: reset, any turn (malformed calls too),
    episodes independent of each other, close."""
    from alignzoo.testing.components import check_component

    _report_checks(
        check_component("environment", name, _parse_option(params, "--params"), max_examples)
    )


@new_app.command("plugin")
def new_plugin(
    name: Annotated[str, typer.Argument(help="Package and component name, e.g. my_rl.")],
    kind: Annotated[
        Optional[list[str]],  # noqa: UP045 - typer reads the annotation at run time
        typer.Option(help="A kind to include (repeat it); default: all five kinds."),
    ] = None,
    out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Folder to write (default: ./NAME); must not exist or be empty."),
    ] = None,
) -> None:
    """Write a plugin package: pyproject with entry points, a module per component, contract
    tests, a README. `pip install -e` it and its tests pass as written."""
    from alignzoo.scaffold import new_plugin as write

    folder = out if out is not None else Path(name)
    written = write(name, folder, kind)
    console.print(f"wrote {len(written)} files to {folder}:")
    for path in written:
        console.print(f"  {path.relative_to(folder)}", markup=False)
    console.print(f"next: pip install -e {folder} && pytest {folder}/tests", markup=False)
