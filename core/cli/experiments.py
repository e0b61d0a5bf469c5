"""`alignzoo validate`, `run`, `relabel`, `report`, `export` and `init`: the experiment's
commands."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from alignzoo.cli.common import SetOption, console, parse_list, restart_for_huge_pages
from alignzoo.errors import UserError


class Executors(str, Enum):
    """Where `alignzoo run` trains the arm x seed runs."""

    local = "local"
    ray = "ray"


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

    if executor is Executors.local and address is not None:
        raise UserError("--address is for --executor ray; add --executor ray or drop --address")
    if executor is Executors.ray:
        import_ray()  # before anything is written: say how to install it

    loaded = load_experiment(
        experiment, arms=parse_list(arms, str, "--arms"), overrides=overrides or ()
    )
    seed_list = parse_list(seeds, int, "--seeds")
    if seed_list is not None:
        from alignzoo.config.schema import SEED_RANGE, SeedsError

        try:
            loaded.spec = loaded.spec.with_seeds(seed_list)
        except SeedsError as exc:  # the schema's rule, said of the option
            if not seed_list:
                raise UserError("--seeds is empty") from None
            if exc.repeated:
                raise UserError(
                    f"--seeds repeats {', '.join(map(str, exc.repeated))}; {exc}"
                ) from None
            raise UserError(
                f"--seeds {', '.join(map(str, exc.outside))}: outside {SEED_RANGE}"
            ) from None
    # Restart on huge pages where a run keeps its freed CPU memory (the kept heap is faulted in
    # once, so its huge pages pay; fresh mappings every step would pay their zeroing at every
    # step instead): before anything is written and before joining torchrun's group. The
    # experiment file is the user's or the installed package's own file, so no temporary copy
    # is left behind.
    if any(arm.training.reuse_cpu_memory for arm in loaded.spec.arms.values()):
        restart_for_huge_pages()
    distributed.init_from_env()  # under torchrun: join the process group (data parallel)
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


def run_jobs(executor: Executors, jobs: int | None) -> int:
    """``--jobs`` as the runner reads it: given, as given; else 1 locally (one run at a time)
    and, on Ray, this machine's CPU count, so each task asks for one CPU and the cluster runs
    as many at once as it has CPUs (an arm's placement still asks for its GPUs)."""
    if jobs is not None:
        return jobs
    return (os.cpu_count() or 1) if executor is Executors.ray else 1


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
