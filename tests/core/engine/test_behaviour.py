"""The behaviour policy (alignzoo.engine.behaviour): each strategy (at generation, a separate
pass, fused with the update) gives a batch the same behaviour columns and metrics; the fused
snapshot (the update's own forward passes, when a batch is trained on once in one optimizer
step) gives a run the numbers of the separate pass and is refused wherever it would not; the
policy version counts optimizer steps, is recorded by every sampled batch and survives a
resume."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from alignzoo import metrics as canonical
from alignzoo.batch import RolloutBatch
from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import EmbeddedModelConfig, ModelConfig, TrainingConfig
from alignzoo.engine.behaviour import AtGeneration, FusedWithUpdate, SeparatePass, fuses_behaviour
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.learner import Learner, build_scheduler
from alignzoo.engine.loop import run_one
from alignzoo.engine.models import Models, load_models
from alignzoo.engine.modes import select_mode
from alignzoo.engine.scoring import Scorer
from alignzoo.engine.tokenize import tokenized_batch
from alignzoo.engine.update import update
from alignzoo.ops import sampling_rows
from alignzoo.registry import build_plugin_manager, get_registry
from alignzoo.types import AlgorithmRequirements
from alignzoo.world.model import build_model, save_policy
from alignzoo.world.tokenizer import build_tokenizer

from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

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


# --------------------------------------------------------------------------- the strategies

TINY = EmbeddedModelConfig(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_steps=0, seed=7
)
PROMPTS = ["1+2=", "12+7=", "3+45=", "100+250=", "9+9=", "5+5=", "40+2=", "7+77="]
RESPONSES = ["3", "19", "48", "350", "18", "10", "42", "84"]
BEHAVIOUR_COLUMNS = ("old_logprobs", "entropy", "ref_logprobs", "response_mask")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """A tiny untrained policy and its reference (the same weights, frozen)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny") / "policy"
    save_policy(build_model(TINY, tokenizer), tokenizer, folder)
    config = ModelConfig(attn_implementation="eager")
    return load_models(str(folder), config, {"actor": "cpu", "ref": "cpu"}, True, False, seed=0)


def _grpo() -> tuple[Hooks, AlgorithmRequirements]:
    hooks = Hooks(build_plugin_manager([get_registry().get("algorithm", "grpo")({})]), "grpo")
    return hooks, hooks.algorithm_requirements()


def _learner(models: Models, **training: Any) -> Learner:
    """SGD at lr 0: the weights never move, the optimizer steps are counted."""
    cfg = TrainingConfig(lr=0.0, max_grad_norm=None, **training)
    optimizer = torch.optim.SGD(models.actor.parameters(), lr=0.0)
    return Learner(models, optimizer, build_scheduler(optimizer, cfg, None), cfg, seed=0)


def _batch(models: Models, sampling: str) -> RolloutBatch:
    batch = tokenized_batch(models.tokenizer, PROMPTS, RESPONSES, [{}] * 8, max_new_tokens=8)
    batch.group_ids = torch.arange(8) // 4
    batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    batch.score_valid = torch.ones(8, dtype=torch.bool)
    if sampling == "warped":  # tokens outside top-k 3 are masked and counted by every strategy
        batch.sampling = sampling_rows(0.7, 3, 0.9, batch.size)
    return batch


@pytest.mark.parametrize("sampling", ["default", "warped"])
def test_every_strategy_gives_a_batch_the_same_behaviour_columns_and_metrics(models, sampling):
    """The same batch through each strategy, at the point of the step where it acts (at
    collection, before the update, inside the update): the same old log-probs, entropy,
    reference log-probs and trained-token mask, and the same canonical metrics."""
    hooks, req = _grpo()
    mode = select_mode(req, online=True)
    scorer = Scorer(models, micro_batch_size=3)
    columns: dict[str, RolloutBatch] = {}
    metrics: dict[str, dict[str, float]] = {}
    for strategy in (AtGeneration, SeparatePass, FusedWithUpdate):
        behaviour = strategy(scorer, online=True)
        batch = _batch(models, sampling)
        found = behaviour.at_collection(batch)
        found.update(behaviour.before_update(batch))
        batch = hooks.compute_advantages(batch)
        learner = _learner(models, micro_batch_size=3)
        trained = update(learner, hooks, req, mode, batch, 1, behaviour)
        found.update(
            {k: v for k, v in trained.items() if k.startswith(("entropy", "kl/", "rollout/"))}
        )
        columns[strategy.__name__], metrics[strategy.__name__] = batch, found
    expected = [canonical.ENTROPY, canonical.KL_REF]
    if sampling == "warped":
        expected.append(canonical.ROLLOUT_OUTSIDE_SUPPORT)
        masked = (
            columns["SeparatePass"].response_mask.sum()
            < _batch(models, sampling).response_mask.sum()
        )
        assert masked, "premise: some sampled tokens lie outside the support"
    separate = columns.pop("SeparatePass")
    reference = metrics.pop("SeparatePass")
    assert sorted(reference) == sorted(expected)
    for name, batch in columns.items():
        for column in BEHAVIOUR_COLUMNS:
            got, want = getattr(batch, column), getattr(separate, column)
            torch.testing.assert_close(
                got.float(), want.float(), atol=1e-5, rtol=0, msg=f"{name} {column}"
            )
        assert sorted(metrics[name]) == sorted(expected), name
        for key in expected:
            assert metrics[name][key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), (
                name,
                key,
            )


@pytest.mark.parametrize(
    ("training", "optimizer_steps"),
    [
        ({"micro_batch_size": 8}, 1),  # the whole batch at once
        ({"micro_batch_size": 2}, 1),  # four micro-batches accumulated into one step
        ({"micro_batch_size": 2, "minibatch_size": 4}, 2),
        ({"micro_batch_size": 3, "minibatch_size": 4, "epochs": 2}, 4),
    ],
)
def test_the_policy_version_counts_optimizer_steps_not_micro_batches(
    models, training, optimizer_steps
):
    hooks, req = _grpo()
    mode = select_mode(req, online=True)
    learner = _learner(models, **training)
    behaviour = SeparatePass(Scorer(models, 4), online=True)
    for step in (1, 2):
        batch = _batch(models, "default")
        behaviour.before_update(batch)
        update(learner, hooks, req, mode, hooks.compute_advantages(batch), step, behaviour)
        assert learner.version == step * optimizer_steps
        assert learner.version == learner.scheduler.last_epoch  # what an older checkpoint gives


def test_a_fused_snapshot_refuses_a_pass_after_an_optimizer_step(models):
    hooks, req = _grpo()
    mode = select_mode(req, online=True)
    batch = _batch(models, "default")
    behaviour = FusedWithUpdate(Scorer(models, 4), online=True)
    behaviour.before_update(batch)
    learner = _learner(models, micro_batch_size=4, minibatch_size=4)
    with pytest.raises(RuntimeError, match="one epoch and one optimizer step"):
        update(learner, hooks, req, mode, hooks.compute_advantages(batch), 1, behaviour)


# --------------------------------------------------------------------------- policy versions


def test_a_concatenated_batch_holds_the_oldest_known_version(models):
    """Replayed groups join a fresh batch: the mixture holds the oldest version among them; a
    group restored from a checkpoint without versions (None) leaves it to the others."""
    parts = [_batch(models, "default").select([i]) for i in range(3)]
    for part, version in zip(parts, (5, 2, None), strict=True):
        part.policy_version = version
    assert RolloutBatch.concat(parts).policy_version == 2
    assert RolloutBatch.concat(parts[2:]).policy_version is None
    assert parts[0].select([0]).to("cpu").policy_version == 5


class VersionRecorder:
    """A test plugin keeping (step, policy version) of each batch the step trains on."""

    seen: list[tuple[int, int | None]] = []  # noqa: RUF012 - shared with the test

    from alignzoo.plugin import hookimpl

    @hookimpl
    def transform_batch(self, batch, run):
        VersionRecorder.seen.append((run.step, batch.policy_version))


def _versions_run(write_experiment, overlap: bool, steps: int = 4):
    from importlib import metadata

    from alignzoo.plugin import Modifier
    from alignzoo.registry import ENTRY_POINT_GROUP, Registry

    class Versions(VersionRecorder, Modifier):
        pass

    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(Versions, "versions")
    spec = tiny_experiment(
        budget={"steps": steps},
        # 16 samples a step: two optimizer steps of two accumulated micro-batches each
        training={"micro_batch_size": 4, "minibatch_size": 8},
        arms={"grpo": {"algorithm": "grpo", "labeler": "arithmetic", "modifiers": ["versions"],
                       "labeling": {"overlap": overlap}}},
    )  # fmt: skip
    return load_experiment(
        write_experiment(spec, name=f"versions-{overlap}.yaml"), registry=registry
    )


def _checkpointed_version(out: Path, step: int) -> int:
    state = json.loads((out / "checkpoints" / f"step-{step:06d}" / "state.json").read_text())
    return state["policy_version"]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_each_batch_records_the_policy_version_that_sampled_it(write_experiment, tmp_path, overlap):
    """Two optimizer steps a step: a batch collected before step t's update was sampled by
    version 2 (t - 1); a look-ahead batch (labeling.overlap) by the version of one step
    earlier (the first two batches both by version 0). The checkpoint records the version, and
    a run resumed from it records the same ones."""
    loaded = _versions_run(write_experiment, overlap)
    out = tmp_path / "run"
    VersionRecorder.seen = []
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    expected = [(1, 0), (2, 0), (3, 2), (4, 4)] if overlap else [(1, 0), (2, 2), (3, 4), (4, 6)]
    assert VersionRecorder.seen == expected
    assert [_checkpointed_version(out, s) for s in (2, 4)] == [4, 8]
    back_to_checkpoint(out, 2)
    VersionRecorder.seen = []
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    assert VersionRecorder.seen == expected[2:]
    assert _checkpointed_version(out, 4) == 8


@pytest.mark.slow
def test_a_checkpoint_written_before_versions_were_recorded_resumes_with_the_same_ones(
    write_experiment, tmp_path
):
    """A state.json without ``policy_version`` (an older alignzoo's) resumes with the optimizer
    steps its schedule counted: the same versions and metrics as the uninterrupted run."""
    loaded = _versions_run(write_experiment, overlap=False)
    out = tmp_path / "run"
    VersionRecorder.seen = []
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    expected, metrics = VersionRecorder.seen, _stable(read_jsonl(out / "metrics.jsonl"))
    back_to_checkpoint(out, 2)
    state_file = out / "checkpoints" / "step-000002" / "state.json"
    state = json.loads(state_file.read_text())
    del state["policy_version"]
    state_file.write_text(json.dumps(state))
    VersionRecorder.seen = []
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    assert VersionRecorder.seen == expected[2:]
    assert _checkpointed_version(out, 4) == 8
    assert _stable(read_jsonl(out / "metrics.jsonl")) == metrics
