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
    params = {
        "mask_truncated_completions": True,
        "delta": 1.5,
        "off_policy_mask_threshold": 0.2,
        "top_entropy_quantile": 0.5,
    }
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
    assert all("actor/off_policy_masked" in r for r in rows)
    assert all(0.3 < r["actor/entropy_kept"] < 0.7 for r in rows), "about half the tokens"
    cut = [r["actor/truncated_masked"] for r in rows]
    assert 0.0 < max(cut) < 1.0, f"premise: 3 new tokens cut some responses, not all ({cut})"


@pytest.mark.slow
def test_an_rloo_arm_with_the_options_and_an_adaptive_entropy_bonus_trains(
    write_experiment, tmp_path
) -> None:
    """The options on another algorithm, and the entropy bonus's controller in a real run:
    the coefficient is reported each step and moves by its step size."""
    params = {"mask_truncated_completions": True, "top_entropy_quantile": 0.2, "delta": 2.0}
    bonus = {"coef": 0.02, "use_adaptive_entropy": True, "entropy_target": 100.0}
    spec = tiny_experiment(
        budget={"steps": 3},
        training={"sampling": {"max_new_tokens": 3}},
        arms={
            "rloo": {
                "algorithm": {"name": "rloo", "params": params},
                "labeler": "arithmetic",
                "modifiers": [{"name": "entropy_bonus", "params": bonus}],
            }
        },
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "rloo", 0, out).status == "finished"
    rows = read_jsonl(out / "metrics.jsonl")
    # entropy below the (high) target: no bonus on the first optimizer step, then 0.025, 0.03
    assert [r["entropy_bonus/coef"] for r in rows] == pytest.approx([0.0, 0.025, 0.03])
    assert all(0.0 < r["actor/entropy_kept"] < 0.5 for r in rows)
    assert all("actor/truncated_masked" in r for r in rows)


@pytest.mark.slow
def test_an_adaptive_entropy_bonus_resumes_exactly(write_experiment, tmp_path) -> None:
    """The controller's coefficient and last entropy are checkpointed: stopped after step 2's
    checkpoint (checkpoints every 2 steps, the controller moves every step) and resumed, the
    run writes the uninterrupted run's metrics."""
    from .conftest import back_to_checkpoint

    bonus = {"coef": 0.02, "use_adaptive_entropy": True, "entropy_target": 100.0}
    spec = tiny_experiment(
        budget={"steps": 5},
        training={"checkpoint_every": 2},
        arms={
            "grpo": {
                "algorithm": {"name": "grpo", "params": {"top_entropy_quantile": 0.5}},
                "labeler": "arithmetic",
                "modifiers": [{"name": "entropy_bonus", "params": bonus}],
            }
        },
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    volatile = ("time_s", "timing/", "throughput/", "labeler/")

    def stable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in rows]

    reference = stable(read_jsonl(out / "metrics.jsonl"))
    coefs = [r["entropy_bonus/coef"] for r in reference]
    assert coefs == pytest.approx([0.0, 0.025, 0.03, 0.035, 0.04]), "premise: it moves"
    back_to_checkpoint(out, 2)
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    assert stable(read_jsonl(out / "metrics.jsonl")) == reference
