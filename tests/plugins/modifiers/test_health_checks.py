"""HealthChecks fires on each bad metric sequence, stays silent on a healthy run, survives resume."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from alignzoo.engine.context import RunContext
from alignzoo.plugins.modifiers.health_checks import SIGNALS, HealthChecks


def make_run(tmp_path: Path) -> SimpleNamespace:
    """What the modifier uses of a RunContext, with the real ``record`` writer."""
    console = Console(file=io.StringIO(), width=300, color_system=None)
    run = SimpleNamespace(
        name="exp/arm/seed-0", out_dir=tmp_path, console=console, state={}, step=0
    )
    run.record = lambda stream, row: RunContext.record(run, stream, row)  # type: ignore[arg-type]
    return run


def healthy(step: int) -> dict[str, float]:
    """A run that learns: reward climbs and plateaus, std narrows, KL small and flat."""
    wiggle = 0.01 * math.sin(step * 1.7)
    return {
        "reward/mean": 0.2 + 0.6 * (1 - math.exp(-step / 30)) + wiggle,
        "reward/std": 0.4 * math.exp(-step / 60) + 0.05 + wiggle / 2,
        "response_length/mean": 12 + 2 * math.sin(step / 9),
        "entropy": 0.6 - 0.002 * step + wiggle,
        "kl/ref": 0.02 + 0.005 * math.sin(step / 3),
        "loss": 0.1,
    }


def drive(
    hc: HealthChecks, run: SimpleNamespace, seq: list[dict[str, float]], start: int = 1
) -> list[dict[str, float]]:
    out = []
    for i, metrics in enumerate(seq, start=start):
        metrics = dict(metrics)
        run.step = i
        hc.on_step_end(run=run, step=i, metrics=metrics)
        out.append(metrics)
    return out


def fired(run: SimpleNamespace) -> dict[str, dict[str, Any]]:
    path = run.out_dir / "health.jsonl"
    if not path.exists():
        return {}
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return {line["signal"]: line for line in lines}


def test_healthy_run_is_silent(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    out = drive(HealthChecks(), run, [healthy(s) for s in range(1, 201)])
    assert fired(run) == {}
    assert not any(k.startswith("health/") for m in out for k in m)
    assert run.console.file.getvalue() == ""
    json.dumps(run.state)  # the state is JSON-serialisable


def with_(step: int, **changes: float) -> dict[str, float]:
    m = healthy(step)
    m.update(changes)
    return m


def test_reward_collapse(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seq = []
    for s in range(1, 81):
        r = 0.2 + 0.01 * s if s <= 40 else 0.6 - 0.03 * (s - 40)  # peak 0.6 at step 40
        seq.append(with_(s, **{"reward/mean": max(r, 0.0)}))
    out = drive(HealthChecks(), run, seq)
    got = fired(run)
    assert set(got) == {"reward_collapse"}
    assert 38 <= got["reward_collapse"]["began_step"] <= 45  # began at the peak
    detected = got["reward_collapse"]["detected_step"]
    assert out[detected - 1]["health/reward_collapse"] == 1.0
    assert sum("health/reward_collapse" in m for m in out) == 1  # once only
    text = run.console.file.getvalue()
    assert "exp/arm/seed-0" in text and "reward_collapse" in text
    assert f"step {got['reward_collapse']['step']}" in text


def test_reward_that_never_rose_is_not_a_collapse(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seq = [with_(s, **{"reward/mean": 0.5 - 0.004 * s}) for s in range(1, 81)]
    drive(HealthChecks(), run, seq)
    assert "reward_collapse" not in fired(run)


def test_length_drift(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seq = [with_(s, **{"response_length/mean": 10.0 * 1.08**s}) for s in range(1, 60)]
    drive(HealthChecks(), run, seq)
    assert "length_drift" in fired(run)


def test_entropy_collapse(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seq = [with_(s, entropy=max(0.5 - 0.02 * s, 0.0)) for s in range(1, 60)]
    drive(HealthChecks(), run, seq)
    got = fired(run)
    assert set(got) == {"entropy_collapse"}
    assert got["entropy_collapse"]["began_step"] >= 25


def test_entropy_explosion_by_rise_and_by_ceiling(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    drive(HealthChecks(), run, [with_(s, entropy=0.3 * 1.1**s) for s in range(1, 60)])
    assert "entropy_explosion" in fired(run)

    run2 = make_run(tmp_path / "b")
    seq = [with_(s, entropy=0.5 if s < 30 else 4.0) for s in range(1, 40)]
    drive(HealthChecks({"entropy_ceiling": 2.0, "entropy_rise": None}), run2, seq)
    got = fired(run2)
    assert "entropy_explosion" in got and got["entropy_explosion"]["began_step"] >= 30


def test_kl_runaway_above_max(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seq = [with_(s, **{"kl/ref": 0.02 if s < 30 else 3.0}) for s in range(1, 40)]
    drive(HealthChecks({"kl_growth": None}), run, seq)
    got = fired(run)
    assert set(got) == {"kl_runaway"} and got["kl_runaway"]["began_step"] >= 30


def test_kl_runaway_growing_monotonically(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seq = [with_(s, **{"kl/ref": 0.01 * 1.05**s}) for s in range(1, 60)]  # stays below kl_max = 1
    drive(HealthChecks(), run, seq)
    assert "kl_runaway" in fired(run)


def test_kl_leaving_the_reference_and_levelling_off_is_healthy(tmp_path: Path) -> None:
    """Every run's KL starts at 0, rises smoothly and levels off: not a runaway."""
    run = make_run(tmp_path)
    seq = [with_(s, **{"kl/ref": 0.05 * (1 - math.exp(-s / 15))}) for s in range(1, 151)]
    drive(HealthChecks(), run, seq)
    assert fired(run) == {}


def test_kl_runaway_from_near_zero_is_caught_once_it_matters(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seq = [
        with_(s, **{"kl/ref": 0.001 * 1.08**s}) for s in range(1, 80)
    ]  # 0.001 -> 0.4, below kl_max
    drive(HealthChecks(), run, seq)
    got = fired(run)
    assert set(got) == {"kl_runaway"}
    began = got["kl_runaway"]["began_step"]
    assert 0.001 * 1.08**began >= 0.008  # the window starts where KL reached about kl_min


def test_reward_std_not_narrowing(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seq = [
        with_(s, **{"reward/std": 0.45 + 0.01 * math.sin(s), "reward/mean": 0.3})
        for s in range(1, 80)
    ]
    drive(HealthChecks(), run, seq)
    got = fired(run)
    assert set(got) == {"reward_std_flat"}
    assert got["reward_std_flat"]["detected_step"] == 50


def test_reward_std_check_is_skipped_for_binary_rewards(tmp_path: Path) -> None:
    """0/1 rewards: the std is sqrt(p (1 - p)), so a flat std only repeats a flat mean."""
    run = make_run(tmp_path)
    means = [0.3 + 0.01 * math.sin(s) for s in range(1, 80)]
    seq = [
        with_(s, **{"reward/mean": m, "reward/std": math.sqrt(m * (1 - m))})
        for s, m in zip(range(1, 80), means, strict=True)
    ]
    drive(HealthChecks(), run, seq)
    assert "reward_std_flat" not in fired(run)


def test_disabled_and_threshold_off(tmp_path: Path) -> None:
    seq = [with_(s, entropy=max(0.5 - 0.02 * s, 0.0)) for s in range(1, 60)]
    run = make_run(tmp_path)
    drive(HealthChecks({"enabled": False}), run, seq)
    assert fired(run) == {} and run.state == {}
    run2 = make_run(tmp_path / "b")
    drive(HealthChecks({"entropy_floor": None}), run2, seq)
    assert "entropy_collapse" not in fired(run2)


def test_state_survives_resume(tmp_path: Path) -> None:
    """Stopping, round-tripping the state through JSON and continuing fires at the same step."""
    seq = [with_(s, entropy=max(0.5 - 0.02 * s, 0.0)) for s in range(1, 60)]
    straight = make_run(tmp_path / "a")
    drive(HealthChecks(), straight, seq)

    resumed = make_run(tmp_path / "b")
    drive(HealthChecks(), resumed, seq[:20])
    resumed.state = json.loads(json.dumps(resumed.state))
    drive(HealthChecks(), resumed, seq[20:], start=21)
    assert fired(resumed) == fired(straight) != {}


def test_missing_metrics_are_ignored(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    drive(HealthChecks(), run, [{"loss": 1.0, "kl/ref": float("nan")} for _ in range(60)])
    assert fired(run) == {}


def test_component_contract() -> None:
    assert HealthChecks.kind == "modifier"
    assert HealthChecks.default_on is True
    assert len(SIGNALS) == 6
    with pytest.raises(ValueError):
        HealthChecks({"kl_maxx": 1.0})
