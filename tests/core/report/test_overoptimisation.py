"""The gold-against-proxy section: peaks, falls, √KL, and its absence without a gold labeler."""

from __future__ import annotations

import math
from pathlib import Path

from alignzoo.report.overoptimisation import (
    FELL_BY,
    gold_points,
    overoptimisation_blocks,
    summarise,
)
from alignzoo.runfolder.runfiles import RunData

KEY = "eval/exact_match"


def run(arm: str, seed: int, gold: list[float], proxy: list[float], kl: float = 0.5) -> RunData:
    """Evaluations at steps 0, 10, 20, ...; training rows every 5 steps."""
    evals = [{"step": 10 * i, KEY: g} for i, g in enumerate(gold)]
    metrics = [
        {
            "step": s,
            "reward/mean": proxy[min(len(proxy) - 1, s // 10)],
            "kl/ref": kl * s / 10,
            "response_length/mean": 4.0,
        }
        for s in range(5, 10 * len(gold), 5)
    ]
    return RunData(
        arm, seed, Path(f"/nowhere/{arm}/{seed}"), "finished", metrics=metrics, evals=evals
    )


def test_points_carry_the_proxy_and_sqrt_kl_of_the_evaluations_step() -> None:
    points = gold_points(run("a", 0, [0.5, 0.7, 0.4], [0.1, 0.6, 0.9]), KEY)
    assert [p.step for p in points] == [0, 10, 20]
    assert points[0].sqrt_kl == 0.0 and points[0].proxy is None  # the start is the reference
    assert points[1].proxy == 0.6  # the training row of step 10
    assert math.isclose(points[2].sqrt_kl or -1, math.sqrt(0.5 * 2 * 4.0))  # kl/ref x length


def test_the_peak_is_the_first_step_reaching_the_highest_gold_and_a_fall_is_flagged() -> None:
    rising = summarise(gold_points(run("a", 0, [0.5, 0.8, 0.8], [0.1, 0.5, 0.6]), KEY), 0)
    assert rising is not None and (rising.peak, rising.peak_step, rising.fell) == (0.8, 10, False)
    falling = summarise(gold_points(run("a", 1, [0.5, 0.8, 0.8 - 2 * FELL_BY], [0, 1, 2]), KEY), 1)
    assert falling is not None and falling.fell and falling.final < falling.peak


def test_the_section_tabulates_each_arm_and_draws_the_plot(tmp_path: Path) -> None:
    runs = [
        run("rule", 0, [0.5, 0.7, 0.8], [0.2, 0.6, 0.8]),
        run("rm", 0, [0.5, 0.6, 0.1], [0.2, 1.5, 2.5]),
        run("rm", 1, [0.5, 0.65, 0.2], [0.2, 1.4, 2.4]),
    ]
    blocks = overoptimisation_blocks(tmp_path, ["rule", "rm"], runs, KEY, "arithmetic")
    table = next(b for b in blocks if b.kind == "table")
    by_arm = {row[0]: row for row in table.rows}
    assert by_arm["rule"][-1] == "0 of 1"
    assert by_arm["rm"][-1] == "2 of 2" and by_arm["rm"][3] == "10, 10"
    assert (tmp_path / "plots" / "gold_vs_proxy.png").stat().st_size > 0


def test_without_a_gold_labeler_the_section_says_why_it_is_absent(tmp_path: Path) -> None:
    blocks = overoptimisation_blocks(tmp_path, ["a"], [run("a", 0, [0.5], [0.1])], KEY, None)
    assert len(blocks) == 2 and "no evaluation.labeler" in blocks[1].text
    assert not (tmp_path / "plots").exists()
