"""``alignzoo report --results``: the report's tables, every run's evaluations and the provenance
as one JSON file, the file the documentation's figures are checked against."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from alignzoo import cli, provenance
from alignzoo.report.sections import write_report
from tests.core.report.conftest import write_experiment
from tests.core.test_figures import provenance_problems, unmatched

START = datetime(2026, 12, 6, 5, 0, tzinfo=timezone.utc)


def experiment(root: Path) -> Path:
    root = write_experiment(root, {"base": [0.5, 0.6, 0.55], "other": [0.7, 0.8, 0.75]})
    entry = provenance.collect()
    entry.update(started=START.isoformat(), command="alignzoo run x.yaml")
    provenance.record(root, entry, resume=False)
    for arm in ("base", "other"):
        for seed in range(3):
            run = root / arm / f"seed-{seed}"
            # The last run of "other" ran with another thread count: a second setting.
            threads = 7 if (arm, seed) == ("other", 2) else entry["threads"]
            provenance.record(run, {**entry, "threads": threads}, resume=False)
            end = START.timestamp() + 60 * (1 + seed) + (30 if arm == "other" else 0)
            os.utime(run / "status.json", (end, end))
    return root


def test_the_results_file_holds_the_reports_tables_evaluations_and_provenance(
    tmp_path: Path,
) -> None:
    root = experiment(tmp_path / "exp")
    out = tmp_path / "docs" / "results" / "x.json"
    paths = write_report(root, results=out)
    assert paths == [root / "report.md", root / "report.html", out]
    document = json.loads(out.read_text())
    md = (root / "report.md").read_text()

    # Every table of report.md, cell for cell, under its section's heading.
    sections = [t["section"] for t in document["tables"]]
    assert sections[:3] == ["Arms", "Against the baseline (base)", "Against its own start"]
    for table in document["tables"]:
        assert f"## {table['section']}" in md
        for row in table["rows"]:
            printed = "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
            assert printed in md, printed

    # Every evaluation of every run, as recorded.
    rows = [
        json.loads(line) for line in (root / "other/seed-1/eval.jsonl").read_text().splitlines()
    ]
    assert document["evaluations"]["other/seed-1"] == rows
    # The mean over seeds at every evaluation: the fixture's evals climb from 0.1 to the final.
    assert document["curves"]["other"][0] == [0, pytest.approx(0.1), 3]
    assert document["curves"]["other"][-1] == [10, pytest.approx(0.75), 3]
    # The fixture's reward climbs linearly to the final value: steps 1-5 and 6-10 of 10.
    final = 0.7
    first, last = document["training"]["other/seed-0"]["reward/mean"]
    assert first == pytest.approx(final * 3 / 10) and last == pytest.approx(final * 8 / 10)
    assert "step" not in document["training"]["other/seed-0"]
    assert document["runs"]["base/seed-2"] == {
        "status": "finished",
        "steps": 10,
        "wall_clock_s": 30.0,
        "tokens_per_s": 700.0,
        "peak_memory_mb": 202.0,
    }
    # From the first session's start to the last run's final write (other/seed-2).
    assert document["wall_clock_s"] == 60 * 3 + 30
    assert document["experiment"] == {
        "name": document["experiment"]["name"],
        "metric": "eval/exact_match",
        "higher_is_better": True,
        "baseline": "base",
        "arms": ["base", "other"],
    }

    # Two settings (the thread counts differ), each naming its runs; each says what it ran on.
    settings = document["provenance"]["settings"]
    assert [s["runs"] for s in settings] == [
        ["base/seed-0", "base/seed-1", "base/seed-2", "other/seed-0", "other/seed-1"],
        ["other/seed-2"],
    ]
    assert settings[1]["threads"] == 7
    for setting in settings:
        assert setting["cpu_isa"]["capability"]
        assert "command" not in setting and "started" not in setting
    assert document["provenance"]["sessions"] == [
        {
            "command": "alignzoo run x.yaml",
            "started": START.isoformat(),
            "experiment_sha256": None,
        }
    ]


def test_a_figure_quoted_from_the_report_passes_the_check_and_a_changed_one_fails(
    tmp_path: Path,
) -> None:
    root = experiment(tmp_path / "exp")
    out = tmp_path / "x.json"
    write_report(root, results=out)
    document = json.loads(out.read_text())
    arms = next(t for t in document["tables"] if t["section"] == "Arms")
    final = next(row for row in arms["rows"] if row[0].startswith("other"))[3]  # "0.75 ± ..."
    assert unmatched(f"other reaches {final}", document) == []
    mean = float(final.split()[0])
    stale = f"{mean + 0.01:.4f}"
    assert unmatched(f"other reaches {stale}", document) == [stale]
    if document["provenance"]["settings"][0].get("lock"):
        # A checkout's environment built from its lock: nothing missing but a clean commit.
        assert all("lock" not in p for p in provenance_problems(document))


def test_a_results_file_that_is_not_json_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = experiment(tmp_path / "exp")
    code = cli.main(["report", str(root), "--results", str(tmp_path / "x.txt")])
    err = capsys.readouterr().err
    assert code == 2
    assert "--results" in err and ".json" in err and "Traceback" not in err
    assert not (tmp_path / "x.txt").exists()
