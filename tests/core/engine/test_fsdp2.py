"""FSDP2 pieces in one process (a gloo group of one rank): the units it shards, checkpoints
gathered through torch.distributed.checkpoint in the very layout of an unsharded run (so
either resumes the other), and a LoRA arm refused at validate. The 2-process equality and
resume runs are in test_data_parallel.py; the hf backend's copy of a sharded actor in
tests/plugins/backends/test_hf.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignzoo.config.loader import load_experiment
from alignzoo.engine.checkpoint import (
    TrainingState,
    gather_sharded,
    load_checkpoint,
    save_checkpoint,
)
from alignzoo.engine.learner import fully_shard_model, shard_units
from alignzoo.errors import ConfigError
from alignzoo.weights import PolicyWeights, is_sharded

from ..test_weights import tiny_qwen
from .conftest import tiny_experiment


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.arange(12).reshape(2, 6) % 40
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _adamw(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def test_the_units_are_the_decoder_layers() -> None:
    model = tiny_qwen()
    assert shard_units(model) == list(model.model.layers) and len(model.model.layers) == 2


@pytest.mark.parametrize("tied", [True, False])
def test_a_sharded_checkpoint_is_an_unsharded_runs_checkpoint(
    one_process_group: None, tmp_path: Path, tied: bool
) -> None:
    plain = tiny_qwen(tied).train()
    shards = fully_shard_model(copy.deepcopy(plain))
    assert is_sharded(shards) and not is_sharded(plain)
    (opt_plain, sched_plain), (opt_shards, sched_shards) = _adamw(plain), _adamw(shards)
    for _ in range(2):
        _train_step(plain, opt_plain)
        _train_step(shards, opt_shards)

    gathered = gather_sharded(shards, None, opt_shards)
    assert gathered is not None
    expected = opt_plain.state_dict()  # torch's own layout, by parameter index
    assert gathered.optimizer["param_groups"] == expected["param_groups"]
    assert set(gathered.optimizer["state"]) == set(expected["state"])
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(gathered.optimizer["state"][index][key], value)

    state = TrainingState(step=2)
    one = save_checkpoint(tmp_path / "plain", state, plain, None, opt_plain, sched_plain, {})
    two = save_checkpoint(
        tmp_path / "sharded", state, shards, None, opt_shards, sched_shards, {}, gathered
    )
    w1, w2 = load_file(str(one / "actor.safetensors")), load_file(str(two / "actor.safetensors"))
    assert set(w1) == set(w2)
    assert (len(w1) < len(plain.state_dict())) == tied  # a tied tensor is saved once
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name])

    # The unsharded run's checkpoint resumes a sharded model, and the reverse; one more step
    # of each then equals one more step of the model that never stopped.
    fresh = fully_shard_model(tiny_qwen(tied).train())
    back = tiny_qwen(tied).train()
    for model, folder in ((fresh, one), (back, two)):
        optimizer, scheduler = _adamw(model)
        load_checkpoint(folder, model, None, optimizer, scheduler, {})
        _train_step(model, optimizer)
    _train_step(plain, opt_plain)
    reference = plain.state_dict()
    for model in (fresh, back):
        streamed = PolicyWeights(model, 3).state_dict()
        for name, tensor in reference.items():
            torch.testing.assert_close(streamed[name], tensor, msg=name)


def test_fsdp2_refuses_lora_at_validate(write_experiment) -> None:
    spec = tiny_experiment(
        arms={"a": {"algorithm": "grpo", "training": {"parallel": "fsdp2"}}},
        model={"lora": {"r": 2, "alpha": 4}},
    )
    with pytest.raises(ConfigError, match=r"arms.a.training.parallel: fsdp2 does not shard LoRA"):
        load_experiment(write_experiment(spec))
