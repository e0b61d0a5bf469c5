"""experiments/grpo_ablation.yaml validates and its arms are the variants it names."""

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
