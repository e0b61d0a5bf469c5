"""The report: table numbers, verdicts, plots, a self-contained HTML, failed runs, determinism."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as sps

from alignzoo.errors import UserError
from alignzoo.report.sections import write_report
from tests.core.report.conftest import Builder

BASE = [0.52, 0.55, 0.49, 0.53, 0.51]
SAME_DIST = [0.50, 0.54, 0.53, 0.49, 0.55]  # A/A: the same distribution, other draws
WORSE = [0.21, 0.18, 0.24, 0.20, 0.22]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def section(md: str, title: str) -> str:
    start = md.index(f"## {title}")
    end = md.find("\n## ", start + 1)
    return md[start : end if end != -1 else None]


def table_row(md: str, title: str, first_cell: str) -> list[str]:
    for line in section(md, title).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in {title!r}")


def valid_png(path: Path) -> bool:
    data = path.read_bytes()
    if not data.startswith(PNG_MAGIC):
        return False
    width, height = struct.unpack(">II", data[16:24])
    return (
        data[12:16] == b"IHDR" and width > 100 and height > 100 and data.endswith(b"IEND\xaeB`\x82")
    )


def test_table_numbers_match_the_statistics(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"base": BASE, "other": SAME_DIST})
    paths = write_report(root)
    assert paths == [root / "report.md", root / "report.html"]
    md = (root / "report.md").read_text()

    row = table_row(md, "Arms", "base (baseline)")
    mean = np.mean(BASE)
    low, high = sps.t.interval(0.95, len(BASE) - 1, loc=mean, scale=sps.sem(BASE))
    assert row[1] == "5/5"
    assert row[2] == "0.1"  # every synthetic curve starts at 0.1 (the step-0 evaluation)
    assert row[3] == f"{mean:.4g} ± {(high - low) / 2:.3g}"
    assert row[4] == f"10 ({mean:.4g})"  # the last evaluation is the best (curves climb)
    assert row[5] == "80"  # samples: 10 steps x 8 in every seed's status.json
    assert row[6] == f"{np.mean([80 / (10 * (1 + s)) for s in range(5)]):.4g}"  # samples/s
    assert row[7] == f"{np.mean([500 + 100 * s for s in range(5)]):.4g}"  # tokens/s
    assert row[8] == "30.0 s"  # mean of 10, 20, ..., 50
    assert row[9] == "204"  # peak memory: max over seeds
    assert "## Time to" not in md  # no evaluation.target: no such section

    cmp = table_row(md, "Against the baseline (base)", "other")
    assert float(cmp[1]) == pytest.approx(np.mean(SAME_DIST) - np.mean(BASE), abs=1e-4)
    # Both arms finished seeds 0-4: the comparison is paired by seed; 2/2^5 > 0.05, so the
    # paired t-test decides, and the interval is its t-interval.
    p_paired = sps.ttest_rel(SAME_DIST, BASE).pvalue
    assert cmp[3] == "paired t-test"
    assert cmp[4] == f"{p_paired:.4f}"
    assert cmp[5] == cmp[4]  # one comparison: Holm leaves p as it is
    ci = sps.ttest_rel(SAME_DIST, BASE).confidence_interval(0.95)
    assert cmp[2] == f"{ci.low:+.4g} to {ci.high:+.4g}"
    assert "paired" in md
    assert cmp[6] == "no detectable difference"
    assert int(cmp[7]) > 5  # seeds that would detect a difference this small
    assert "One comparison: its p-value needs no adjustment" in md
    assert "per-seed differences are roughly normal" in md


def test_aa_is_no_detectable_difference_and_broken_arm_is_worse(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"grpo": BASE, "grpo_again": SAME_DIST, "lr0": WORSE})
    write_report(root)
    md = (root / "report.md").read_text()
    assert table_row(md, "Against the baseline (grpo)", "grpo_again")[6] == (
        "no detectable difference"
    )
    worse = table_row(md, "Against the baseline (grpo)", "lr0")
    assert worse[6] == "worse"
    assert worse[7] == "—"
    assert "lr0 is worse than grpo on eval/exact_match" in md
    low, high = (float(x) for x in re.findall(r"[+-][\d.e-]+", worse[2]))
    assert low < np.mean(WORSE) - np.mean(BASE) < high < 0


def test_baseline_from_spec(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"a": WORSE, "b": BASE}, baseline="b")
    write_report(root)
    md = (root / "report.md").read_text()
    assert table_row(md, "Against the baseline (b)", "a")[6] == "worse"


def test_plots_exist_are_png_and_html_is_self_contained(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"base": BASE[:2], "other": WORSE[:2]})
    write_report(root)
    expected = {
        "eval_vs_step.png",
        "eval_vs_time.png",
        "train_reward.png",
        "train_kl.png",
        "train_response_length.png",
        "train_entropy.png",
    }
    svgs = {name.replace(".png", ".svg") for name in expected}  # vector copies beside them
    assert {p.name for p in (root / "plots").iterdir()} == expected | svgs
    for name in expected:
        assert valid_png(root / "plots" / name), name
    for name in svgs:
        assert (root / "plots" / name).read_text().lstrip().startswith("<?xml"), name
    md = (root / "report.md").read_text()
    for name in expected:
        assert f"(plots/{name})" in md
    assert "min–max over seeds" in md

    page = (root / "report.html").read_text()
    sources = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert len(sources) == len(expected)
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    assert "<script" not in page and "<link" not in page and "url(" not in page


def test_failed_and_running_runs_are_listed(experiment_dir: Builder) -> None:
    root = experiment_dir(
        finals={"base": BASE[:3], "broken": WORSE[:3]},
        failed={("broken", 1): "RunError: loss is NaN at step 3"},
        running=(("base", 2),),
    )
    write_report(root)
    md = (root / "report.md").read_text()
    assert "broken/seed-1: RunError: loss is NaN at step 3" in section(md, "Failed runs")
    run_row = table_row(md, "Runs", "broken/seed-1")
    assert run_row[1] == "failed" and run_row[5] == "RunError: loss is NaN at step 3"
    assert table_row(md, "Runs", "base/seed-2")[1] == "running"
    # Statistics use finished runs only.
    assert table_row(md, "Arms", "base (baseline)")[1] == "2/3"
    assert table_row(md, "Arms", "broken")[1] == "2/3"
    assert "RunError: loss is NaN at step 3" in (root / "report.html").read_text()


def test_one_seed_reports_na_not_a_crash(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"base": [0.5], "other": [0.7]})
    write_report(root)
    md = (root / "report.md").read_text()
    assert table_row(md, "Arms", "base (baseline)")[3] == "0.5 ± n/a (1 seed)"
    row = table_row(md, "Against the baseline (base)", "other")
    assert row[2] == "n/a" and row[4] == "n/a" and row[6] == "no detectable difference"
    assert "at least 2 seeds" in md


def test_health_warnings_are_shown_once(experiment_dir: Builder) -> None:
    warning = {"step": 4, "detected_step": 7, "signal": "kl_runaway", "message": "KL 3 is above 1"}
    root = experiment_dir(
        finals={"base": BASE[:2], "other": BASE[:2]},
        health={("other", 1): [warning, warning]},  # written twice across a resume
    )
    write_report(root)
    md = (root / "report.md").read_text()
    rows = [line for line in section(md, "Health warnings").splitlines() if "kl_runaway" in line]
    assert len(rows) == 1
    assert table_row(md, "Health warnings", "other/seed-1")[1:4] == ["kl_runaway", "4", "7"]


def test_report_is_deterministic(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"base": BASE, "other": WORSE})
    write_report(root)
    first = {p.name: p.read_bytes() for p in [*root.glob("report.*"), *root.glob("plots/*")]}
    write_report(root)
    second = {p.name: p.read_bytes() for p in [*root.glob("report.*"), *root.glob("plots/*")]}
    assert first == second


def test_report_is_the_same_from_another_process(experiment_dir: Builder) -> None:
    """Nothing in the report depends on the process (hash seed, time): a rerun gives the same."""
    root = experiment_dir(
        finals={"base": BASE, "other": WORSE, "third": SAME_DIST},
        health={("other", 1): [{"step": 4, "signal": "kl_runaway", "message": "KL 3"}]},
    )
    write_report(root)
    first = {p.name: p.read_bytes() for p in [*root.glob("report.*"), *root.glob("plots/*")]}
    code = (
        "import sys; from alignzoo.report.sections import write_report; write_report(sys.argv[1])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code, str(root)], check=True, env=env)
    second = {p.name: p.read_bytes() for p in [*root.glob("report.*"), *root.glob("plots/*")]}
    assert first == second


def test_a_malformed_health_line_is_skipped(experiment_dir: Builder) -> None:
    good = {"step": 4, "signal": "kl_runaway", "message": "KL 3 is above 1"}
    root = experiment_dir(
        finals={"base": BASE[:2], "other": BASE[:2]},
        health={("other", 1): [{"signal": "x", "step": None}, good]},
    )
    write_report(root)
    rows = section((root / "report.md").read_text(), "Health warnings").splitlines()
    assert [r for r in rows if "other/seed-1" in r] == [
        "| other/seed-1 | kl_runaway | 4 | 4 | KL 3 is above 1 |"
    ]


def test_missing_folder_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no experiment\.yaml"):
        write_report(tmp_path / "empty")


def test_finished_runs_without_the_metric_are_counted_apart(experiment_dir: Builder) -> None:
    import shutil

    root = experiment_dir(finals={"base": BASE[:3], "other": WORSE[:3], "blind": WORSE[:3]})
    # other/seed-2 finished but its evaluations lack the metric; blind has none at all.
    for run in [root / "other" / "seed-2", *(root / "blind").iterdir()]:
        rows = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
        (run / "eval.jsonl").write_text(
            "".join(json.dumps({"step": r["step"], "eval/score": 0.5}) + "\n" for r in rows)
        )
    # base/seed-2 has not started: no folder, yet the experiment asks for it.
    shutil.rmtree(root / "base" / "seed-2")
    write_report(root)
    md = (root / "report.md").read_text()
    assert table_row(md, "Arms", "base (baseline)")[1] == "2/3"
    assert table_row(md, "Arms", "other")[1] == "3/3 (2 with eval/exact_match)"
    cmp = table_row(md, "Against the baseline (base)", "other")
    assert float(cmp[1]) == pytest.approx(np.mean(WORSE[:2]) - np.mean(BASE[:2]), abs=1e-4)
    assert "blind: no comparison yet (blind has no finished run with eval/exact_match)" in md


def test_metric_direction_from_the_spec_overrides_the_name_guess(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"grpo": BASE, "lr0": WORSE})
    spec = yaml.safe_load((root / "experiment.yaml").read_text())
    spec["evaluation"]["higher_is_better"] = False  # say exact_match were an error rate
    (root / "experiment.yaml").write_text(yaml.safe_dump(spec))
    write_report(root)
    md = (root / "report.md").read_text()
    assert table_row(md, "Against the baseline (grpo)", "lr0")[6] == "better"
    assert "lower is better" in md


def test_training_curves_are_smoothed_per_seed_and_the_caption_says_so(
    experiment_dir: Builder,
) -> None:
    from alignzoo.report import plots

    points = [(float(s), float(s), float(v)) for s, v in enumerate([0, 3, 6, 9, 0])]
    assert [p[2] for p in plots.trailing_mean(points, 3)] == [0.0, 1.5, 3.0, 6.0, 5.0]
    assert plots.smoothing_window(10) == 1 and plots.smoothing_window(150) == 6
    root = experiment_dir(finals={"base": BASE, "other": SAME_DIST}, steps=150, every=50)
    write_report(root)
    md = (root / "report.md").read_text()
    assert "each seed's curve a trailing mean over 6 steps" in md
    assert "trailing mean" not in md.split("Training:")[0]  # evaluation curves are not smoothed


def test_arms_with_different_seeds_are_compared_unpaired(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"base": BASE, "other": SAME_DIST[:3]})
    write_report(root)
    md = (root / "report.md").read_text()
    cmp = table_row(md, "Against the baseline (base)", "other")
    # 3 + 5 seeds: the exact permutation test can reach 2/C(8, 3) = 0.036 < 0.05, so it decides
    # (the report used to show Welch's p here; it now shows the deciding test's p). In
    # hundredths the values are integers, so scipy sees the ties exactly as the report does.
    p_perm = sps.permutation_test(
        (np.multiply(SAME_DIST[:3], 100).round(), np.multiply(BASE, 100).round()),
        lambda x, y, axis=-1: np.mean(x, axis=axis) - np.mean(y, axis=axis),
        permutation_type="independent",
        n_resamples=np.inf,
    ).pvalue
    assert cmp[3] == "permutation test"
    assert cmp[4] == f"{p_perm:.4f}"
    assert "paired by seed" not in md.split("## Against the baseline")[1].split("Difference:")[0]


FOUR = [0.34, 0.36, 0.33, 0.38]  # 4 seeds, a spread from seed to seed


def test_seven_arms_are_one_family_adjusted_with_holm(experiment_dir: Builder) -> None:
    """The issue's report: with 4 seeds and six arms against the baseline, a paired t p of 0.02
    is not a verdict (Holm: 6 x 0.02), its interval is the simultaneous t-interval and includes
    0, and the report says why the t-test decides; a broken arm is still worse."""
    finals = {"grpo": FOUR}
    finals["dpo_online"] = [b + d for b, d in zip(FOUR, [-0.01, -0.02, -0.015, -0.03], strict=True)]
    finals["lr0"] = [v - 0.2 + e for v, e in zip(FOUR, [0.001, -0.002, 0.0, 0.003], strict=True)]
    for i, e in enumerate([0.01, -0.01, 0.005, 0.0]):
        finals[f"same{i}"] = [v + e * (j == i) for j, v in enumerate(FOUR)]
    root = experiment_dir(finals=finals, baseline="grpo")
    write_report(root)
    md = (root / "report.md").read_text()
    part = section(md, "Against the baseline (grpo)")
    assert "p-values adjusted for 6 comparisons with Holm's method" in part
    assert "| p | p (Holm, 6 comparisons) | verdict |" in part
    assert "simultaneous 95% CI (6 arms)" in part

    dpo = table_row(md, "Against the baseline (grpo)", "dpo_online")
    test = sps.ttest_rel(finals["dpo_online"], FOUR)
    assert dpo[3] == "paired t-test"
    assert dpo[4] == f"{test.pvalue:.4f}"
    assert float(dpo[5]) > float(dpo[4])  # adjusted
    assert dpo[6] == "no detectable difference"  # unadjusted, p = 0.02 would say "worse"
    ci = test.confidence_interval(1 - 0.05 / 6)
    assert dpo[2] == f"{ci.low:+.4g} to {ci.high:+.4g}"
    assert ci.low < 0 < ci.high
    assert "cannot go below p = 0.125" in part and "0.05/6" in part
    assert "per-seed differences are roughly normal" in part

    lr0 = table_row(md, "Against the baseline (grpo)", "lr0")
    assert lr0[6] == "worse" and lr0[5] == "< 0.0001"
    low, high = (float(x) for x in lr0[2].split(" to "))
    assert low < high < 0


def test_each_arm_is_tested_against_its_own_start(experiment_dir: Builder) -> None:
    # Every run starts at 0.1. Arm "up" ends 0.5-0.6 on all eight seeds (8 pairs: the exact
    # sign-flip test can reach Holm's level for 2 arms), "flat" ends where it started.
    root = experiment_dir(
        finals={"up": [0.5, 0.55, 0.6, 0.52, 0.58, 0.51, 0.57, 0.53], "flat": [0.1] * 8}
    )
    write_report(root)
    md = (root / "report.md").read_text()
    part = md[md.index("## Against its own start") : md.index("## Health warnings")]
    rows = {}
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] not in ("arm", "---"):
            rows[cells[0]] = cells
    assert rows["up"][2] == "0.1" and rows["up"][8] == "improved"
    assert rows["up"][6] == "sign-flip test, paired by seed"
    assert rows["flat"][4] == "+0" and rows["flat"][8] == "no detectable change"
    assert "2 arm(s) form one family" in part


def test_a_plot_names_the_arms_it_has_no_data_for(experiment_dir: Builder) -> None:
    root = experiment_dir(finals={"base": BASE[:2], "other": WORSE[:2]})
    for seed in (0, 1):  # "other" has no reference model: its runs report no kl/ref
        metrics = root / "other" / f"seed-{seed}" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        metrics.write_text(
            "".join(json.dumps({k: v for k, v in r.items() if k != "kl/ref"}) + "\n" for r in rows)
        )
    write_report(root)
    md = (root / "report.md").read_text()
    kl_caption = next(line for line in md.splitlines() if line.startswith("*Training: KL"))
    assert "No data: other." in kl_caption
    reward_caption = next(
        line for line in md.splitlines() if line.startswith("*Training: training reward")
    )
    assert "No data" not in reward_caption


def test_time_to_target_per_arm_and_against_the_baseline(experiment_dir: Builder) -> None:
    """Evaluations at steps 0, 5 and 10 climb from 0.1 to each run's final value, and seed s
    evaluates at wall-clock 5 * (1 + s) and 10 * (1 + s): 'fast' (0.9) passes 0.4 at step 5,
    'slow' (0.5) at step 10, 'never' (0.3) not at all. slow's wall-clock to it is 5 * (1 + s)
    seconds behind fast's, seed by seed."""
    seeds = 5
    root = experiment_dir(
        finals={"fast": [0.9] * seeds, "slow": [0.5] * seeds, "never": [0.3] * seeds},
        target=0.4,
    )
    write_report(root)
    md = (root / "report.md").read_text()
    title = "Time to eval/exact_match at least 0.4"
    fast, slow, never = (table_row(md, title, arm) for arm in ("fast", "slow", "never"))
    assert (fast[1], slow[1], never[1]) == ("5/5", "5/5", "0/5")
    assert fast[2].startswith("5 ") and slow[2].startswith("10 ")  # steps
    assert fast[3].startswith("40 ") and slow[3].startswith("80 ")  # samples: 8 per step
    times = {arm: [k * (1 + s) for s in range(seeds)] for arm, k in (("fast", 5), ("slow", 10))}
    assert fast[4].startswith(f"{np.mean(times['fast']):.4g} ±")
    assert slow[4].startswith(f"{np.mean(times['slow']):.4g} ±")
    assert never[2:] == ["n/a", "n/a", "n/a"]
    # slow against the baseline on wall-clock to the target: paired by seed (lower is better),
    # the only comparison (never did not reach it, so is left out and said so).
    compared = table_row(md, title, "slow")  # the first table's row; the comparison's follows
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in section(md, title).splitlines()
        if line.startswith("| slow")
    ]
    assert len(rows) == 2 and rows[0] == compared
    difference, p, holm, verdict = rows[1][1:]
    assert float(difference) == pytest.approx(np.mean(times["slow"]) - np.mean(times["fast"]))
    assert p == holm == f"{sps.ttest_rel(times['slow'], times['fast']).pvalue:.4f}"
    assert verdict == "worse"
    assert "never: not compared on wall-clock (0/5 of never's seeds reached it" in md
