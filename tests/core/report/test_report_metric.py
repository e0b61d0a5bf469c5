"""`alignzoo report RUN_DIR --metric M`: the comparison on another recorded metric, after the run.

The run folders below record two metrics that disagree on which arm is better (``other`` has the
lower exact match and the higher score), so a report that ignored --metric would give the wrong
verdicts. The recomputed report must not touch the default one, and bad metric names are exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as sps

from alignzoo import cli
from alignzoo.report.sections import fmt_p, write_report
from tests.core.experiment.fake_engine import make_spec
from tests.core.report.test_report import section, table_row

SEEDS = 5
STEPS = 10
# Final values per arm and seed: `other` is worse on exact match, better on score, longer.
FINALS = {
    "base": {
        "eval/exact_match": [0.62, 0.65, 0.60, 0.63, 0.61],
        "eval/score": [0.20, 0.24, 0.21, 0.19, 0.22],
        "eval/response_length": [10.0, 11.0, 10.5, 9.5, 10.0],
    },
    "other": {
        "eval/exact_match": [0.31, 0.35, 0.30, 0.33, 0.29],
        "eval/score": [0.81, 0.79, 0.84, 0.80, 0.83],
        "eval/response_length": [20.0, 21.0, 19.5, 22.0, 20.5],
    },
}


def write_runs(root: Path, drop: dict[tuple[str, int], str] | None = None) -> Path:
    """Two arms x 5 seeds, evaluations at steps 0, 5 and 10 (step 0 the same in both arms);
    ``drop``: (arm, seed) -> a metric that run did not record."""
    drop = drop or {}
    spec = make_spec({arm: 1e-4 for arm in FINALS}, seeds=tuple(range(SEEDS)), steps=STEPS)
    root.mkdir(parents=True)
    (root / "experiment.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    start = {"eval/exact_match": 0.5, "eval/score": 0.5, "eval/response_length": 15.0}
    for arm, finals in FINALS.items():
        for seed in range(SEEDS):
            run = root / arm / f"seed-{seed}"
            run.mkdir(parents=True)
            rows = []
            for step, share in ((0, 0.0), (5, 0.5), (10, 1.0)):
                row: dict[str, float] = {"step": step, "time_s": step * 2.0, "samples": step * 8}
                for key, values in finals.items():
                    if drop.get((arm, seed)) != key:
                        row[key] = start[key] + (values[seed] - start[key]) * share
                rows.append(row)
            (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (run / "metrics.jsonl").write_text(
                "".join(
                    json.dumps({"step": s, "reward/mean": 0.1 * s, "entropy": 0.4}) + "\n"
                    for s in range(1, STEPS + 1)
                )
            )
            (run / "status.json").write_text(
                json.dumps({"status": "finished", "error": None, "step": STEPS})
            )
    return root


def verdict(md: str) -> str:
    return table_row(md, "Against the baseline (base)", "other")[6]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the default report (report.md, report.html, plots/)."""
    files = [root / "report.md", root / "report.html", *sorted((root / "plots").iterdir())]
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["report", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_default_report_compares_on_the_experiments_metric(tmp_path: Path) -> None:
    root = write_runs(tmp_path / "exp")
    assert write_report(root) == [root / "report.md", root / "report.html"]
    md = (root / "report.md").read_text()
    assert verdict(md) == "worse"  # exact match: other is lower
    assert "chosen with --metric" not in md


def test_another_metric_gives_the_verdicts_its_numbers_imply_and_keeps_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_runs(tmp_path / "exp")
    write_report(root)
    before = snapshot(root)

    code, out, err = run_cli(capsys, str(root), "--metric", "score")
    assert code == 0, err
    md_path, html_path = root / "report-score.md", root / "report-score.html"
    assert f"wrote {md_path}" in out and f"wrote {html_path}" in out
    assert snapshot(root) == before  # the default report and its plots: untouched

    md = md_path.read_text()
    assert (
        "Compared on `eval/score` (the labeler's mean value on the greedy responses; chosen "
        "with --metric after the run; the experiment's metric is `eval/exact_match`" in md
    )
    assert "higher is better (guessed from its name)" in md
    # The arms table and the comparison are on the score the runs recorded.
    base, other = FINALS["base"]["eval/score"], FINALS["other"]["eval/score"]
    row = table_row(md, "Arms", "other")
    mean = np.mean(other)
    low, high = sps.t.interval(0.95, SEEDS - 1, loc=mean, scale=sps.sem(other))
    assert row[3] == f"{mean:.4g} ± {(high - low) / 2:.3g}"
    cmp = table_row(md, "Against the baseline (base)", "other")
    assert float(cmp[1]) == pytest.approx(np.mean(other) - np.mean(base), abs=1e-4)
    assert cmp[3] == "paired t-test"
    assert cmp[4] == fmt_p(sps.ttest_rel(other, base).pvalue)
    assert verdict(md) == "better"  # exact match said worse
    assert "final eval/score" in section(md, "Arms")
    # Its plots are its own, beside the default ones, and the HTML embeds them.
    assert (root / "plots-score" / "eval_vs_step.png").is_file()
    assert "](plots-score/eval_vs_step.png)" in md
    assert "plots/" not in md
    assert "data:image/png;base64," in html_path.read_text()

    # The full key names the same metric and rewrites that report only.
    code, _, err = run_cli(capsys, str(root), "--metric", "eval/score")
    assert code == 0, err
    assert md_path.read_text() == md
    assert snapshot(root) == before


def test_lower_is_better_flips_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_runs(tmp_path / "exp")
    code, out, err = run_cli(capsys, str(root), "--metric", "score", "--lower-is-better")
    assert code == 0, err
    path = root / "report-score-lower-is-better.md"  # not over the higher-is-better report
    assert f"wrote {path}" in out
    md = path.read_text()
    assert verdict(md) == "worse"
    assert "lower is better (chosen with --lower-is-better)" in md
    assert not (root / "report.md").exists() and not (root / "report-score.md").exists()

    # The experiment's own metric in the other direction: beside report.md, not over it.
    code, out, err = run_cli(capsys, str(root), "--metric", "exact_match", "--lower-is-better")
    assert code == 0, err
    md = (root / "report-exact_match-lower-is-better.md").read_text()
    assert verdict(md) == "better"
    assert "the experiment's metric, its direction chosen after the run" in md
    assert not (root / "report.md").exists()


def test_a_length_is_guessed_lower_is_better(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_runs(tmp_path / "exp")
    code, _, err = run_cli(capsys, str(root), "--metric", "response_length")
    assert code == 0, err
    md = (root / "report-response_length.md").read_text()
    assert "lower is better (guessed from its name)" in md
    assert verdict(md) == "worse"  # other's responses are longer
    code, _, err = run_cli(capsys, str(root), "--metric", "response_length", "--higher-is-better")
    assert code == 0, err
    assert verdict((root / "report-response_length-higher-is-better.md").read_text()) == "better"


def test_the_experiments_own_metric_rewrites_the_default_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_runs(tmp_path / "exp")
    write_report(root)
    default = (root / "report.md").read_text()
    (root / "report.md").unlink()
    code, out, err = run_cli(capsys, str(root), "--metric", "exact_match", "--higher-is-better")
    assert code == 0, err
    assert f"wrote {root / 'report.md'}" in out
    assert (root / "report.md").read_text() == default
    assert sorted(p.name for p in root.glob("report*")) == ["report.html", "report.md"]


def test_an_unknown_metric_is_exit_2_with_what_was_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_runs(tmp_path / "exp")
    write_report(root)
    before = snapshot(root)
    code, out, err = run_cli(capsys, str(root), "--metric", "scor")
    assert code == 2
    message = err.strip()
    assert "\n" not in message and "Traceback" not in err + out
    assert message == (
        f"error: --metric scor: no run in {root} recorded eval/scor in eval.jsonl; did you "
        "mean score? Recorded: exact_match, response_length, score"
    )
    code, _, err = run_cli(capsys, str(root), "--metric", "eval/exact_mach")
    assert code == 2
    assert "did you mean eval/exact_match?" in err
    # Bookkeeping columns are not metrics; with nothing close, no guess.
    code, _, err = run_cli(capsys, str(root), "--metric", "time_s")
    assert code == 2
    assert "did you mean" not in err and "Recorded: exact_match, response_length, score" in err
    assert snapshot(root) == before
    assert sorted(p.name for p in root.glob("report*")) == ["report.html", "report.md"]
    assert not list(root.glob("plots-*"))


def test_the_command_line_says_it_without_a_traceback(tmp_path: Path) -> None:
    root = write_runs(tmp_path / "exp")
    result = subprocess.run(
        [sys.executable, "-m", "alignzoo.cli", "report", str(root), "--metric", "scoer"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "did you mean score?" in result.stderr


def test_a_metric_some_runs_lack_is_exit_2_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_runs(tmp_path / "exp", drop={("other", 2): "eval/score"})
    code, out, err = run_cli(capsys, str(root), "--metric", "score")
    assert code == 2
    message = err.strip()
    assert "\n" not in message and "Traceback" not in err + out
    assert message == (
        f"error: --metric score: eval/score is missing from 1 of 10 runs in {root} "
        "(other/seed-2); comparing the others would use partial data; every run recorded "
        "exact_match, response_length"
    )
    assert not list(root.glob("report*")) and not list(root.glob("plots-*"))


def test_failed_and_unstarted_runs_are_not_asked_for_the_metric(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_runs(tmp_path / "exp", drop={("other", 2): "eval/score"})
    status = root / "other" / "seed-2" / "status.json"
    status.write_text(json.dumps({"status": "failed", "error": "RunError: boom", "step": 5}))
    pending = root / "other" / "seed-9"
    pending.mkdir()  # a run that has not evaluated yet
    code, _, err = run_cli(capsys, str(root), "--metric", "score")
    assert code == 0, err
    md = (root / "report-score.md").read_text()
    assert table_row(md, "Arms", "other")[1].startswith("4/")
    assert verdict(md) == "better"  # unpaired now (seeds differ), still clear


def test_no_evaluation_yet_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_runs(tmp_path / "exp")
    for path in root.glob("*/seed-*/eval.jsonl"):
        path.unlink()
    code, _, err = run_cli(capsys, str(root), "--metric", "score")
    assert code == 2
    assert "has recorded an evaluation yet" in err and str(root) in err
