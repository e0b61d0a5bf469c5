"""The experiment report: arms side by side with confidence intervals, tests, verdicts and plots.

``write_report(run_dir)`` reads ``experiment.yaml`` and every run folder
``<run_dir>/<arm>/seed-<n>/`` (``status.json``, ``metrics.jsonl``, ``eval.jsonl``,
``health.jsonl``) and writes ``report.md``, a self-contained ``report.html`` (plots embedded
as data URIs) and ``plots/*.png``. It works on finished and partial experiments: statistics use
finished runs only, failed runs are listed with their error, runs still going are listed with
their progress. The output depends only on the files (nothing like the current time is
embedded), so rerunning an interrupted experiment gives the same report as an uninterrupted
one, up to what really differs between the runs (wall-clock and throughput).
``write_report(run_dir, metric=...)`` compares on another recorded metric, after the run, into
``report-<metric>.md`` / ``.html`` and ``plots-<metric>/`` (:mod:`alignzoo.report.choice`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignzoo import metrics as canonical
from alignzoo.config.schema import ExperimentSpec
from alignzoo.errors import UserError
from alignzoo.report import plots, stats
from alignzoo.report.choice import MetricChoice, check_every_run, report_stem, resolve_key
from alignzoo.report.document import Block, render_html, render_markdown
from alignzoo.report.overoptimisation import overoptimisation_blocks
from alignzoo.report.provenance import provenance_blocks
from alignzoo.runfolder import SEED_FOLDER, RunFolder, RunStatus, write_atomic
from alignzoo.runfolder.runfiles import (
    RunData,
    find_runs,
    load_spec,
    metric_key,
    number,
    read_jsonl,
)

TRAIN_PLOTS = (
    (
        canonical.REWARD_MEAN,
        "training reward (mean over the step's samples)",
        "",
        "train_reward.png",
    ),
    (
        canonical.KL_REF,
        "KL to the reference",
        "The same estimator in every arm: k3 over the step's responses, policy before the "
        "step's update; arms without a reference model report none.",
        "train_kl.png",
    ),
    (canonical.RESPONSE_LENGTH, "response length (tokens)", "", "train_response_length.png"),
    (
        canonical.ENTROPY,
        "policy entropy (nats per token)",
        "Computed the same way in every arm, policy before the step's update.",
        "train_entropy.png",
    ),
)
"""The training curves the report draws: canonical metrics only (alignzoo.metrics)."""


# --------------------------------------------------------------------------- numbers


@dataclass
class ArmRow:
    """One line of the arms table."""

    arm: str
    finished: int
    total: int
    final: list[float]  # one value per finished run that has the metric
    final_by_seed: dict[int, float]
    start_by_seed: dict[int, float]  # the first evaluation (step 0) of each finished run
    summary: stats.Summary | None
    start_value: float | None
    best_step: int | None
    best_value: float | None
    samples: float | None
    tokens_per_s: float | None
    wall_clock_s: float | None
    peak_memory_mb: float | None
    samples_per_s: float | None = None  # each run's samples over its wall-clock, mean over seeds


@dataclass(frozen=True)
class Reached:
    """Where a run first reached the target: its evaluation's step, samples and training
    wall-clock (seconds)."""

    step: int
    samples: float
    time_s: float


def time_to_target(run: RunData, key: str, target: float, higher: bool) -> Reached | None:
    """The run's first evaluation whose ``key`` is at or past ``target`` (``>=`` when higher is
    better, else ``<=``); None when none is."""
    for row in run.evals:
        value = number(row.get(key))
        if value is None or (value < target if higher else value > target):
            continue
        return Reached(
            int(number(row.get("step")) or 0),
            number(row.get("samples")) or 0.0,
            number(row.get("time_s")) or 0.0,
        )
    return None


def final_value(run: RunData, key: str) -> float | None:
    """The metric at the run's last evaluation."""
    for row in reversed(run.evals):
        value = number(row.get(key))
        if value is not None:
            return value
    return None


def kept_checkpoint_steps(run: RunData) -> set[int]:
    """The steps of the run's complete checkpoints (``checkpoints/step-N/state.json``)."""
    steps = set()
    for folder in RunFolder(run.path).checkpoints.glob("step-*"):
        tail = folder.name.split("-", 1)[1]
        if tail.isdigit() and (folder / "state.json").is_file():
            steps.add(int(tail))
    return steps


def best_checkpoint_value(run: RunData, key: str, higher: bool) -> float | None:
    """The best value of ``key`` among the run's evaluations at a kept checkpoint (the
    checkpoint ``alignzoo export --step best`` writes); the final value when none has one."""
    kept = kept_checkpoint_steps(run)
    values = [
        v
        for row in run.evals
        if number(row.get("step")) in kept and (v := number(row.get(key))) is not None
    ]
    if not values:
        return final_value(run, key)
    return max(values) if higher else min(values)


def compared_value(run: RunData, key: str, higher: bool, at: str = "final") -> float | None:
    """The value a run is compared on: its final evaluation, or (``at='best_checkpoint'``)
    its best at a kept checkpoint (``evaluation.compare_at``)."""
    if at == "best_checkpoint":
        return best_checkpoint_value(run, key, higher)
    return final_value(run, key)


def arm_row(
    arm: str,
    runs: list[RunData],
    key: str,
    higher: bool,
    planned: int | None = None,
    at: str = "final",
) -> ArmRow:
    """Summarise an arm's finished runs (``planned``: the runs the experiment asks for; ``at``:
    which evaluation of each run is compared, see :func:`compared_value`)."""
    done = [r for r in runs if r.status == RunStatus.FINISHED]
    finals = [(r, compared_value(r, key, higher, at)) for r in done]
    values = [v for _, v in finals if v is not None]
    # Best step: where the mean over the finished seeds is best (the earliest such step).
    per_step: dict[int, list[float]] = {}
    for r in done:
        for row in r.evals:
            value = number(row.get(key))
            if value is not None:
                per_step.setdefault(int(row["step"]), []).append(value)
    first = min(per_step, default=None)
    start_value = None if first is None else sum(per_step[first]) / len(per_step[first])
    best_step = best_value = None
    for step in sorted(per_step):
        mean = sum(per_step[step]) / len(per_step[step])
        if best_value is None or (mean > best_value if higher else mean < best_value):
            best_step, best_value = step, mean

    def mean_of(field_name: str) -> float | None:
        found = [v for r in done if (v := number(r.info.get(field_name))) is not None]
        return sum(found) / len(found) if found else None

    memory = [m for r in done if (m := number(r.info.get("peak_memory_mb"))) is not None]
    return ArmRow(
        arm=arm,
        finished=len(done),
        total=max(planned or 0, len(runs)),
        final=values,
        final_by_seed={r.seed: v for r, v in finals if v is not None},
        start_by_seed={
            r.seed: v
            for r in done
            if r.evals
            and int(r.evals[0].get("step", -1)) == 0
            and (v := number(r.evals[0].get(key))) is not None
        },
        summary=stats.mean_ci(values) if values else None,
        start_value=start_value,
        best_step=best_step,
        best_value=best_value,
        samples=mean_of("samples"),
        tokens_per_s=mean_of("tokens_per_s"),
        wall_clock_s=mean_of("wall_clock_s"),
        peak_memory_mb=max(memory) if memory else None,
        samples_per_s=_mean(
            [
                samples / seconds
                for r in done
                if (samples := number(r.info.get("samples"))) is not None
                and (seconds := number(r.info.get("wall_clock_s")))
            ]
        ),
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def fmt(value: float | None, digits: int = 4) -> str:
    """A number to ``digits`` significant digits, or n/a."""
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}"


def fmt_signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.4g}"


def fmt_p(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "< 0.0001" if value < 1e-4 else f"{value:.4f}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def fmt_summary(summary: stats.Summary | None) -> str:
    if summary is None:
        return "n/a"
    if summary.half_width is None:
        return f"{fmt(summary.mean)} ± n/a (1 seed)"
    return f"{fmt(summary.mean)} ± {fmt(summary.half_width, 3)}"


# --------------------------------------------------------------------------- document


# --------------------------------------------------------------------------- the report


def _component(ref: Any) -> str:
    """`name` and its params (only those given), as the report shows a component."""
    params = json.dumps(ref.params, sort_keys=True) if ref.params else ""
    return f"`{ref.name}`" + (f" `{params}`" if params else "")


def _changed(section: Any, shared: Any) -> dict[str, Any]:
    """The fields of an arm's section that differ from the experiment's shared one."""
    mine, theirs = section.model_dump(mode="json"), shared.model_dump(mode="json")
    return {k: v for k, v in mine.items() if v != theirs.get(k)}


def _describe_arm(spec: ExperimentSpec | None, arm: str) -> str:
    """Every component of the arm with its params (algorithm, labeler, backend, devices,
    modifiers, environment and episode limits), labeling settings that are not the defaults, and what the arm overrides."""
    if spec is None or arm not in spec.arms:
        return f"**{arm}**"
    from alignzoo.config.schema import LabelingConfig

    a = spec.arms[arm]
    parts = [
        f"algorithm {_component(a.algorithm)}",
        f"labeler {_component(a.labeler)}",
        f"backend {_component(a.backend)}",
        f"devices {_component(a.devices)}",
    ]
    if a.modifiers:
        parts.append("modifiers " + ", ".join(_component(m) for m in a.modifiers))
    if a.environment is not None:
        from alignzoo.config.schema import EpisodeConfig

        episodes = _changed(a.episodes, EpisodeConfig())
        parts.append(
            f"environment {_component(a.environment)}"
            + (f" episodes `{json.dumps(episodes, sort_keys=True)}`" if episodes else "")
        )
    labeling = _changed(a.labeling, LabelingConfig())
    if labeling:
        parts.append(f"labeling `{json.dumps(labeling, sort_keys=True)}`")
    from alignzoo.labeling.normalize import arm_normalization

    parts.append(f"reward normalisation {arm_normalization(a)}")
    for name in ("training", "model"):
        changed = _changed(getattr(a, name), getattr(spec, name))
        if changed:
            parts.append(f"{name} `{json.dumps(changed, sort_keys=True)}`")
    text = f"**{arm}**: " + "; ".join(parts)
    if a.description:
        text += f" ({a.description})"
    return text


def _meaning(key: str) -> str:
    """What an evaluation metric measures, in words."""
    known = {
        "eval/exact_match": "the share of greedy responses the labeler marks correct",
        "eval/score": "the labeler's mean value on the greedy responses",
        "eval/response_length": "the mean greedy response length in tokens",
    }
    if key in known:
        return known[key]
    if key.startswith("eval/pass@"):
        return "pass@k: the share of prompts with a correct answer among k samples"
    return canonical.CANONICAL.get(key, "a metric the runs recorded in eval.jsonl")


def _chosen_text(chosen: MetricChoice) -> str:
    """What a report on a metric chosen after the run compares on, and how it was chosen."""
    how = {
        "given": f"chosen with --{'higher' if chosen.higher else 'lower'}-is-better",
        "guessed": "guessed from its name",
    }[chosen.direction]
    if chosen.key == chosen.experiment_key:
        what = "the experiment's metric, its direction chosen after the run"
    else:
        what = (
            "chosen with --metric after the run; the experiment's metric is "
            f"`{chosen.experiment_key}`"
        )
    return (
        f"`{chosen.key}` ({_meaning(chosen.key)}; {what}; the experiment's own comparison is in "
        f"report.md), {'higher' if chosen.higher else 'lower'} is better ({how})"
    )


def _metric_text(spec: ExperimentSpec, key: str) -> str:
    """What the comparison metric is, and why it is the one (given, or the default)."""
    meaning = _meaning(key)
    if spec.evaluation.metric_chosen != "default":
        return f"`{key}` ({meaning})"
    why = (
        "every arm's labeler says which answers are correct"
        if key == "eval/exact_match"
        else "not every arm's labeler says which answers are correct"
    )
    return f"`{key}` ({meaning}; the default, as {why}; set evaluation.metric to choose)"


def _budget_text(spec: ExperimentSpec) -> str:
    b = spec.budget
    if b.steps is not None:
        return f"{b.steps} steps"
    if b.samples is not None:
        return f"{b.samples} generated samples"
    return f"{fmt_duration(b.wall_clock_s)} of training wall-clock"


@dataclass
class _Experiment:
    """What every section of the report needs to know about the experiment folder."""

    run_dir: Path
    spec: ExperimentSpec | None
    name: str
    arms: list[str]
    baseline: str
    key: str
    higher: bool
    runs: list[RunData]
    chosen: MetricChoice | None = None
    """Set when the report compares on another metric or direction than the experiment's
    (``alignzoo report --metric``); None for the experiment's own comparison."""

    @property
    def plot_dir(self) -> str:
        """The folder (under run_dir) of this report's plots."""
        return "plots" if self.chosen is None else self.chosen.plot_dir


def _open(
    run_dir: Path, metric: str | None = None, higher_is_better: bool | None = None
) -> _Experiment:
    """Read the experiment folder; ``metric`` / ``higher_is_better``: compare on another
    recorded metric or direction than the experiment's (see :mod:`alignzoo.report.choice`)."""
    spec = load_spec(run_dir)
    if spec is not None:
        arms = list(spec.arms)
        own_metric = spec.evaluation.metric or "exact_match"  # a resolved spec always names one
        name, baseline = spec.name, spec.baseline_arm
    else:
        arms = sorted(
            p.name
            for p in run_dir.iterdir()
            if p.is_dir() and any(SEED_FOLDER.match(c.name) for c in p.iterdir())
        )
        if not arms:
            raise UserError(f"{run_dir}: no experiment.yaml and no <arm>/seed-<n> run folders")
        name, own_metric, baseline = run_dir.name, "exact_match", arms[0]
    key = metric_key(own_metric)
    exp = _Experiment(
        run_dir=run_dir,
        spec=spec,
        name=name,
        arms=arms,
        baseline=baseline,
        key=key,
        higher=(
            spec.evaluation.higher_is_better
            if spec is not None and spec.evaluation.higher_is_better is not None
            else stats.higher_is_better(key)
        ),
        runs=find_runs(run_dir, arms),
    )
    if metric is None and higher_is_better is None:
        return exp
    if metric is None or metric_key(metric) == key:
        chosen_key = key
    else:
        chosen_key = resolve_key(metric, exp.runs, run_dir)
    own = exp.higher if chosen_key == key else stats.higher_is_better(chosen_key)
    higher = own if higher_is_better is None else higher_is_better
    if chosen_key == key and higher == exp.higher:
        return exp  # the experiment's own comparison: the default report, as `run` writes it
    check_every_run(metric or key, chosen_key, exp.runs, run_dir)
    exp.chosen = MetricChoice(
        key=chosen_key,
        higher=higher,
        direction="given" if higher_is_better is not None else "guessed",
        experiment_key=key,
        stem=report_stem(chosen_key, higher, own),
    )
    exp.key, exp.higher = chosen_key, higher
    return exp


def build_report(
    run_dir: Path, metric: str | None = None, higher_is_better: bool | None = None
) -> tuple[list[Block], str]:
    """Read the experiment folder, write the plots, and return the report's blocks and title
    (``metric`` / ``higher_is_better``: see :func:`write_report`)."""
    return _build(_open(Path(run_dir), metric, higher_is_better))


def _build(exp: _Experiment) -> tuple[list[Block], str]:
    rows = _arm_rows(exp)
    blocks = [Block("h1", f"Experiment {exp.name}")]
    blocks += _overview(exp)
    blocks += _arms_table(exp, rows)
    blocks += _time_to_target(exp)
    blocks += _comparisons(exp, rows)
    blocks += _against_start(exp, rows)
    blocks += _reward_models(exp.runs)
    blocks += overoptimisation_blocks(
        exp.run_dir, exp.arms, exp.runs, exp.key, _gold(exp), _compare_at(exp), exp.plot_dir
    )
    blocks += _rlhf_rounds(exp)
    blocks += _health(exp.runs)
    blocks += _unreadable(exp.runs)
    blocks += _swaps(exp.runs)
    blocks += _attempts(exp.runs)
    blocks += _runs_table(exp)
    blocks.append(Block("h2", "Plots"))
    blocks += _plots(exp.run_dir, exp.arms, exp.runs, exp.key, exp.plot_dir)
    blocks += provenance_blocks(exp.run_dir, exp.runs)
    on = "" if exp.chosen is None else f" on {exp.key}"
    return blocks, f"alignzoo report: {exp.name}{on}"


def _gold(exp: _Experiment) -> str | None:
    """The evaluation labeler every arm is measured by, when the experiment sets one."""
    ref = exp.spec.evaluation.labeler if exp.spec is not None else None
    return None if ref is None else ref.name


def _arm_rows(exp: _Experiment) -> dict[str, ArmRow]:
    """Every arm's :class:`ArmRow`, in the experiment's order."""
    planned = len(exp.spec.seeds) if exp.spec is not None else None
    at = _compare_at(exp)
    return {
        arm: arm_row(arm, [r for r in exp.runs if r.arm == arm], exp.key, exp.higher, planned, at)
        for arm in exp.arms
    }


def _compare_at(exp: _Experiment) -> str:
    """``evaluation.compare_at`` of the experiment ('final' without a spec)."""
    return exp.spec.evaluation.compare_at if exp.spec is not None else "final"


def _against_baseline(exp: _Experiment, rows: dict[str, ArmRow]) -> list[stats.Comparison | str]:
    """Per non-baseline arm, in order: its comparison with the baseline (all arms one family;
    seed by seed when both finished the same seeds), or why there is none yet."""
    baseline, key = exp.baseline, exp.key
    base_values = rows[baseline].final if baseline in rows else []
    entries: list[stats.ArmValues | str] = []
    for arm in exp.arms:
        if arm == baseline:
            continue
        values = rows[arm].final
        if not values or not base_values:
            missing = arm if not values else baseline
            why = "no finished run" if not rows[missing].finished else f"no finished run with {key}"
            entries.append(f"{arm}: no comparison yet ({missing} has {why}).")
            continue
        entries.append(arm_values(arm, rows[baseline].final_by_seed, rows[arm].final_by_seed))
    found = iter(
        stats.compare_arms(
            [e for e in entries if isinstance(e, stats.ArmValues)],
            baseline=baseline,
            metric=key,
            higher_is_better=exp.higher,
        )
    )
    return [e if isinstance(e, str) else next(found) for e in entries]


def summary_rows(run_dir: Path) -> tuple[str, list[list[str]]]:
    """The compared metric and, per arm, the console summary's cells: arm, seeds finished,
    start, final (mean ± 95% CI), change from the start and the verdict against the baseline."""
    exp = _open(Path(run_dir))
    rows = _arm_rows(exp)
    verdicts = {
        c.arm: c.verdict for c in _against_baseline(exp, rows) if isinstance(c, stats.Comparison)
    }
    out = []
    for arm in exp.arms:
        row = rows[arm]
        change = (
            None
            if row.summary is None or row.start_value is None
            else row.summary.mean - row.start_value
        )
        verdict = "baseline" if arm == exp.baseline else verdicts.get(arm, "n/a")
        out.append(
            [
                arm,
                f"{row.finished}/{row.total}",
                fmt(row.start_value),
                fmt_summary(row.summary),
                fmt_signed(change),
                verdict,
            ]
        )
    return exp.key, out


def _overview(exp: _Experiment) -> list[Block]:
    """The experiment's setup (arms, seeds, budget, baseline, metric) and how far it got."""
    spec, runs = exp.spec, exp.runs
    blocks: list[Block] = []
    if exp.chosen is not None:
        blocks.append(Block("p", f"**Compared on {_chosen_text(exp.chosen)}.**"))
    if spec is not None:
        if spec.description:
            blocks.append(Block("p", spec.description))
        compared = (
            f"{_metric_text(spec, exp.key)}, {'higher' if exp.higher else 'lower'} is better"
            if exp.chosen is None
            else f"`{exp.key}` (chosen after the run, above)"
        )
        blocks.append(
            Block(
                "p",
                f"Arms: {len(exp.arms)}, seeds {', '.join(map(str, spec.seeds))}, budget "
                f"{_budget_text(spec)} per run, baseline **{exp.baseline}**. Compared on "
                f"{compared}, at each run's "
                f"last evaluation; evaluation every {spec.evaluation.every} steps on the same "
                "held-out prompts for every arm.",
            )
        )
        blocks.append(Block("ul", items=[_describe_arm(spec, a) for a in exp.arms]))
        if spec.overrides:
            blocks.append(
                Block(
                    "p",
                    "Overrides of the file: " + ", ".join(f"`--set {o}`" for o in spec.overrides),
                )
            )
    n_done = sum(r.status == RunStatus.FINISHED for r in runs)
    n_failed = sum(r.status == RunStatus.FAILED for r in runs)
    expected = len(exp.arms) * len(spec.seeds) if spec is not None else len(runs)
    blocks.append(
        Block(
            "p",
            f"Runs: {n_done} finished, {n_failed} failed, "
            f"{max(0, expected - n_done - n_failed)} not finished, of {expected}. "
            "Statistics use finished runs only.",
        )
    )
    return blocks


def _arms_table(exp: _Experiment, rows: dict[str, ArmRow]) -> list[Block]:
    """Each arm's final metric (mean ± CI over seeds), start, best step and costs."""
    key = exp.key
    table = Block(
        "table",
        headers=[
            "arm",
            "seeds finished",
            f"start {key}",
            f"{'best-checkpoint' if _compare_at(exp) == 'best_checkpoint' else 'final'} "
            f"{key} (mean ± 95% CI)",
            "best step (mean)",
            "samples",
            "samples/s",
            "tokens/s",
            "wall-clock",
            "peak memory (MB)",
        ],
        rows=[
            [
                arm + (" (baseline)" if arm == exp.baseline else ""),
                f"{r.finished}/{r.total}"
                + (f" ({len(r.final)} with {key})" if len(r.final) != r.finished else ""),
                fmt(r.start_value),
                fmt_summary(r.summary),
                "n/a" if r.best_step is None else f"{r.best_step} ({fmt(r.best_value)})",
                fmt(r.samples),
                fmt(r.samples_per_s),
                fmt(r.tokens_per_s),
                fmt_duration(r.wall_clock_s),
                fmt(r.peak_memory_mb),
            ]
            for arm, r in rows.items()
        ],
    )
    compared = (
        f"Arms are compared on each run's best {key} at a kept checkpoint "
        "(evaluation.compare_at: best_checkpoint; the checkpoint `alignzoo export --step best` "
        "writes). It is chosen on the evaluation prompts themselves, so it is optimistic: a "
        "fresh set of prompts would likely score it a little lower. "
        if _compare_at(exp) == "best_checkpoint"
        else f"Arms are compared on each run's final {key}. "
    )
    stopped = [r for r in exp.runs if r.info.get("stopped_early")]
    if stopped:
        compared += (
            "Stopped early (evaluation.stop_after_falls), their final evaluation being their "
            "last: " + "; ".join(f"{r.name} ({r.info['stopped_early']})" for r in stopped) + ". "
        )
    note = Block(
        "p",
        compared + "Start: the first evaluation (before training), mean over seeds. "
        "The 95% CI is the t-interval of the mean over seeds (n/a with one seed). Best step: "
        "the evaluation step where the mean over seeds is best. Samples: responses generated "
        "(online) or read from the dataset (offline), mean over seeds, as a samples budget "
        "counts them; under a step budget arms may differ here. samples/s (each run's samples "
        "over its training wall-clock), tokens/s and wall-clock are means over seeds (they "
        "depend on what else ran at the same time). Peak memory is the "
        "maximum over seeds of each run's process peak: on CPU that is the process's maximum "
        "resident memory. With --jobs > 1 every run has a process of its own; a sequential "
        "experiment runs in one process, so there a run's peak includes the runs before it.",
    )
    return [Block("h2", "Arms"), table, note]


def arm_values(
    arm: str, baseline_by_seed: dict[int, float], arm_by_seed: dict[int, float]
) -> stats.ArmValues:
    """An arm's per-seed values against the baseline's: seed by seed (paired) when both have
    the same seeds (two or more), otherwise unpaired."""
    if len(baseline_by_seed) >= 2 and set(baseline_by_seed) == set(arm_by_seed):
        order = sorted(baseline_by_seed)
        base = [baseline_by_seed[s] for s in order]
        return stats.ArmValues(arm, base, [arm_by_seed[s] for s in order], True)
    return stats.ArmValues(arm, list(baseline_by_seed.values()), list(arm_by_seed.values()), False)


def _time_to_target(exp: _Experiment) -> list[Block]:
    """``evaluation.target``: per arm, how many seeds reached it and how soon (steps, samples,
    training wall-clock), and each arm's wall-clock to it against the baseline's when every
    finished seed of both reached it (the report's tests, lower is better)."""
    target = exp.spec.evaluation.target if exp.spec is not None else None
    if target is None:
        return []
    key, word = exp.key, "at least" if exp.higher else "at most"
    reached: dict[str, list[tuple[int, Reached | None]]] = {}
    for arm in exp.arms:
        done = [r for r in exp.runs if r.arm == arm and r.status == RunStatus.FINISHED]
        reached[arm] = [(r.seed, time_to_target(r, key, target, exp.higher)) for r in done]

    def summary(arm: str, field: str) -> str:
        values = [float(getattr(hit, field)) for _, hit in reached[arm] if hit is not None]
        return fmt_summary(stats.mean_ci(values)) if values else "n/a"

    table = Block(
        "table",
        headers=["arm", "seeds that reached it", "step", "samples", "wall-clock (s)"],
        rows=[
            [
                arm,
                f"{sum(hit is not None for _, hit in reached[arm])}/{len(reached[arm])}",
                summary(arm, "step"),
                summary(arm, "samples"),
                summary(arm, "time_s"),
            ]
            for arm in exp.arms
        ],
    )
    blocks = [
        Block("h2", f"Time to {key} {word} {target:g}"),
        table,
        Block(
            "p",
            f"Each run's first evaluation with {key} {word} {target:g} (evaluations every "
            f"{exp.spec.evaluation.every if exp.spec is not None else '?'} steps, so a time is "
            "late by up to one interval); mean ± 95% CI over the seeds that reached it, so an "
            "arm whose seeds did not all reach it looks faster than it is. Wall-clock is the "
            "run's training time at that evaluation.",
        ),
    ]
    baseline = exp.baseline
    entries: list[stats.ArmValues] = []
    left_out: list[str] = []
    # Each arm's wall-clock to the target per seed, when every finished seed reached it.
    times = {
        arm: {seed: hit.time_s for seed, hit in hits if hit is not None}
        for arm, hits in reached.items()
    }
    for arm in exp.arms:
        if arm == baseline:
            continue
        short = [
            f"{len(times[name])}/{len(reached[name])} of {name}'s seeds"
            for name in (arm, baseline)
            if not reached[name] or len(times[name]) < len(reached[name])
        ]
        if short:
            left_out.append(
                f"{arm}: not compared on wall-clock ({' and '.join(short)} reached it; a "
                "comparison needs every finished seed of both arms there)"
            )
            continue
        entries.append(arm_values(arm, times[baseline], times[arm]))
    found = stats.compare_arms(
        entries, baseline=baseline, metric=f"wall-clock to {key}", higher_is_better=False
    )
    if found:
        blocks.append(
            Block(
                "p",
                f"Wall-clock to the target against the baseline ({baseline}), lower is better, "
                "with the tests of the comparison below (paired by seed when both arms ran the "
                "same seeds; Holm over the arms compared here).",
            )
        )
        blocks.append(
            Block(
                "table",
                headers=["arm", "difference (s)", "p", "p (Holm)", "verdict"],
                rows=[
                    [
                        c.arm,
                        fmt_signed(c.difference),
                        fmt_p(c.p_value),
                        fmt_p(c.p_adjusted),
                        c.verdict,
                    ]
                    for c in found
                ],
            )
        )
    if left_out:
        blocks.append(Block("ul", items=left_out))
    return blocks


def _comparisons(exp: _Experiment, rows: dict[str, ArmRow]) -> list[Block]:
    """Each arm against the baseline, all arms one family: difference, the deciding test's
    simultaneous CI, raw and Holm-adjusted p, verdict, seeds to detect."""
    baseline = exp.baseline
    blocks = [Block("h2", f"Against the baseline ({baseline})")]
    comparisons = _against_baseline(exp, rows)
    done = [c for c in comparisons if isinstance(c, stats.Comparison)]
    k = max((c.n_comparisons for c in done), default=0)
    alpha = stats.ALPHA
    if k > 1:
        blocks.append(
            Block(
                "p",
                f"p-values adjusted for {k} comparisons with Holm's method: the verdict uses the "
                f"adjusted p (better or worse below {alpha:g}), so the chance of any false "
                f"better or worse in this table is at most {alpha:.0%}, given each test's "
                f"assumptions. The intervals are simultaneous: each at level 1 - {alpha:g}/{k}, "
                f"all {k} together cover the true differences with at least {1 - alpha:.0%} "
                "probability.",
            )
        )
    elif k == 1:
        blocks.append(
            Block(
                "p",
                "One comparison: its p-value needs no adjustment for multiple comparisons "
                "(Holm's method over 1 comparison leaves it unchanged).",
            )
        )
    if done:
        blocks.append(
            Block(
                "table",
                headers=[
                    "arm",
                    "difference",
                    "95% CI" if k <= 1 else f"simultaneous 95% CI ({k} arms)",
                    "test (and its CI)",
                    "p",
                    "p (Holm)" if k <= 1 else f"p (Holm, {k} comparisons)",
                    "verdict",
                    "seeds per arm to detect",
                ],
                rows=[
                    [
                        c.arm,
                        fmt_signed(c.difference),
                        "n/a"
                        if c.ci is None
                        else f"{fmt_signed(c.ci[0])} to {fmt_signed(c.ci[1])}",
                        c.test or "n/a (fewer than 2 seeds)",
                        fmt_p(c.p_value),
                        fmt_p(c.p_adjusted),
                        c.verdict,
                        "—" if c.verdict != "no detectable difference" else fmt(c.seeds_needed),
                    ]
                    for c in done
                ],
            )
        )
    if comparisons:
        blocks.append(
            Block("ul", items=[c if isinstance(c, str) else c.sentence for c in comparisons])
        )
    else:
        blocks.append(Block("p", "Only the baseline arm: nothing to compare."))
    if k == 0:
        family = "no arm has a test yet (each needs 2 or more seeds, as does the baseline)"
    else:
        with_test = f"the {k} arms" if k > 1 else "the one arm"
        family = (
            f"{with_test} with a test (2 or more seeds in both arms), k = {k}; a verdict needs "
            f"its Holm-adjusted p below {alpha:g}"
        )
    blocks.append(
        Block(
            "p",
            "Difference: arm minus baseline. Arms that finished the same seeds are compared seed "
            "by seed (paired): a seed fixes the prompt order and the initial weights, so each "
            "seed's difference removes what that seed does to both arms; arms that finished "
            "different seeds are compared unpaired. "
            f"Family: {family}. "
            "Test: paired, the exact sign-flip test of the per-seed differences when it can give "
            f"p below {alpha:g}/k (Holm's strictest step; its smallest p is 2/2^n with n seeds), "
            "otherwise the paired t-test, which assumes the per-seed differences are roughly "
            "normal; unpaired, the exact permutation test (exact up to 100,000 splits, Monte "
            f"Carlo beyond) when it can give p below {alpha:g}/k (smallest p 2/C(n_a + n_b, n_a)), "
            "otherwise Welch's t-test, which assumes each arm's per-seed values are roughly "
            "normal. The p column is that test's raw p, the Holm column its adjusted p. "
            f"CI: the interval of the row's test at level 1 - {alpha:g}/k (Bonferroni), so the k "
            f"intervals hold together with at least {1 - alpha:.0%} probability: the t-interval (paired "
            "or Welch) for a t-test; for a sign-flip or permutation test, the shifts of the arm "
            f"that test does not reject at {alpha:g}/k. An interval excludes 0 exactly when the "
            f"raw p is below {alpha:g}/k, and then the verdict is better or worse; Holm's later "
            f"steps ({alpha:g}/(k - 1), ..., {alpha:g}) can detect a difference whose interval "
            "includes 0, and that row's sentence says so. Effect size (in the sentence): d_z "
            "(mean difference / SD of the differences) paired, Cohen's d unpaired. Seeds to "
            f"detect: per arm, for the t-test at {alpha:g}/k with 80% power, taking the observed "
            "difference and spread as the truth.",
        )
    )
    return blocks


def _against_start(exp: _Experiment, rows: dict[str, ArmRow]) -> list[Block]:
    """Did each arm learn? Its final value against its own start, seed by seed, all arms one
    Holm family (the same tests and intervals as against the baseline)."""
    key = exp.key
    entries = []
    for arm in exp.arms:
        row = rows.get(arm)
        if row is None:
            continue
        seeds = sorted(set(row.start_by_seed) & set(row.final_by_seed))
        if len(seeds) >= 2:
            start = [row.start_by_seed[s] for s in seeds]
            entries.append(stats.ArmValues(arm, start, [row.final_by_seed[s] for s in seeds], True))
    if not entries:
        return []
    found = stats.compare_arms(entries, baseline="start", metric=key, higher_is_better=exp.higher)
    k = max(c.n_comparisons for c in found)
    words = {
        "better": "improved",
        "worse": "got worse",
        "no detectable difference": "no detectable change",
    }
    table = Block(
        "table",
        headers=[
            "arm",
            "seeds",
            "start",
            "final",
            "change",
            "95% CI" if k <= 1 else f"simultaneous 95% CI ({k} arms)",
            "test",
            "p (Holm)",
            "verdict",
        ],
        rows=[
            [
                c.arm,
                str(c.n_arm),
                fmt(c.mean_baseline),
                fmt(c.mean_arm),
                fmt_signed(c.difference),
                "n/a" if c.ci is None else f"{fmt_signed(c.ci[0])} to {fmt_signed(c.ci[1])}",
                c.test or "n/a",
                fmt_p(c.p_adjusted),
                words.get(c.verdict, c.verdict),
            ]
            for c in found
        ],
    )
    note = (
        f"Each arm's final {key} against its own start (the evaluation at step 0), seed by "
        f"seed: did training change it? The {k} arm(s) form one family, adjusted with Holm's "
        "method, with the same choice of test and interval as the comparison with the baseline."
    )
    return [Block("h2", "Against its own start"), Block("p", note), table]


def _health(runs: list[RunData]) -> list[Block]:
    """Every health warning of every run (each signal once per run)."""
    warnings = [(r, w) for r in runs for w in r.health]
    if not warnings:
        return [Block("h2", "Health warnings"), Block("p", "None.")]
    table = Block(
        "table",
        headers=["run", "signal", "began at step", "detected at step", "message"],
        rows=[
            [
                r.name,
                str(w.get("signal")),
                str(w.get("began_step", w.get("step"))),
                str(w.get("detected_step", w.get("step"))),
                str(w.get("message", "")),
            ]
            for r, w in warnings
        ],
    )
    return [Block("h2", "Health warnings"), table]


def _swaps(runs: list[RunData]) -> list[Block]:
    """Labeler changes during runs (``alignzoo labeler swap``), and what they mean for the
    comparison."""
    rows = [(r, w) for r in runs for w in r.swaps]
    if not rows:
        return []
    applied = {
        r.name for r, w in rows if w.get("status") == "applied" and w.get("action") != "shadow"
    }
    text = (
        "Labeler changes requested while the runs trained (a shadow labeler scores alongside "
        "without being trained on; a swap or promotion changes the labeler from that step on)."
    )
    if applied:
        text += (
            f" {len(applied)} of {len(runs)} runs changed labeler ({', '.join(sorted(applied))}): "
            "the arms were not labeled the same way throughout, so differences between them mix "
            "the algorithms with the labelers."
        )
    table = Block(
        "table",
        headers=["run", "before step", "action", "labeler", "status"],
        rows=[
            [
                r.name,
                str(w.get("step")),
                str(w.get("action")),
                json.dumps(w.get("labeler")),
                str(w.get("status")) + (f" ({w.get('reason')})" if w.get("reason") else ""),
            ]
            for r, w in rows
        ],
    )
    return [Block("h2", "Labeler changes"), Block("p", text), table]


def _attempts(runs: list[RunData]) -> list[Block]:
    """Earlier attempts of runs, kept in their folders: a run that started over, or the lines a
    resume cut back to its checkpoint. The comparison uses each run's last attempt."""
    rows = [(r, a) for r in runs for a in r.attempts]
    if not rows:
        return []
    text = (
        "Runs that were restarted or resumed keep what the earlier attempt wrote in their "
        "folder (nothing a run wrote is deleted); the comparison above uses each run's final "
        "attempt. Lines a resume cut back were trained again from the checkpoint named."
    )

    def steps(a: dict[str, Any]) -> str:
        return "-" if not a.get("steps") else f"{a['steps'][0]}-{a['steps'][1]}"

    table = Block(
        "table",
        headers=["run", "attempt", "what", "steps recorded", "resumed from", "why", "kept in"],
        rows=[
            [
                r.name,
                str(a.get("n")),
                str(a.get("kind", "")),
                steps(a),
                str(a.get("resumed_from_step", "-")),
                str(a.get("reason", "")),
                str(a.get("folder", "")),
            ]
            for r, a in rows
        ],
    )
    return [Block("h2", "Earlier attempts"), Block("p", text), table]


REWARD_MODEL_HEADERS = [
    "arm",
    "reward model",
    "held-out accuracy [95% interval]",
    "held-out pairs",
    "ECE",
    "top-1 accuracy",
    "training pairs",
    "synthetic negatives",
]


def _number(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _accuracy(trained: dict[str, Any]) -> str:
    """Held-out accuracy with the interval `alignzoo train-rm` gave it, when it gave one."""
    interval = trained.get("heldout_interval")
    text = _number(trained.get("heldout_accuracy"))
    if isinstance(interval, list) and len(interval) == 2 and text != "-":
        text += f" [{_number(interval[0])}, {_number(interval[1])}]"
    return text


def _reward_models(runs: list[RunData]) -> list[Block]:
    """The reward models arms were trained against (``reward_model.json`` of the runs), with
    the held-out metrics `alignzoo train-rm` measured for them."""
    rows: dict[tuple[str, str], list[str]] = {}
    for run in runs:
        try:
            row = json.loads((run.path / "reward_model.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        trained = row.get("trained") or {}
        members = trained.get("members")
        path = str(row.get("path")) + (f" (ensemble of {members}, means)" if members else "")
        rows.setdefault(
            (run.arm, str(row.get("path"))),
            [
                run.arm,
                path,
                _accuracy(trained),
                str(trained.get("heldout_pairs", "-")),
                _number(trained.get("heldout_ece")),
                _number((trained.get("probes") or {}).get("top1_accuracy")),
                str(trained.get("train_pairs", "-")),
                str(trained.get("synthetic_negatives", "-")),
            ],
        )
    if not rows:
        return []
    text = (
        "Arms labeled by a reward model, and how well it ranks preference pairs it was not "
        "trained on (accuracy: chosen scored above rejected; ECE: calibration of "
        "P(chosen > rejected); top-1: the held-out right response scored above every "
        "perturbation of it, the probe a shortcut fails; '-' for a model trained outside "
        "alignzoo or not probed). An ensemble shows its members' means."
    )
    table = Block(
        "table",
        headers=REWARD_MODEL_HEADERS,
        rows=list(rows.values()),
    )
    return [Block("h2", "Reward models"), Block("p", text), table]


def _rlhf_rounds(exp: _Experiment) -> list[Block]:
    """Iterated RLHF (``labeling.iterate``): per arm and round, the means over seeds of what
    the round queued, judged and trained on, the retrained reward model's held-out accuracy
    and top-1, and on how many seeds it was swapped in (nothing without rounds)."""
    from alignzoo.human.iterate import STREAM

    by_round: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in exp.runs:
        for row in read_jsonl(run.path / f"{STREAM}.jsonl"):
            if isinstance(row.get("round"), int):
                by_round.setdefault((run.arm, row["round"]), []).append(row)
    if not by_round:
        return []

    def mean(rows: list[dict[str, Any]], field_name: str) -> str:
        found = [v for r in rows if (v := number(r.get(field_name))) is not None]
        return fmt(sum(found) / len(found)) if found else "-"

    table = Block(
        "table",
        headers=[
            "arm",
            "round",
            "after step",
            "pairs queued",
            "judgements",
            "training pairs",
            "held-out accuracy",
            "top-1 accuracy",
            "swapped in",
        ],
        rows=[
            [
                arm,
                str(k),
                mean(rows, "after_step"),
                mean(rows, "pairs_queued"),
                mean(rows, "judgements_stored"),
                mean(rows, "training_pairs"),
                mean(rows, "heldout_accuracy"),
                mean(rows, "top1_accuracy"),
                f"{sum(bool(r.get('swapped')) for r in rows)} of {len(rows)} seeds",
            ]
            for (arm, k), rows in sorted(
                by_round.items(),
                key=lambda item: (
                    exp.arms.index(item[0][0]) if item[0][0] in exp.arms else 0,
                    item[0][1],
                ),
            )
        ],
    )
    text = (
        "Arms with labeling.iterate: before each round's step, the policy's fresh pairs were "
        "judged, the reward model retrained on every agreed pair so far and, when it passed "
        "its check, swapped in (the labeler changes below). Means over the seeds that ran the "
        "round; each run's rounds are in its rlhf_rounds.jsonl."
    )
    return [Block("h2", "Iterated RLHF rounds"), Block("p", text), table]


def _unreadable(runs: list[RunData]) -> list[Block]:
    """Files of run folders that could not be read whole (nothing when all could)."""
    problems = [p for r in runs for p in r.problems]
    if not problems:
        return []
    return [
        Block("h2", "Files that could not be read"),
        Block(
            "p",
            "These files were skipped (or the lines named); the tables above leave them out.",
        ),
        Block("ul", items=problems),
    ]


def _runs_table(exp: _Experiment) -> list[Block]:
    """One line per run (status, steps, last metric, error), then the failed runs' errors."""
    runs, key = exp.runs, exp.key
    blocks = [
        Block("h2", "Runs"),
        Block(
            "table",
            headers=["run", "status", "steps", f"last {key}", "wall-clock", "error"],
            rows=[
                [
                    r.name,
                    r.status,
                    str(r.info.get("step", r.metrics[-1]["step"] if r.metrics else 0)),
                    fmt(final_value(r, key)),
                    fmt_duration(number(r.info.get("wall_clock_s"))),
                    str(r.error or ""),
                ]
                for r in runs
            ],
        ),
    ]
    failed = [r for r in runs if r.status == RunStatus.FAILED]
    if failed:
        blocks.append(Block("h2", "Failed runs"))
        blocks.append(
            Block("ul", items=[f"{r.name}: {r.error or 'no error recorded'}" for r in failed])
        )
    return blocks


def _plots(
    run_dir: Path, arms: list[str], runs: list[RunData], key: str, folder: str = "plots"
) -> list[Block]:
    plot_dir = run_dir / folder
    colors = plots.arm_colors(arms)
    shown = [r for r in runs if r.status != RunStatus.FAILED]
    blocks: list[Block] = []

    def curves(source: str, y_key: str, x_key: str, window: int = 1) -> list[plots.Curve]:
        found = []
        for arm in arms:
            series = []
            for r in shown:
                if r.arm != arm:
                    continue
                rows = r.evals if source == "eval" else r.metrics
                points = []
                for row in rows:
                    x, y = number(row.get(x_key)), number(row.get(y_key))
                    if x is not None and y is not None:
                        points.append((float(row["step"]), x, y))
                series.append(plots.trailing_mean(points, window))
            curve = plots.aggregate(arm, series)
            if curve is not None:
                found.append(curve)
        return found

    band = f"line: mean over seeds; band: {plots.BAND}"

    def absent(found: list[plots.Curve]) -> str:
        """' No data: arm, arm.' for the arms a plot has no curve of."""
        have = {c.arm for c in found}
        missing = [a for a in arms if a not in have]
        return f" No data: {', '.join(missing)}." if missing else ""

    eval_step = curves("eval", key, "step")
    if eval_step:
        plots.line_plot(
            plot_dir / "eval_vs_step.png",
            eval_step,
            colors,
            title=f"{key} against step",
            xlabel="step",
            ylabel=key,
            markers=True,
        )
        blocks.append(
            Block(
                "img",
                f"{key} against training step ({band}).{absent(eval_step)}",
                path=f"{folder}/eval_vs_step.png",
            )
        )
        eval_time = curves("eval", key, "time_s")
        if eval_time:
            plots.line_plot(
                plot_dir / "eval_vs_time.png",
                eval_time,
                colors,
                title=f"{key} against wall-clock",
                xlabel="training wall-clock (s)",
                ylabel=key,
                markers=True,
            )
            blocks.append(
                Block(
                    "img",
                    f"{key} against training wall-clock ({band}; x: the mean time over seeds "
                    f"at which each evaluation step was reached).{absent(eval_time)}",
                    path=f"{folder}/eval_vs_time.png",
                )
            )
    longest = max((len(r.metrics) for r in shown), default=0)
    window = plots.smoothing_window(longest)
    smoothed = f"each seed's curve a trailing mean over {window} steps; " if window > 1 else ""
    for metric, label, note, filename in TRAIN_PLOTS:
        found = curves("metrics", metric, "step", window)
        if not found:
            continue
        plots.line_plot(
            plot_dir / filename, found, colors, title=label, xlabel="step", ylabel=metric
        )
        blocks.append(
            Block(
                "img",
                f"Training: {label} against step ({smoothed}{band}). {note}".rstrip()
                + absent(found),
                path=f"{folder}/{filename}",
            )
        )
    if not blocks:
        blocks.append(Block("p", "No metrics written yet."))
    return blocks


def write_report(
    run_dir: Path,
    metric: str | None = None,
    higher_is_better: bool | None = None,
    results: Path | None = None,
) -> list[Path]:
    """Write ``report.md``, ``report.html`` and ``plots/*.png`` into ``run_dir``.

    ``metric`` (a name as in ``evaluation.metric``, or any key the runs recorded in
    eval.jsonl) and ``higher_is_better`` compare the arms on another metric or direction than
    the experiment's, from the same files and with the same statistics: that report is
    ``report-<metric>.md`` / ``.html`` with its plots in ``plots-<metric>/``, beside the default
    report, which it leaves as it is (see :mod:`alignzoo.report.choice`). Naming the
    experiment's own metric and direction writes the default report.

    ``results``: also write the report's tables, every run's evaluations and the provenance
    as one JSON file there (:mod:`alignzoo.report.results`: what docs/results/ holds).

    Returns the paths of the two reports (Markdown first), then the results file if written.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run folder not found: {run_dir}")
    exp = _open(run_dir, metric, higher_is_better)
    blocks, title = _build(exp)
    stem = "report" if exp.chosen is None else exp.chosen.stem
    md = run_dir / f"{stem}.md"
    page = run_dir / f"{stem}.html"
    write_atomic(md, render_markdown(blocks))
    write_atomic(page, render_html(blocks, title, run_dir))
    if results is None:
        return [md, page]
    from alignzoo.report.results import results_document, write_results

    return [md, page, write_results(results, results_document(exp, blocks))]
