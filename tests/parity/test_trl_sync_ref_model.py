"""Parity of alignzoo's moving reference (``training.sync_ref_model``) with TRL 1.16.0's.

TRL's DPOTrainer, GRPOTrainer and KTOTrainer (and RLOO's) all install the same
``SyncRefModelCallback``; its ``on_step_end`` mixes the policy into the reference after every
optimizer step whose ``global_step`` is a multiple of ``ref_model_sync_steps``. Here a real
DPOTrainer is built with ``sync_ref_model=True`` around a tiny Qwen2 and a reference of other
weights, and its own callback is driven through optimizer steps 1..8 while alignzoo's learner
takes the same steps (the policy's weights set to the same new values before each, as an
optimizer step would): after every step the two references hold the same parameters (1e-6;
bit-identical on the CPUs tried), and both moved after exactly the same steps. Mapping, field for
field: ``sync_ref_model``, ``ref_model_mixup_alpha``, ``ref_model_sync_steps`` ↔ the same names
under ``training``; TRL's ``global_step`` ↔ the learner's policy version (optimizer steps).

Pinned to trl 1.16.0 by test_trl_parity.py (importing it fails the module on another version).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import datasets
import pytest
import torch
from trl import GRPOConfig, KTOConfig
from trl.trainer.callbacks import SyncRefModelCallback

from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.learner import build_learner
from alignzoo.engine.models import Models, freeze
from tests.parity import test_trl_parity as parity
from tests.parity.test_trl_parity import PREFERENCE_ROWS, DPOConfig, DPOTrainer, tiny_model

tokenizer, trl_args = parity.tokenizer, parity.trl_args

FIELDS = ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")


@pytest.mark.parametrize("config", [DPOConfig, GRPOConfig, KTOConfig])
def test_the_defaults_are_trls(config: Any) -> None:
    theirs = {f.name: f.default for f in dataclasses.fields(config) if f.name in FIELDS}
    ours = TrainingConfig()
    assert theirs == {f: getattr(ours, f) for f in FIELDS}
    assert (ours.sync_ref_model, ours.ref_model_mixup_alpha, ours.ref_model_sync_steps) == (
        False,
        0.6,
        512,
    )


def _noise(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """New values for every parameter of ``model`` (seeded): what an optimizer step writes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + 0.05 * torch.randn(p.shape, generator=generator)
        for name, p in model.named_parameters()
    }


@torch.no_grad()
def _set(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        param.copy_(values[name])


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("alpha", "every"),
    [(None, 3), (0.25, 2), (1.0, 3)],  # None: TRL's default α (0.6)
)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_reference_moves_as_trls_callback_moves_it(
    tokenizer: Any, trl_args: dict[str, Any], alpha: float | None, every: int, seed: int
) -> None:
    sync = {"ref_model_sync_steps": every}
    if alpha is not None:
        sync["ref_model_mixup_alpha"] = alpha
    start = tiny_model(len(tokenizer))
    reference = tiny_model(len(tokenizer))
    _set(reference, _noise(reference, seed=100 + seed))  # a reference away from the policy
    trainer = DPOTrainer(
        start,
        ref_model=reference,
        args=DPOConfig(**trl_args, sync_ref_model=True, **sync),
        train_dataset=datasets.Dataset.from_dict(PREFERENCE_ROWS),
        processing_class=tokenizer,
    )
    (callback,) = [
        c for c in trainer.callback_handler.callbacks if isinstance(c, SyncRefModelCallback)
    ]
    theirs = callback.ref_model

    actor, ours = tiny_model(len(tokenizer)), freeze(tiny_model(len(tokenizer)))
    _set(actor, _params(trainer.model))
    _set(ours, _params(theirs))
    cfg = TrainingConfig(
        lr=0.0,
        sync_ref_model=trainer.args.sync_ref_model,
        ref_model_mixup_alpha=trainer.args.ref_model_mixup_alpha,
        ref_model_sync_steps=trainer.args.ref_model_sync_steps,
    )
    learner = build_learner(Models(None, actor, "", reference=ours), cfg, None, seed=0)
    moved: dict[str, list[int]] = {"trl": [], "alignzoo": []}
    for step in range(1, 9):
        weights = _noise(trainer.model, seed=1000 * seed + step)
        _set(trainer.model, weights)  # the optimizer step, on both sides
        _set(actor, weights)
        before = {"trl": _params(theirs), "alignzoo": _params(ours)}
        trainer.state.global_step = step  # what TRL's loop does before on_step_end
        callback.on_step_end(trainer.args, trainer.state, trainer.control, model=trainer.model)
        learner.step()
        assert learner.version == step
        for side, model in (("trl", theirs), ("alignzoo", ours)):
            if any(not torch.equal(t, before[side][n]) for n, t in _params(model).items()):
                moved[side].append(step)
        got, expected = _params(ours), _params(theirs)
        assert set(got) == set(expected)
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
    assert moved["trl"] == moved["alignzoo"] == list(range(every, 9, every))
