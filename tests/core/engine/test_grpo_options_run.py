"""GRPO with TRL's mask_truncated_completions, delta and off_policy_mask_threshold in a tiny
run: the engine records the budget's cuts on every sampled batch (through the look-ahead
labeling too), and the run trains."""

from __future__ import annotations

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

from .conftest import read_jsonl, tiny_experiment


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_a_grpo_arm_with_trls_options_trains(write_experiment, tmp_path, overlap) -> None:
    params = {"mask_truncated_completions": True, "delta": 1.5, "off_policy_mask_threshold": 0.2}
    spec = tiny_experiment(
        budget={"steps": 3},
        training={"epochs": 2, "sampling": {"max_new_tokens": 3}},  # short: some are cut
        arms={
            "grpo": {
                "algorithm": {"name": "grpo", "params": params},
                "labeler": "arithmetic",
                "labeling": {"overlap": overlap},
            }
        },
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("grpo/off_policy_masked" in r for r in rows)
    cut = [r["grpo/truncated_masked"] for r in rows]
    assert 0.0 < max(cut) < 1.0, f"premise: 3 new tokens cut some responses, not all ({cut})"
