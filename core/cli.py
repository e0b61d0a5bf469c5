"""The ``alignzoo`` command line: run, validate, init, plugins, schema, report, relabel, doctor,
check.

Exit codes: 0 success; 2 a user error (bad config, unknown plugin, missing file), printed as a
short message without traceback unless ``--debug``; 1 a failure inside a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from alignzoo import __version__
from alignzoo.errors import AlignzooError, ConfigError, UserError

app = typer.Typer(
    name="alignzoo",
    help="LLM post-training algorithms as plugins, compared in fair A/B experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
check_app = typer.Typer(
    help="Check an installed component against the contract suite.", no_args_is_help=True
)
app.add_typer(check_app, name="check")
labeler_app = typer.Typer(
    help="Change a live run's labeler between steps (hot swap, shadow mode).",
    no_args_is_help=True,
)
app.add_typer(labeler_app, name="labeler")
new_app = typer.Typer(
    help="Create a ready package: `alignzoo new plugin NAME`.", no_args_is_help=True
)
app.add_typer(new_app, name="new")


class _ServeByDefault(TyperGroup):
    """`alignzoo annotate QUEUE_DIR ...` means `alignzoo annotate serve QUEUE_DIR ...`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["serve", *args]
        return super().parse_args(ctx, args)


annotate_app = typer.Typer(
    cls=_ServeByDefault,
    help="Human feedback: `alignzoo annotate QUEUE_DIR` serves the annotation app; "
    "add-annotator issues sign-in tokens (revoke, reissue), instructions sets the question, "
    "status shows progress and agreement, export writes the agreed judgements as a data set.",
    no_args_is_help=True,
)
app.add_typer(annotate_app, name="annotate")


class Executors(str, Enum):
    """Where `alignzoo run` trains the arm x seed runs."""

    local = "local"
    ray = "ray"


console = Console(soft_wrap=True)  # long paths and messages stay on one line in logs
err_console = Console(stderr=True, soft_wrap=True)
_state = {"debug": False}


def _parse_list(value: str | None, cast: type = str, option: str = "") -> list | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        return [cast(v) for v in items]
    except ValueError:
        raise UserError(
            f"{option} expects a comma-separated list of {cast.__name__}s, got {value!r}"
        ) from None


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
    _state["debug"] = debug


SetOption = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer reads the annotation at run time
    typer.Option(
        "--set",
        help="Override a field, e.g. --set training.lr=1e-5 or "
        "--set arms.grpo.algorithm.params.beta=0 (repeatable; validated like the file).",
    ),
]


@app.command()
def validate(
    experiment: Annotated[
        Path,
        typer.Argument(
            help="Experiment YAML file, or a bundled experiment's name (quickstart, smoke, ...)."
        ),
    ],
    overrides: SetOption = None,
) -> None:
    """Check an experiment file, every component's params, every data source (columns,
    types, splits, chat templates) and each arm's precision on the device its actor would be
    placed on here, without loading any model."""
    from alignzoo.config.bundled import experiment_file
    from alignzoo.config.loader import load_experiment
    from alignzoo.experiment.runner import check_before_writing

    with experiment_file(experiment) as path:
        loaded = load_experiment(path, overrides=overrides or ())
        check_before_writing(loaded)  # what `alignzoo run` checks before writing
    spec = loaded.spec
    console.print(
        f"[green]ok[/green] {experiment}: experiment {spec.name!r}, arms "
        f"{', '.join(spec.arms)} (baseline {spec.baseline_arm}), seeds {spec.seeds}",
        soft_wrap=True,
    )


@app.command()
def run(
    experiment: Annotated[
        Path,
        typer.Argument(
            help="Experiment YAML file, or a bundled experiment's name (quickstart, smoke, ...)."
        ),
    ],
    arms: Annotated[
        str | None, typer.Option(help="Comma-separated arms to run (default all).")
    ] = None,
    seeds: Annotated[
        str | None, typer.Option(help="Comma-separated seeds (default: the file's).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output folder (default: output_dir/name).")
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="Skip finished runs and continue unfinished ones.")
    ] = False,
    jobs: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Arm x seed runs in parallel worker processes (each gets cpu_count / jobs "
            "threads; default 1). With --executor ray, the CPUs each task asks for are "
            "cpu_count / jobs (default: one CPU per run, so runs go in parallel).",
        ),
    ] = None,
    executor: Annotated[
        Executors,
        typer.Option(help="Where runs train: local processes, or Ray tasks (the ray extra)."),
    ] = Executors.local,
    address: Annotated[
        str | None,
        typer.Option(
            help="Ray cluster address for --executor ray ('auto': the one on this machine; "
            "default: start a local Ray for this experiment)."
        ),
    ] = None,
    retries: Annotated[
        int,
        typer.Option(
            min=0, help="--executor ray: reruns of a task whose worker died (it resumes)."
        ),
    ] = 1,
    overrides: SetOption = None,
) -> None:
    """Train every arm x seed of an experiment and write the comparison report.

    EXPERIMENT is a YAML file or the name of a bundled one: `alignzoo run smoke` trains the
    bundled smoke test from any folder (runs/smoke), `alignzoo run quickstart` the default
    A/B experiment; `alignzoo init DIR` writes them out to edit."""
    from alignzoo.config.bundled import experiment_file

    with experiment_file(experiment) as path:
        _run(path, arms, seeds, out, resume, jobs, executor, address, retries, overrides)


def _run(
    experiment: Path,
    arms: str | None,
    seeds: str | None,
    out: Path | None,
    resume: bool,
    jobs: int | None,
    executor: Executors,
    address: str | None,
    retries: int,
    overrides: list[str] | None,
) -> None:
    from alignzoo import distributed
    from alignzoo.config.loader import load_experiment
    from alignzoo.experiment.executors import LocalExecutor, RayExecutor, import_ray
    from alignzoo.experiment.runner import run_experiment

    distributed.init_from_env()  # under torchrun: join the process group (data parallel)
    if executor is Executors.local and address is not None:
        raise UserError("--address is for --executor ray; add --executor ray or drop --address")
    if executor is Executors.ray:
        import_ray()  # before anything is written: say how to install it

    loaded = load_experiment(
        experiment, arms=_parse_list(arms, str, "--arms"), overrides=overrides or ()
    )
    seed_list = _parse_list(seeds, int, "--seeds")
    if seed_list is not None:
        if not seed_list:
            raise UserError("--seeds is empty")
        repeated = sorted({s for s in seed_list if seed_list.count(s) > 1})
        if repeated:  # model_copy skips the spec's validators: keep its rule (distinct seeds)
            raise UserError(
                f"--seeds repeats {', '.join(map(str, repeated))}; seeds must be distinct"
            )
        from alignzoo.config.schema import MAX_SEED

        outside = [s for s in seed_list if not 0 <= s <= MAX_SEED]
        if outside:
            raise UserError(
                f"--seeds {', '.join(map(str, outside))}: outside 0 .. {MAX_SEED} (what numpy "
                "and torch both accept)"
            )
        loaded.spec = loaded.spec.model_copy(update={"seeds": seed_list})
    jobs = run_jobs(executor, jobs)
    chosen = (
        RayExecutor(address=address, retries=retries, console=console)
        if executor is Executors.ray
        else LocalExecutor(jobs, console)
    )
    result = run_experiment(
        loaded, out_dir=out, resume=resume, jobs=jobs, console=console, executor=chosen
    )
    if result.failed:
        raise typer.Exit(1)


@app.command()
def relabel(
    run_dir: Annotated[
        Path, typer.Argument(help="A run folder (arm/seed-n) or an experiment folder.")
    ],
    labeler: Annotated[Path, typer.Argument(help="YAML: {name: <labeler>, params: {...}}.")],
    tolerance: Annotated[
        float, typer.Option(help="Values further apart than this disagree.")
    ] = 1e-6,
) -> None:
    """Score a run's stored rollouts with another labeler and report the agreement."""
    from alignzoo.experiment.relabel import describe
    from alignzoo.experiment.relabel import relabel as run_relabel

    result = run_relabel(run_dir, labeler, tolerance)
    for line in describe(result):
        console.print(line, markup=False, highlight=False)
    console.print(f"wrote {run_dir / 'relabel.json'}")


@app.command("serve-labeler")
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


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="An experiment's output folder (runs/<name>).")],
    metric: Annotated[
        str | None,
        typer.Option(
            help="Compare on this metric instead of the experiment's: a name as in "
            "evaluation.metric (exact_match, score, pass@4, response_length), a key such as "
            "eval/score, or any metric the runs recorded in eval.jsonl. Written to "
            "report-<metric>.md / .html and plots-<metric>/; report.md is left as it is."
        ),
    ] = None,
    higher_is_better: Annotated[
        bool | None,
        typer.Option(
            "--higher-is-better/--lower-is-better",
            help="Direction of --metric (default: the experiment's setting for its own "
            "metric, else guessed from the name: lower for length, loss, error, time, memory).",
        ),
    ] = None,
    results: Annotated[
        Path | None,
        typer.Option(
            help="Also write the report's tables, every run's evaluations and the provenance "
            "(commit, lock, CPU and its kernels, threads) as one JSON file here: what "
            "docs/results/ holds for the figures the documentation quotes."
        ),
    ] = None,
) -> None:
    """(Re)write report.md and report.html for a finished or partial experiment, or with
    --metric a report comparing the arms on another recorded metric (no training)."""
    if not run_dir.is_dir():
        raise UserError(f"run folder not found: {run_dir}")
    if results is not None and results.suffix != ".json":
        raise UserError(f"--results {results}: expected a file name ending in .json")
    from alignzoo.report.sections import write_report

    paths = write_report(run_dir, metric, higher_is_better, results)
    for path in paths:
        console.print(f"wrote {path}")


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


@app.command()
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


@app.command()
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


@app.command()
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


def run_jobs(executor: Executors, jobs: int | None) -> int:
    """``--jobs`` as the runner reads it: given, as given; else 1 locally (one run at a time)
    and, on Ray, this machine's CPU count, so each task asks for one CPU and the cluster runs
    as many at once as it has CPUs (an arm's placement still asks for its GPUs)."""
    if jobs is not None:
        return jobs
    return (os.cpu_count() or 1) if executor is Executors.ray else 1


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


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run folder: RUN_DIR/<arm>/seed-<n>.")],
    out: Annotated[Path, typer.Option(help="Folder to write (must not exist or be empty).")],
    step: Annotated[
        str, typer.Option(help="last, best (by the evaluation metric) or a checkpoint's step.")
    ] = "last",
    merge: Annotated[
        bool, typer.Option(help="LoRA arms: merge the adapter into the base weights.")
    ] = False,
) -> None:
    """Write a run's policy as a folder from_pretrained loads, with a model card."""
    from alignzoo.experiment.export import export as write

    chosen = write(run_dir, out, step=step, merge=merge)
    console.print(
        f"exported step {chosen.step} ({chosen.why}) from {chosen.folder}\n"
        f"wrote {out} (AutoModelForCausalLM.from_pretrained loads it)",
        markup=False,
    )


@app.command()
def init(
    folder: Annotated[
        Path, typer.Argument(help="Folder to write DIR/experiments/ into (created if missing).")
    ],
    force: Annotated[bool, typer.Option(help="Overwrite files that already exist.")] = False,
) -> None:
    """Write the bundled experiments (quickstart, smoke, ...) and the annotator files they
    name into FOLDER/experiments/, to edit and run from FOLDER."""
    from alignzoo.config.bundled import write_bundled

    written = write_bundled(folder, force=force)
    console.print(f"wrote {len(written)} files to {folder / 'experiments'}:", markup=False)
    for path in written:
        console.print(f"  {path.relative_to(folder)}", markup=False)
    console.print(
        f"next: cd {folder} && alignzoo run experiments/smoke.yaml   (a few steps; "
        "experiments/quickstart.yaml is the full A/B comparison)",
        markup=False,
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


QueueDir = Annotated[Path, typer.Argument(help="The queue's folder (queue.sqlite).")]


def _existing_queue(queue_dir: Path) -> Path:
    if not (queue_dir / "queue.sqlite").is_file():
        raise UserError(
            f"{queue_dir}: no queue here (queue.sqlite); a run with the human labeler creates "
            "one, as does add-annotator"
        )
    return queue_dir


@contextlib.contextmanager
def _open_queue(queue_dir: Path, existing: bool = True) -> Iterator[Any]:
    """The human queue in ``queue_dir`` (which must already hold one unless ``existing`` is
    False), closed afterwards; its refusals (QueueError) become errors naming the folder."""
    from alignzoo.human.queue import HumanQueue, QueueError

    queue = HumanQueue(_existing_queue(queue_dir) if existing else queue_dir)
    try:
        yield queue
    except QueueError as exc:
        raise UserError(f"{queue_dir}: {exc}") from None
    finally:
        queue.close()


@annotate_app.command("serve")
def annotate_serve(
    queue_dir: QueueDir,
    host: Annotated[
        str, typer.Option(help="Interface to bind (0.0.0.0 only if you mean it).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8766,
) -> None:
    """Serve the annotation app for the queue in QUEUE_DIR (the default command)."""
    from alignzoo.human.app import serve
    from alignzoo.labeling.service import is_loopback

    _existing_queue(queue_dir)
    console.print(f"annotation app for {queue_dir} on http://{host}:{port}/", highlight=False)
    if not is_loopback(host):
        err_console.print(
            f"warning: serving on {host} over plain HTTP: annotators' tokens and judgements "
            "cross the network unencrypted; put a TLS proxy in front, or bind 127.0.0.1 and "
            "reach it through an SSH tunnel",
            highlight=False,
        )
    serve(queue_dir, host=host, port=port)


@annotate_app.command("add-annotator")
def annotate_add(
    queue_dir: QueueDir,
    name: Annotated[str, typer.Argument(help="The annotator's name (1 to 64 characters).")],
) -> None:
    """Let NAME sign in to the app; prints their token (shown once, stored hashed)."""
    with _open_queue(queue_dir, existing=False) as queue:
        token = queue.add_annotator(name)
    console.print(f"annotator {name!r} added; their sign-in token (shown once):", markup=False)
    print(token)


@annotate_app.command("revoke")
def annotate_revoke(
    queue_dir: QueueDir,
    name: Annotated[str, typer.Argument(help="The annotator whose token stops working.")],
) -> None:
    """NAME's token stops working at once (their judgements stay); reissue gives a new one."""
    with _open_queue(queue_dir) as queue:
        queue.revoke(name)
    console.print(f"annotator {name!r}: token revoked", markup=False)


@annotate_app.command("reissue")
def annotate_reissue(
    queue_dir: QueueDir,
    name: Annotated[str, typer.Argument(help="The annotator who gets a new token.")],
) -> None:
    """A new token for NAME (shown once); their old one stops working at once."""
    with _open_queue(queue_dir) as queue:
        token = queue.reissue(name)
    console.print(f"annotator {name!r}: new sign-in token (shown once):", markup=False)
    print(token)


def _scale_labels(labels: list[str] | None) -> dict[float, str] | None:
    """``--scale-label VALUE=MEANING`` options as {value: meaning}."""
    if not labels:
        return None
    out = {}
    for label in labels:
        value, sep, text = label.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not sep or not text.strip() or number != number:
            raise UserError(f"--scale-label {label!r}: expected VALUE=MEANING, e.g. 1='wrong'")
        out[number] = text.strip()
    return out


QuestionOption = Annotated[
    str | None, typer.Option(help="What annotators are asked (shown above each item).")
]
ScaleLabelOption = Annotated[
    list[str] | None,
    typer.Option(
        "--scale-label", help="VALUE=MEANING: what a point of the rating scale means (repeat)."
    ),
]


class ItemKind(str, Enum):
    """The kind of item instructions are for."""

    rating = "rating"
    pair = "pair"


@annotate_app.command("instructions")
def annotate_instructions(
    queue_dir: QueueDir,
    kind: Annotated[ItemKind, typer.Option(help="The items they are for.")] = ItemKind.rating,
    question: QuestionOption = None,
    scale_label: ScaleLabelOption = None,
) -> None:
    """Set (or, without options, show) what annotators are asked and what scale points mean."""
    with _open_queue(queue_dir) as queue:
        if question is None and not scale_label:
            said = queue.instructions(kind.value)
        else:
            said = queue.set_instructions(kind.value, question, _scale_labels(scale_label))
    labels = [[v, t] for v, t in said.scale_labels]
    print(json.dumps({"kind": kind.value, "question": said.question, "scale_labels": labels}))


@annotate_app.command("status")
def annotate_status(queue_dir: QueueDir) -> None:
    """Progress per annotator, and the queue's agreement, as JSON."""
    from alignzoo.human.export import agreement

    with _open_queue(queue_dir) as queue:
        out = {
            "queue": queue.progress(),
            "annotators": {name: queue.progress_of(name) for name in queue.annotators()},
            "revoked": [name for name in queue.annotators() if queue.revoked(name)],
            "agreement": agreement(queue),
        }
    print(json.dumps(out, indent=2))


@annotate_app.command("pool")
def annotate_pool(
    experiment: Annotated[Path, typer.Argument(help="The experiment whose policy samples.")],
    queue_dir: QueueDir,
    arm: Annotated[str | None, typer.Option(help="The arm (default: the first).")] = None,
    prompts: Annotated[int, typer.Option(min=1, help="Training prompts to sample for.")] = 64,
    raters: Annotated[int, typer.Option(min=1, help="Judgements wanted per item.")] = 3,
    ratings: Annotated[
        bool, typer.Option(help="Queue each response to be rated instead of pairs to compare.")
    ] = False,
    question: QuestionOption = None,
    scale_label: ScaleLabelOption = None,
) -> None:
    """Sample two responses per prompt from the arm's starting policy and queue them."""
    from alignzoo.config.bundled import experiment_file
    from alignzoo.config.loader import load_experiment
    from alignzoo.human.queue import HumanQueue, write_source
    from alignzoo.human.simulate import sample_pool
    from alignzoo.types import LabelRequest

    with experiment_file(experiment) as path:
        loaded = load_experiment(path)
    name = arm or next(iter(loaded.spec.arms))
    if name not in loaded.spec.arms:
        raise UserError(f"--arm {name}: {experiment} has arms {', '.join(loaded.spec.arms)}")
    labels = _scale_labels(scale_label)
    if labels and not ratings:
        raise UserError("--scale-label is for --ratings (a pair's choices are A, B and a tie)")
    pool = sample_pool(loaded, name, prompts, 2, log=lambda m: console.print(m, highlight=False))
    queue = HumanQueue(queue_dir)
    try:
        if question is not None or labels:
            queue.set_instructions("rating" if ratings else "pair", question, labels)
        if ratings:
            requests = [
                LabelRequest(prompt=p, response=r, extra=extra)
                for p, responses, extra in pool
                for r in responses
            ]
            ids = queue.enqueue(requests, raters=raters, scale=(1, 5))
        else:
            pairs = [(p, rs[0], rs[1]) for p, rs, _ in pool if rs[0] != rs[1]]
            extras = [extra for _, rs, extra in pool if rs[0] != rs[1]]
            ids = queue.enqueue_pairs(pairs, raters=raters, extras=extras)
    finally:
        queue.close()
    write_source(queue_dir, experiment, name)
    kind = "rating" if ratings else "pair"
    skipped = "" if ratings else f" ({len(pool) - len(ids)} prompts gave two equal responses)"
    console.print(f"{len(ids)} {kind} items queued in {queue_dir}{skipped}", highlight=False)


@annotate_app.command("simulate")
def annotate_simulate(
    queue_dir: QueueDir,
    config: Annotated[Path, typer.Argument(help="YAML: rule, annotators, seed, tie_margin.")],
) -> None:
    """Judge the open items as simulated annotators (a rule labeler plus noise and bias)."""
    from alignzoo.human.queue import HumanQueue
    from alignzoo.human.simulate import read_simulation, rule_scorer, simulate

    simulation = read_simulation(config)
    queue = HumanQueue(_existing_queue(queue_dir))
    try:
        stored = simulate(queue, simulation, rule_scorer(simulation.rule))
        progress = queue.progress()
    finally:
        queue.close()
    console.print(
        f"{stored} judgements by {len(simulation.annotators)} simulated annotators; "
        f"{progress['complete']} of {progress['items']} items complete",
        highlight=False,
    )


class ExportKind(str, Enum):
    """What `alignzoo annotate export` writes."""

    preference = "preference"
    unpaired = "unpaired"


@annotate_app.command("export")
def annotate_export(
    queue_dir: QueueDir,
    out: Annotated[Path, typer.Argument(help="Folder for the data set (must not exist).")],
    kind: Annotated[
        ExportKind,
        typer.Option("--as", help="preference (prompt/chosen/rejected) or unpaired (label)."),
    ] = ExportKind.preference,
    min_agree: Annotated[
        int, typer.Option(min=1, help="Annotators who must agree for an item to be kept.")
    ] = 2,
    tolerance: Annotated[
        float, typer.Option(help="Agreeing: closer than this on the scale mapped to [0, 1].")
    ] = 0.3,
    threshold: Annotated[
        float, typer.Option(help="unpaired: a normalised rating at least this is desirable.")
    ] = 0.5,
) -> None:
    """Write the agreed judgements as a `datasets` folder DPO, KTO and train-rm read."""
    from alignzoo.human.export import export

    _existing_queue(queue_dir)
    if not tolerance > 0:
        raise UserError(f"--tolerance {tolerance}: must be above 0 (values agree when closer)")
    if out.exists():
        raise UserError(f"{out} exists; choose a new folder for the export")
    summary = export(queue_dir, out, kind.value, min_agree, tolerance, threshold)
    console.print(
        f"{summary.rows} {kind.value} rows in {out}: ratings kept {summary.ratings.kept}, "
        f"{summary.ratings.disagreed} disagreed, {summary.ratings.too_few} too few judgements; "
        f"pairs kept {summary.pairs.kept} ({summary.ties} ties left out), "
        f"{summary.pairs.disagreed} disagreed, {summary.pairs.too_few} too few judgements",
        highlight=False,
    )


def _base_model(base: str, arm: str | None) -> str:
    """The folder ``--base`` names: a model folder, "embedded" (the default embedded warm
    start), or an experiment file (its arm's starting policy, built if need be)."""
    from alignzoo.config.schema import DataConfig, ModelConfig
    from alignzoo.engine.policy import policy_path

    def say(message: str) -> None:
        console.print(message, highlight=False)

    if base == "embedded":
        return policy_path(ModelConfig(), DataConfig(), say)
    if base.endswith((".yaml", ".yml")):
        from alignzoo.config.loader import load_experiment

        loaded = load_experiment(Path(base))
        name = arm or next(iter(loaded.spec.arms))
        if name not in loaded.spec.arms:
            raise UserError(f"--arm {name}: {base} has arms {', '.join(loaded.spec.arms)}")
        return policy_path(loaded.spec.arms[name].model, loaded.spec.data, say)
    if not Path(base).expanduser().is_dir():
        raise UserError(
            f"--base {base}: not a model folder, 'embedded', or an experiment file (.yaml)"
        )
    return str(Path(base).expanduser())


@app.command("train-rm")
def train_rm(
    data: Annotated[
        Path, typer.Argument(help="Preference pairs: prompt/chosen/rejected (file or folder).")
    ],
    base: Annotated[
        str,
        typer.Option(
            help="Model folder or an experiment YAML (its arm's policy); 'embedded' only when "
            "the data records the experiment that produced it (else refused)."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Folder for the reward model (must not exist).")],
    arm: Annotated[str | None, typer.Option(help="With an experiment --base: the arm.")] = None,
    epochs: Annotated[int, typer.Option(min=1)] = 3,
    lr: Annotated[float, typer.Option(min=0.0)] = 1e-3,
    batch_size: Annotated[int, typer.Option(min=1, help="Pairs per optimizer step.")] = 16,
    heldout: Annotated[
        float, typer.Option(min=0.0, max=0.9, help="Share of prompts held out for evaluation.")
    ] = 0.2,
    max_length: Annotated[int, typer.Option(min=1, help="Tokens per prompt + response.")] = 256,
    seed: int = 0,
    negatives: Annotated[
        str | None,
        typer.Option(
            help="Synthetic negatives, each a perturbation of a chosen response taken as a "
            "second rejected one: 'arithmetic' (one near miss of the answer), "
            "'arithmetic-shifts' (the answer moved by ±1, ±2, ±10, ±20, ±50, ±100), or "
            "'file.py:fn' / 'module:fn' (fn(prompt, response) -> str | list[str] | None)."
        ),
    ] = None,
    max_negatives: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="At most this many of --negatives' perturbations per training pair (a seeded "
            "draw; default: all). The top-1 probe still uses all of them.",
        ),
    ] = None,
    perturbations: Annotated[
        str | None,
        typer.Option(
            help="Perturbations for the top-1 probe (the right response against them), as "
            "--negatives names them, without training on them; default: --negatives."
        ),
    ] = None,
    ensemble: Annotated[
        int,
        typer.Option(
            min=1,
            help="K > 1: an ensemble of K reward models (OUT/member-i, seed + i, each on a "
            "bootstrap of the training pairs; OUT/ensemble.json lists them).",
        ),
    ] = 1,
) -> None:
    """Train a Bradley-Terry reward model the reward_model labeler loads."""
    from alignzoo.human.reward_model import RewardModelReport, train_ensemble, train_reward_model

    if out.exists():
        raise UserError(f"--out {out} exists; choose a new folder for the reward model")

    def perturbation(name: str | None, option: str) -> Any:
        from alignzoo.world.task import NEGATIVES

        if name in NEGATIVES:
            return NEGATIVES[name]
        if name is not None:
            from alignzoo.config.callables import load_callable

            return load_callable(name, option)
        return None

    perturb = perturbation(negatives, "--negatives")
    probe_with = perturbation(perturbations, "--perturbations")
    if base == "embedded":
        # The warm start must be the one the samples came from: the default embedded settings
        # are another model unless the data says which experiment it was.
        try:
            export_info = json.loads((data / "alignzoo_export.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            export_info = {}
        if not isinstance(export_info, dict):
            export_info = {}
        experiment = export_info.get("experiment")
        if not (isinstance(experiment, str) and Path(experiment).is_file()):
            raise UserError(
                f"--base embedded: {data} does not record which experiment produced its "
                "samples, and the default embedded warm start is not the one that "
                "experiment used; pass the experiment file instead (--base "
                "experiments/NAME.yaml, with --arm for another arm than the first)"
            )
        base = experiment
        if arm is None and isinstance(export_info.get("arm"), str):
            arm = export_info["arm"]
        console.print(f"--base embedded: the warm start of {base} (arm {arm})", highlight=False)
    say = lambda m: console.print(m, highlight=False)  # noqa: E731
    settings: dict[str, Any] = {
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "heldout": heldout,
        "max_length": max_length,
        "negatives": perturb,
        "max_negatives": max_negatives,
        "perturbations": probe_with,
    }
    model = _base_model(base, arm)
    if ensemble > 1:
        result = train_ensemble(data, model, out, ensemble, seed=seed, log=say, **settings)
        reports: list[RewardModelReport] = result.members
    else:
        reports = [train_reward_model(data, model, out, seed=seed, log=say, **settings)]
    for i, report in enumerate(reports):
        where = out / f"member-{i}" if ensemble > 1 else out
        lo, hi = report.heldout_interval
        console.print(
            f"reward model in {where}: held-out accuracy {report.heldout_accuracy:.3f} "
            f"(95% interval [{lo:.3f}, {hi:.3f}]) on "
            f"{report.heldout_pairs} pairs (ECE {report.heldout_ece:.3f}, Brier "
            f"{report.heldout_brier:.3f}); {report.train_pairs} training pairs, "
            f"{report.synthetic_negatives} of them synthetic negatives",
            highlight=False,
        )
        probes = report.probes
        if "top1_accuracy" in probes:
            console.print(
                f"  top-1 accuracy {probes['top1_accuracy']:.3f} over {probes['top1_sets']} "
                f"candidate sets ({probes['top1_candidates']:.1f} candidates each: the chosen "
                "response and its perturbations)",
                highlight=False,
            )
        for name, row in probes.get("ood", {}).items():
            console.print(
                f"  out-of-distribution '{name}': score {row['mean_score_minus_chosen']:+.3f} "
                f"against the chosen response, above it for "
                f"{row['share_above_chosen']:.0%} of prompts",
                highlight=False,
            )
        for warning in report.warnings:
            console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    if ensemble > 1:
        console.print(
            f"ensemble of {ensemble} in {out} ({out / 'ensemble.json'}): held-out accuracy "
            f"{result.heldout_accuracy_mean:.3f} +- {result.heldout_accuracy_std:.3f} "
            "across members",
            highlight=False,
        )


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
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
        if _state["debug"]:
            raise
        _print_error(exc)
        return exc.exit_code
    except Exception as exc:  # a bug: one line without --debug, the traceback with it
        if _state["debug"]:
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


if __name__ == "__main__":
    sys.exit(main())
