"""The shipped experiment files validate and their arms are the variants they name."""

from __future__ import annotations

from pathlib import Path

from alignzoo.config.loader import load_experiment

ROOT = Path(__file__).resolve().parents[3]


def test_grpo_ablation_arms_are_the_three_variants() -> None:
    loaded = load_experiment(ROOT / "experiments" / "grpo_ablation.yaml")
    spec = loaded.spec
    assert list(spec.arms) == ["grpo", "dr_grpo", "clip_higher"]
    assert spec.baseline_arm == "grpo"
    assert len(spec.seeds) >= 2
    grpo = loaded.components["grpo"]["algorithm"].params
    dr = loaded.components["dr_grpo"]["algorithm"].params
    clip = loaded.components["clip_higher"]["algorithm"].params
    assert (grpo.scale_rewards, grpo.clip_eps_high) == ("group", 0.2)
    assert (dr.scale_rewards, dr.loss_aggregation) == ("none", "seq-mean-token-sum-norm")
    assert clip.clip_eps_high == 0.28 and clip.scale_rewards == "group"
    # Only the algorithm params differ between arms: same training, model, labeler.
    arms = list(spec.arms.values())
    assert all(a.training == arms[0].training and a.model == arms[0].model for a in arms)
    assert {a.labeler.name for a in arms} == {"arithmetic"}


def test_quickstart_compares_seven_algorithms_on_one_world() -> None:
    loaded = load_experiment(ROOT / "experiments" / "quickstart.yaml")
    spec = loaded.spec
    algorithms = {arm: a.algorithm.name for arm, a in spec.arms.items()}
    assert algorithms == {
        "grpo": "grpo",
        "dr_grpo": "grpo",
        "ppo": "ppo",
        "rloo": "rloo",
        "dpo_online": "dpo",
        "kto_online": "kto",
        "simpo_online": "simpo",
    }
    dr = loaded.components["dr_grpo"]["algorithm"].params
    assert (dr.scale_rewards, dr.loss_aggregation) == ("none", "seq-mean-token-sum-norm")
    # Eight seeds: the exact sign-flip test's smallest p (2/2^8) is below Holm's first
    # threshold 0.05/6 for the six comparisons with the baseline.
    assert len(spec.seeds) == 8 and 2 / 2 ** len(spec.seeds) < 0.05 / (len(spec.arms) - 1)
    # One world for every arm: the sloppy-teacher warm start, the same data and budget.
    arms = list(spec.arms.values())
    assert all(a.model == arms[0].model for a in arms)
    assert arms[0].model.embedded.sft_slip > 0
    assert {a.labeler.name for a in arms} == {"arithmetic"}
    assert spec.data.online
