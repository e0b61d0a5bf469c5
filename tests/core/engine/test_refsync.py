"""The moving reference (``training.sync_ref_model``, core/engine/refsync.py): TR-DPO's soft
update against a direct computation (a plain actor, tied embeddings, a LoRA actor's merged
weights, an FSDP2-sharded actor), the optimizer steps after which the learner syncs, the
checkpoint round trip of the moved weights, and the settings ``alignzoo validate`` refuses.
The runs (resume, the sync's effect on the reference's log-probs) are in test_refsync_run.py;
the parity with TRL's SyncRefModelCallback in tests/parity/test_trl_sync_ref_model.py."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.checkpoint import (
    CheckpointError,
    TrainingState,
    check_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from alignzoo.engine.learner import Learner, build_learner, fully_shard_model
from alignzoo.engine.models import Models, freeze
from alignzoo.engine.refsync import mix_into_reference, sync_due, syncs_done
from alignzoo.errors import ConfigError, RunError

from ..test_weights import tiny_qwen
from .conftest import tiny_experiment


def _moved(model: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    """``model`` with every parameter shifted by seeded noise (another point of training)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return model


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _mixed(
    policy: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """TR-DPO's π_ref = α π_θ + (1 - α) π_ref_prev, tensor by tensor, written out."""
    return {name: alpha * policy[name] + (1 - alpha) * reference[name] for name in reference}


def _assert_params(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = _params(model)
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("alpha", [0.6, 0.25, 1.0])
def test_the_reference_becomes_alpha_policy_plus_one_minus_alpha_reference(
    tied: bool, alpha: float
) -> None:
    actor, reference = _moved(tiny_qwen(tied), seed=1), freeze(_moved(tiny_qwen(tied), seed=2))
    policy_before, reference_before = _params(actor), _params(reference)
    buffers = {name: b.clone() for name, b in reference.named_buffers()}
    assert any(not torch.equal(policy_before[n], t) for n, t in reference_before.items())

    mix_into_reference(reference, actor, alpha)

    _assert_params(reference, _mixed(policy_before, reference_before, alpha))
    _assert_params(actor, policy_before)  # the policy is only read
    for name, buffer in reference.named_buffers():  # parameters only, as TRL's callback
        assert torch.equal(buffer, buffers[name]), name
    if tied:  # one tensor, mixed once, still shared by both names
        assert reference.lm_head.weight is reference.model.embed_tokens.weight
    if alpha == 1.0:  # a hard copy
        for name, tensor in _params(reference).items():
            assert torch.equal(tensor, policy_before[name]), name


def test_each_tensor_is_cast_to_the_references_dtype() -> None:
    actor = _moved(tiny_qwen(), seed=1)
    reference = freeze(_moved(tiny_qwen(), seed=2)).to(torch.bfloat16)
    expected = _mixed(_params(actor), {n: t.float() for n, t in _params(reference).items()}, 0.6)
    mix_into_reference(reference, actor, 0.6)
    for name, tensor in _params(reference).items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor.float(), expected[name], atol=2e-2, rtol=1e-2)


def test_a_lora_actor_is_mixed_in_with_its_adapters_merged() -> None:
    peft = pytest.importorskip("peft")
    base = _moved(tiny_qwen(), seed=1)
    lora = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_()  # adapters that change the model (B starts at zero)
    merged = _params(copy.deepcopy(lora).merge_and_unload())
    reference = freeze(_moved(tiny_qwen(), seed=2))
    before = _params(reference)

    mix_into_reference(reference, lora, 0.6)

    _assert_params(reference, _mixed(merged, before, 0.6))
    assert not torch.allclose(
        merged["model.layers.0.self_attn.q_proj.weight"],
        _params(base)["model.layers.0.self_attn.q_proj.weight"],
    ), "premise: the adapters change the weights mixed in"


def test_an_fsdp2_sharded_actor_mixes_in_its_gathered_weights(one_process_group: None) -> None:
    plain = _moved(tiny_qwen(), seed=1)
    shards = fully_shard_model(copy.deepcopy(plain))
    one, two = freeze(_moved(tiny_qwen(), seed=2)), freeze(_moved(tiny_qwen(), seed=2))
    mix_into_reference(one, plain, 0.6)
    mix_into_reference(two, shards, 0.6)
    for (name, a), (_, b) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_reference_that_is_not_the_policys_model_is_refused() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    other = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=48,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=32,
        )
    )
    with pytest.raises(RunError, match=r"training.sync_ref_model: the reference's .* has shape"):
        mix_into_reference(other, tiny_qwen(), 0.6)
    deeper = tiny_qwen()
    deeper.model.layers.append(copy.deepcopy(deeper.model.layers[0]))
    with pytest.raises(RunError, match=r"the policy has no weights for the reference's model\.lay"):
        mix_into_reference(deeper, tiny_qwen(), 0.6)


def test_the_syncs_follow_the_optimizer_step_count() -> None:
    cfg = TrainingConfig(sync_ref_model=True, ref_model_sync_steps=3)
    assert [v for v in range(10) if sync_due(cfg, v)] == [3, 6, 9]
    assert [syncs_done(cfg, v) for v in (0, 2, 3, 5, 6, 9, 10)] == [0, 0, 1, 1, 2, 3, 3]
    off = TrainingConfig(ref_model_sync_steps=3)
    assert not any(sync_due(off, v) for v in range(10)) and syncs_done(off, 9) == 0


def _learner(
    cfg: TrainingConfig, seed: int = 2
) -> tuple[torch.nn.Module, torch.nn.Module, Learner]:
    actor = tiny_qwen().train()
    reference = freeze(_moved(tiny_qwen(), seed=seed))
    models = Models(tokenizer=None, actor=actor, policy_path="", reference=reference)
    return actor, reference, build_learner(models, cfg, None, seed=0)


def _optimizer_step(actor: torch.nn.Module, learner: Learner, k: int) -> None:
    ids = (torch.arange(12).reshape(2, 6) * (k + 1)) % 48
    actor(input_ids=ids, labels=ids).loss.backward()
    learner.step()
    learner.optimizer.zero_grad()


def test_the_learner_syncs_after_the_optimizer_steps_whose_count_is_a_multiple() -> None:
    cfg = TrainingConfig(
        lr=1e-2, sync_ref_model=True, ref_model_sync_steps=3, ref_model_mixup_alpha=0.5
    )
    actor, reference, learner = _learner(cfg)
    synced = []
    for k in range(1, 9):
        before = _params(reference)
        _optimizer_step(actor, learner, k)
        assert learner.version == k
        after = _params(reference)
        if any(not torch.equal(after[n], before[n]) for n in after):
            synced.append(k)  # mixed with the weights this very optimizer step wrote
            _assert_params(reference, _mixed(_params(actor), before, 0.5))
    assert synced == [3, 6]


def test_a_resumed_learner_keeps_the_count_of_optimizer_steps() -> None:
    cfg = TrainingConfig(lr=1e-2, sync_ref_model=True, ref_model_sync_steps=3)
    actor, reference, learner = _learner(cfg)
    learner.version = 5  # as a checkpoint restores it
    before = _params(reference)
    _optimizer_step(actor, learner, 1)  # version 6: due
    assert any(not torch.equal(t, before[n]) for n, t in _params(reference).items())


def test_a_checkpoint_holds_the_moved_reference_and_restores_it(tmp_path: Path) -> None:
    cfg = TrainingConfig(lr=1e-2, sync_ref_model=True, ref_model_sync_steps=1)
    actor, reference, learner = _learner(cfg)
    _optimizer_step(actor, learner, 1)
    moved = _params(reference)
    optimizer, scheduler = learner.optimizer, learner.scheduler
    state = TrainingState(step=1)
    folder = save_checkpoint(
        tmp_path, state, actor, None, optimizer, scheduler, {}, reference=reference
    )
    check_checkpoint(folder, critic=False, reference=True)
    fresh_actor, fresh_reference, fresh = _learner(cfg, seed=3)
    assert any(not torch.equal(t, moved[n]) for n, t in _params(fresh_reference).items())
    load_checkpoint(
        folder, fresh_actor, None, fresh.optimizer, fresh.scheduler, {}, reference=fresh_reference
    )
    for name, tensor in _params(fresh_reference).items():
        assert torch.equal(tensor, moved[name]), name
    assert fresh_reference.lm_head.weight is fresh_reference.model.embed_tokens.weight
    (folder / "reference.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"reference\.safetensors is missing"):
        check_checkpoint(folder, critic=False, reference=True)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("training", "field", "says"),
    [
        ({"ref_model_mixup_alpha": 0.0}, "ref_model_mixup_alpha", "greater than 0"),
        ({"ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha", "less than or equal to 1"),
        ({"ref_model_sync_steps": 0}, "ref_model_sync_steps", "greater than 0"),
    ],
)
def test_out_of_range_settings_are_refused_naming_the_field(
    write_experiment, training, field, says
) -> None:
    spec = tiny_experiment(training={"sync_ref_model": True, **training})
    with pytest.raises(ConfigError) as caught:
        load_experiment(write_experiment(spec))
    assert f"training.{field}" in str(caught.value) and says in str(caught.value)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "grpo", "params": {"beta": 0.0}},
        {"name": "dpo", "params": {"reference_free": True}},
        "simpo",
    ],
)
def test_a_sync_without_a_reference_is_refused(write_experiment, algorithm) -> None:
    spec = tiny_experiment(
        arms={"a": {"algorithm": algorithm, "training": {"sync_ref_model": True}}}
    )
    with pytest.raises(ConfigError) as caught:
        load_experiment(write_experiment(spec))
    message = str(caught.value)
    assert "arms.a.training.sync_ref_model" in message and "no reference to sync" in message


def test_an_arm_with_a_reference_may_sync(write_experiment) -> None:
    spec = tiny_experiment(
        training={"sync_ref_model": True},
        arms={arm: {"algorithm": arm} for arm in ("grpo", "dpo", "kto", "ppo")},
    )
    loaded = load_experiment(write_experiment(spec))
    for arm in ("grpo", "dpo", "kto", "ppo"):
        training = loaded.spec.arms[arm].training
        assert training.sync_ref_model and training.ref_model_mixup_alpha == 0.6
        assert training.ref_model_sync_steps == 512


def test_validate_names_the_field_and_its_line(write_experiment, engine_cache) -> None:
    spec = tiny_experiment(
        arms={
            "grpo": {
                "algorithm": {"name": "grpo", "params": {"beta": 0}},
                "training": {"sync_ref_model": True},
            }
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "alignzoo", "validate", str(write_experiment(spec))],
        capture_output=True,
        text=True,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "arms.grpo.training.sync_ref_model" in output and "exp.yaml:" in output, output
    assert "Traceback" not in output
