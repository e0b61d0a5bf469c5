"""The experiment report: arms side by side with confidence intervals, tests, verdicts and plots.

``write_report(run_dir)`` reads ``experiment.yaml`` and every run folder
``<run_dir>/<arm>/seed-<n>/`` (``status.json``, ``metrics.jsonl``, ``eval.jsonl``,
``health.jsonl``) and writes ``report.md``, a self-contained ``report.html`` (plots embedded
as data URIs) and ``plots/*.png``. It works on finished and partial experiments: statistics use
finished runs only, failed runs are listed with their error, runs still going are listed with
their progress. The output depends only on the files (nothing like the current time is
embedded), so rerunning an interrupted experiment gives the same report as an uninterrupted
one, up to what really differs between the runs (wall-clock and throughput).
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from alignzoo import plots, stats
from alignzoo.errors import UserError
from alignzoo.schema import ExperimentSpec

TRAIN_PLOTS = (
    ("reward/mean", "training reward (mean over the step's samples)", "train_reward.png"),
    ("kl", "KL to the reference", "train_kl.png"),
    ("response_length/mean", "response length (tokens)", "train_response_length.png"),
    ("entropy", "policy entropy (nats per token)", "train_entropy.png"),
)


# --------------------------------------------------------------------------- reading


@dataclass
class RunData:
    """What one arm x seed folder holds."""

    arm: str
    seed: int
    path: Path
    status: str
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    health: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.arm}/seed-{self.seed}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines of a file; a torn last line (a killed writer) is skipped, not an error."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def by_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step (the last one written wins: a resumed run rewrites steps), by step."""
    latest: dict[int, dict[str, Any]] = {}
    for row in rows:
        if isinstance(row.get("step"), (int, float)):
            latest[int(row["step"])] = row
    return [latest[s] for s in sorted(latest)]


def read_run(arm: str, seed: int, path: Path) -> RunData:
    """Read one run folder."""
    info: dict[str, Any] = {}
    status_file = path / "status.json"
    if status_file.exists():
        try:
            loaded = json.loads(status_file.read_text(encoding="utf-8"))
            info = loaded if isinstance(loaded, dict) else {}
        except json.JSONDecodeError:
            info = {}
    metrics = by_step(read_jsonl(path / "metrics.jsonl"))
    evals = by_step(read_jsonl(path / "eval.jsonl"))
    status = str(info.get("status") or ("running" if metrics or evals else "pending"))
    health: dict[tuple[str, int], dict[str, Any]] = {}
    for row in read_jsonl(path / "health.jsonl"):
        key = (str(row.get("signal")), int(row.get("step", 0)))
        health.setdefault(key, row)  # a resumed run may write the same warning twice
    return RunData(
        arm=arm,
        seed=seed,
        path=path,
        status=status,
        error=info.get("error"),
        info=info,
        metrics=metrics,
        evals=evals,
        health=[health[k] for k in sorted(health, key=lambda k: (k[1], k[0]))],
    )


def load_spec(run_dir: Path) -> ExperimentSpec | None:
    """The resolved spec the runner wrote, or None if the folder has none."""
    path = run_dir / "experiment.yaml"
    if not path.exists():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return ExperimentSpec.model_validate(data)
    except (yaml.YAMLError, ValidationError) as exc:
        raise UserError(f"{path}: not a valid resolved experiment ({exc})") from None


_SEED_DIR = re.compile(r"^seed-(-?\d+)$")


def find_runs(run_dir: Path, arms: list[str]) -> list[RunData]:
    """Every run folder of the given arms, ordered by arm then seed."""
    runs = []
    for arm in arms:
        arm_dir = run_dir / arm
        if not arm_dir.is_dir():
            continue
        seeds = []
        for child in arm_dir.iterdir():
            match = _SEED_DIR.match(child.name)
            if match and child.is_dir():
                seeds.append(int(match.group(1)))
        runs += [read_run(arm, seed, arm_dir / f"seed-{seed}") for seed in sorted(seeds)]
    return runs


def metric_key(metric: str) -> str:
    """The eval.jsonl key of the spec's evaluation metric ('exact_match' -> 'eval/exact_match')."""
    return metric if "/" in metric else f"eval/{metric}"


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# --------------------------------------------------------------------------- numbers


@dataclass
class ArmRow:
    """One line of the arms table."""

    arm: str
    finished: int
    total: int
    final: list[float]  # one value per finished run that has the metric
    summary: stats.Summary | None
    start_value: float | None
    best_step: int | None
    best_value: float | None
    tokens_per_s: float | None
    wall_clock_s: float | None
    peak_memory_mb: float | None


def final_value(run: RunData, key: str) -> float | None:
    """The metric at the run's last evaluation."""
    for row in reversed(run.evals):
        value = _num(row.get(key))
        if value is not None:
            return value
    return None


def arm_row(
    arm: str, runs: list[RunData], key: str, higher: bool, planned: int | None = None
) -> ArmRow:
    """Summarise an arm's finished runs (``planned``: the runs the experiment asks for)."""
    done = [r for r in runs if r.status == "finished"]
    finals = [(r, final_value(r, key)) for r in done]
    values = [v for _, v in finals if v is not None]
    # Best step: where the mean over the finished seeds is best (the earliest such step).
    per_step: dict[int, list[float]] = {}
    for r in done:
        for row in r.evals:
            value = _num(row.get(key))
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
        found = [v for r in done if (v := _num(r.info.get(field_name))) is not None]
        return sum(found) / len(found) if found else None

    memory = [m for r in done if (m := _num(r.info.get("peak_memory_mb"))) is not None]
    return ArmRow(
        arm=arm,
        finished=len(done),
        total=max(planned or 0, len(runs)),
        final=values,
        summary=stats.mean_ci(values) if values else None,
        start_value=start_value,
        best_step=best_step,
        best_value=best_value,
        tokens_per_s=mean_of("tokens_per_s"),
        wall_clock_s=mean_of("wall_clock_s"),
        peak_memory_mb=max(memory) if memory else None,
    )


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


@dataclass
class Block:
    """A piece of the report, rendered both as Markdown and as HTML."""

    kind: str  # "h1" | "h2" | "p" | "table" | "ul" | "img"
    text: str = ""
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    items: list[str] = field(default_factory=list)
    path: str = ""


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if b.kind == "h1":
            out.append(f"# {b.text}")
        elif b.kind == "h2":
            out.append(f"## {b.text}")
        elif b.kind == "p":
            out.append(b.text)
        elif b.kind == "ul":
            out.append("\n".join(f"- {item}" for item in b.items))
        elif b.kind == "table":
            lines = ["| " + " | ".join(_md_cell(h) for h in b.headers) + " |"]
            lines.append("|" + "|".join("---" for _ in b.headers) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
            out.append("\n".join(lines))
        elif b.kind == "img":
            out.append(f"![{b.text}]({b.path})\n\n*{b.text}*")
        out.append("")
    return "\n".join(out)


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1100px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 1em 0; } figcaption { font-size: 0.9em; color: #555; }
img { max-width: 100%; }
code { background: #f3f3f3; padding: 0 3px; }
"""


def render_html(blocks: list[Block], title: str, root: Path) -> str:
    """A single HTML file; images are embedded as base64 data URIs (nothing is fetched)."""
    esc = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
    ]
    for b in blocks:
        if b.kind in ("h1", "h2"):
            out.append(f"<{b.kind}>{esc(b.text)}</{b.kind}>")
        elif b.kind == "p":
            out.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "ul":
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif b.kind == "table":
            head = "".join(f"<th>{esc(h)}</th>" for h in b.headers)
            body = "".join(
                "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in b.rows
            )
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif b.kind == "img":
            data = base64.b64encode((root / b.path).read_bytes()).decode("ascii")
            out.append(
                f'<figure><img alt="{esc(b.text)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{esc(b.text)}</figcaption></figure>"
            )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _inline(text: str) -> str:
    """Escape, then turn Markdown `code` and **bold** into HTML."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


# --------------------------------------------------------------------------- the report


def _describe_arm(spec: ExperimentSpec | None, arm: str) -> str:
    if spec is None or arm not in spec.arms:
        return f"**{arm}**"
    a = spec.arms[arm]
    params = json.dumps(a.algorithm.params, sort_keys=True) if a.algorithm.params else ""
    text = f"**{arm}**: `{a.algorithm.name}`" + (f" `{params}`" if params else "")
    mods = [m.name for m in a.modifiers]
    if mods:
        text += " + " + ", ".join(f"`{m}`" for m in mods)
    if a.training != spec.training:
        changed = {
            k: v
            for k, v in a.training.model_dump(mode="json").items()
            if v != spec.training.model_dump(mode="json")[k]
        }
        text += f"; training `{json.dumps(changed, sort_keys=True)}`"
    if a.description:
        text += f" ({a.description})"
    return text


def _budget_text(spec: ExperimentSpec) -> str:
    b = spec.budget
    if b.steps is not None:
        return f"{b.steps} steps"
    if b.samples is not None:
        return f"{b.samples} generated samples"
    return f"{fmt_duration(b.wall_clock_s)} of training wall-clock"


def build_report(run_dir: Path) -> tuple[list[Block], str]:
    """Read the experiment folder, write the plots, and return the report's blocks and title."""
    run_dir = Path(run_dir)
    spec = load_spec(run_dir)
    if spec is not None:
        arms = list(spec.arms)
        name = spec.name
        metric = spec.evaluation.metric
        baseline = spec.baseline_arm
    else:
        arms = sorted(
            p.name
            for p in run_dir.iterdir()
            if p.is_dir() and any(_SEED_DIR.match(c.name) for c in p.iterdir())
        )
        if not arms:
            raise UserError(f"{run_dir}: no experiment.yaml and no <arm>/seed-<n> run folders")
        name, metric, baseline = run_dir.name, "exact_match", arms[0]
    key = metric_key(metric)
    higher = stats.higher_is_better(key)
    runs = find_runs(run_dir, arms)
    runs_of = {arm: [r for r in runs if r.arm == arm] for arm in arms}

    blocks: list[Block] = [Block("h1", f"Experiment {name}")]
    if spec is not None:
        if spec.description:
            blocks.append(Block("p", spec.description))
        blocks.append(
            Block(
                "p",
                f"Arms: {len(arms)}, seeds {', '.join(map(str, spec.seeds))}, budget "
                f"{_budget_text(spec)} per run, baseline **{baseline}**. Compared on `{key}` "
                f"({'higher' if higher else 'lower'} is better) at each run's last evaluation; "
                f"evaluation every {spec.evaluation.every} steps on the same held-out prompts "
                "for every arm.",
            )
        )
        blocks.append(Block("ul", items=[_describe_arm(spec, a) for a in arms]))
    n_done = sum(r.status == "finished" for r in runs)
    n_failed = sum(r.status == "failed" for r in runs)
    expected = len(arms) * len(spec.seeds) if spec is not None else len(runs)
    blocks.append(
        Block(
            "p",
            f"Runs: {n_done} finished, {n_failed} failed, "
            f"{max(0, expected - n_done - n_failed)} not finished, of {expected}. "
            "Statistics use finished runs only.",
        )
    )

    # Arms table.
    planned = len(spec.seeds) if spec is not None else None
    rows = {arm: arm_row(arm, runs_of[arm], key, higher, planned) for arm in arms}
    blocks.append(Block("h2", "Arms"))
    blocks.append(
        Block(
            "table",
            headers=[
                "arm",
                "seeds finished",
                f"start {key}",
                f"final {key} (mean ± 95% CI)",
                "best step (mean)",
                "tokens/s",
                "wall-clock",
                "peak memory (MB)",
            ],
            rows=[
                [
                    arm + (" (baseline)" if arm == baseline else ""),
                    f"{r.finished}/{r.total}"
                    + (f" ({len(r.final)} with {key})" if len(r.final) != r.finished else ""),
                    fmt(r.start_value),
                    fmt_summary(r.summary),
                    "n/a" if r.best_step is None else f"{r.best_step} ({fmt(r.best_value)})",
                    fmt(r.tokens_per_s),
                    fmt_duration(r.wall_clock_s),
                    fmt(r.peak_memory_mb),
                ]
                for arm, r in rows.items()
            ],
        )
    )
    blocks.append(
        Block(
            "p",
            "Start: the first evaluation (before training), mean over seeds. "
            "The 95% CI is the t-interval of the mean over seeds (n/a with one seed). Best step: "
            "the evaluation step where the mean over seeds is best. tokens/s and wall-clock are "
            "means over seeds; peak memory is the maximum.",
        )
    )

    # Comparisons against the baseline.
    blocks.append(Block("h2", f"Against the baseline ({baseline})"))
    base_values = rows[baseline].final if baseline in rows else []
    comparison_rows: list[list[str]] = []
    sentences: list[str] = []
    for arm in arms:
        if arm == baseline:
            continue
        values = rows[arm].final
        if not values or not base_values:
            missing = arm if not values else baseline
            why = "no finished run" if not rows[missing].finished else f"no finished run with {key}"
            sentences.append(f"{arm}: no comparison yet ({missing} has {why}).")
            continue
        c = stats.compare(
            base_values, values, arm=arm, baseline=baseline, metric=key, higher_is_better=higher
        )
        comparison_rows.append(
            [
                arm,
                fmt_signed(c.difference),
                "n/a" if c.ci is None else f"{fmt_signed(c.ci[0])} to {fmt_signed(c.ci[1])}",
                fmt_p(c.p_permutation),
                fmt_p(c.p_welch),
                fmt_signed(c.cohens_d),
                c.verdict,
                "—" if c.verdict != "no detectable difference" else fmt(c.seeds_needed),
            ]
        )
        sentences.append(c.sentence)
    if comparison_rows:
        blocks.append(
            Block(
                "table",
                headers=[
                    "arm",
                    "difference",
                    "95% bootstrap CI",
                    "p (permutation)",
                    "p (Welch)",
                    "Cohen's d",
                    "verdict",
                    "seeds per arm to detect",
                ],
                rows=comparison_rows,
            )
        )
    if sentences:
        blocks.append(Block("ul", items=sentences))
    else:
        blocks.append(Block("p", "Only the baseline arm: nothing to compare."))
    blocks.append(
        Block(
            "p",
            "Difference: arm minus baseline. The verdict uses the permutation test (exact up to "
            "9,999 splits of the seeds, Monte Carlo beyond) when it can reach p < 0.05 at these "
            "seed counts, and Welch's t-test otherwise (2 or 3 seeds per arm). The bootstrap CI "
            "resamples each arm's seeds independently (10,000 resamples, fixed seed); with few "
            "seeds it is narrower than the truth (it only reuses the values seen), so it can "
            "exclude 0 where the test detects nothing: the verdict follows the test. Seeds to "
            "detect: per arm, for a two-sided t-test at α = 0.05 with 80% power, taking the "
            "observed difference and spread as the truth.",
        )
    )

    # Health warnings.
    warnings = [(r, w) for r in runs for w in r.health]
    blocks.append(Block("h2", "Health warnings"))
    if warnings:
        blocks.append(
            Block(
                "table",
                headers=["run", "signal", "began at step", "detected at step", "message"],
                rows=[
                    [
                        r.name,
                        str(w.get("signal")),
                        str(w.get("step")),
                        str(w.get("detected_step", w.get("step"))),
                        str(w.get("message", "")),
                    ]
                    for r, w in warnings
                ],
            )
        )
    else:
        blocks.append(Block("p", "None."))

    # Runs.
    blocks.append(Block("h2", "Runs"))
    blocks.append(
        Block(
            "table",
            headers=["run", "status", "steps", f"last {key}", "wall-clock", "error"],
            rows=[
                [
                    r.name,
                    r.status,
                    str(r.info.get("step", r.metrics[-1]["step"] if r.metrics else 0)),
                    fmt(final_value(r, key)),
                    fmt_duration(_num(r.info.get("wall_clock_s"))),
                    str(r.error or ""),
                ]
                for r in runs
            ],
        )
    )
    failed = [r for r in runs if r.status == "failed"]
    if failed:
        blocks.append(Block("h2", "Failed runs"))
        blocks.append(
            Block("ul", items=[f"{r.name}: {r.error or 'no error recorded'}" for r in failed])
        )

    # Plots.
    blocks.append(Block("h2", "Plots"))
    blocks += _plots(run_dir, arms, runs, key)
    return blocks, f"alignzoo report: {name}"


def _plots(run_dir: Path, arms: list[str], runs: list[RunData], key: str) -> list[Block]:
    plot_dir = run_dir / "plots"
    colors = plots.arm_colors(arms)
    shown = [r for r in runs if r.status != "failed"]
    blocks: list[Block] = []

    def curves(source: str, y_key: str, x_key: str) -> list[plots.Curve]:
        found = []
        for arm in arms:
            series = []
            for r in shown:
                if r.arm != arm:
                    continue
                rows = r.evals if source == "eval" else r.metrics
                points = []
                for row in rows:
                    x, y = _num(row.get(x_key)), _num(row.get(y_key))
                    if x is not None and y is not None:
                        points.append((float(row["step"]), x, y))
                series.append(points)
            curve = plots.aggregate(arm, series)
            if curve is not None:
                found.append(curve)
        return found

    band = f"line: mean over seeds; band: {plots.BAND}"
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
            Block("img", f"{key} against training step ({band}).", path="plots/eval_vs_step.png")
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
                    "at which each evaluation step was reached).",
                    path="plots/eval_vs_time.png",
                )
            )
    for metric, label, filename in TRAIN_PLOTS:
        found = curves("metrics", metric, "step")
        if not found:
            continue
        plots.line_plot(
            plot_dir / filename, found, colors, title=label, xlabel="step", ylabel=metric
        )
        blocks.append(
            Block("img", f"Training: {label} against step ({band}).", path=f"plots/{filename}")
        )
    if not blocks:
        blocks.append(Block("p", "No metrics written yet."))
    return blocks


def write_report(run_dir: Path) -> list[Path]:
    """Write ``report.md``, ``report.html`` and ``plots/*.png`` into ``run_dir``; return the two reports."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run folder not found: {run_dir}")
    blocks, title = build_report(run_dir)
    md = run_dir / "report.md"
    page = run_dir / "report.html"
    _write_atomic(md, render_markdown(blocks))
    _write_atomic(page, render_html(blocks, title, run_dir))
    return [md, page]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
