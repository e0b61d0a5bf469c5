"""The fused behaviour snapshot: when a batch is trained on once in one optimizer step, the
update's own forward passes give the behaviour log-probs and entropy, and the separate no-grad
pass is skipped. The numbers must be those of the separate pass, and the fusion must be refused
wherever they would not be."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from alignzoo import metrics as canonical
from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.loop import run_one
from alignzoo.engine.modes import select_mode
from alignzoo.engine.scoring import Scorer
from alignzoo.engine.update import fuses_behaviour
from alignzoo.types import AlgorithmRequirements

from .conftest import read_jsonl, tiny_experiment

VOLATILE = ("time_s", "timing/", "throughput/", "labeler/", "memory/")
ARMS = {
    "grpo": {"algorithm": "grpo"},  # beta 0.04: a reference, so kl/ref too
    "rloo": {"algorithm": {"name": "rloo", "params": {"kl_coef": 0.0}}},
    "ppo": {"algorithm": "ppo"},  # its advantages read old_logprobs: never fused
    "dpo_offline": {"algorithm": "dpo", "online": False},
    "kto_offline": {"algorithm": "kto", "online": False},
}


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


# Sampled at a temperature with top-k and top-p: the fused snapshot takes the warped log-probs
# and masks the tokens outside the trainer's support as the separate pass does.
WARPED = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_new_tokens": 4}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["default", "warped"])
def test_a_fused_snapshot_gives_the_numbers_of_the_separate_pass(
    write_experiment, tmp_path, monkeypatch, sampling
):
    arms = ARMS if sampling == "default" else {a: ARMS[a] for a in ("grpo", "rloo")}
    training = {} if sampling == "default" else {"sampling": WARPED}
    behaviour_passes = {"n": 0}
    original = Scorer.behaviour

    def counted(self, batch):
        behaviour_passes["n"] += 1
        return original(self, batch)

    monkeypatch.setattr(Scorer, "behaviour", counted)
    histories: dict[tuple[str, bool], list[dict]] = {}
    passes: dict[tuple[str, bool], int] = {}
    for fuse in (True, False):
        spec = tiny_experiment(
            budget={"steps": 3},
            training={"fuse_behaviour": fuse, "checkpoint_every": 3, **training},
            evaluation={"every": 3, "num_prompts": 4},
            arms=arms,
        )
        loaded = load_experiment(write_experiment(spec, name=f"{fuse}.yaml"))
        for arm in arms:
            behaviour_passes["n"] = 0
            out = tmp_path / f"{arm}-{fuse}"
            summary = run_one(loaded, arm, 0, out)
            assert summary.status == "finished", summary.error
            histories[arm, fuse] = _stable(read_jsonl(out / "metrics.jsonl"))
            passes[arm, fuse] = behaviour_passes["n"]
    for arm in arms:
        if arm == "ppo":
            assert passes[arm, True] == 3, "ppo was fused, though its advantages need the pass"
        else:
            assert passes[arm, True] == 0, (arm, "the fused run ran a separate behaviour pass")
        assert passes[arm, False] == 3, (arm, "premise: one separate pass per step without it")
        fused, separate = histories[arm, True], histories[arm, False]
        assert [sorted(r) for r in fused] == [sorted(r) for r in separate], arm
        for step, (a, b) in enumerate(zip(fused, separate, strict=True), start=1):
            for key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (arm, step, key)
        assert canonical.ENTROPY in fused[0], arm
        if sampling == "warped":  # counted by both paths alike (compared above)
            assert canonical.ROLLOUT_OUTSIDE_SUPPORT in fused[0], arm
    if sampling == "default":  # the warm start is its own reference
        assert histories["grpo", True][0][canonical.KL_REF] == pytest.approx(0.0, abs=1e-7)


def _decide(**overrides) -> bool:
    training = overrides.pop("training", {})
    requirements = overrides.pop("requirements", AlgorithmRequirements())
    online = overrides.pop("online", True)
    args = {
        "cfg": TrainingConfig(**training),
        "requirements": requirements,
        "mode": select_mode(requirements, online),
        "hooks": SimpleNamespace(transforms_batch=overrides.pop("transforms", False)),
        "dropout_off": overrides.pop("dropout_off", True),
        "overlapping": overrides.pop("overlapping", False),
    }
    assert not overrides
    return fuses_behaviour(**args)


def test_the_fusion_is_refused_wherever_a_separate_pass_would_differ():
    assert _decide()  # GRPO-like: one epoch, the whole batch in one optimizer step
    assert _decide(requirements=AlgorithmRequirements(data="preference"), online=False)
    assert _decide(requirements=AlgorithmRequirements(data="unpaired"), online=False)
    assert _decide(training={"prompts_per_step": 4, "samples_per_prompt": 4, "minibatch_size": 16})
    refused = {
        "switched off": {"training": {"fuse_behaviour": False}},
        "two epochs": {"training": {"epochs": 2}},
        "two optimizer steps": {
            "training": {"prompts_per_step": 4, "samples_per_prompt": 4, "minibatch_size": 8}
        },
        "dropout on": {"dropout_off": False},
        "a batch transform": {"transforms": True},
        "labeling overlap": {"overlapping": True},
        "advantages read old_logprobs (PPO)": {
            "requirements": AlgorithmRequirements(critic=True, old_logprobs_in_advantages=True)
        },
        "online pairs (select keeps only the pairs)": {
            "requirements": AlgorithmRequirements(data="preference")
        },
        "online unpaired (select relabels)": {
            "requirements": AlgorithmRequirements(data="unpaired")
        },
    }
    for why, overrides in refused.items():
        assert not _decide(**overrides), why


def test_ppo_and_kl_penalised_rloo_declare_that_their_advantages_read_old_logprobs():
    from alignzoo.plugins.algorithms.ppo import PPO
    from alignzoo.plugins.algorithms.rloo import RLOO

    assert PPO().algorithm_requirements().old_logprobs_in_advantages
    assert RLOO({"kl_coef": 0.05}).algorithm_requirements().old_logprobs_in_advantages
    assert not RLOO({"kl_coef": 0.0}).algorithm_requirements().old_logprobs_in_advantages
