"""The prepare stage (alignzoo.engine.prepare): the behaviour policy's passes once per collected
batch (none for an empty one), the mode's selection, the batch transforms (a step whose batch
they filter empty trains nothing) and the mode's extras; its time is ``timing/prepare``, not
the update's."""

from __future__ import annotations

import time
from importlib import metadata

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.loader import load_experiment
from alignzoo.engine.behaviour import Behaviour, SeparatePass
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.loop import run_one
from alignzoo.engine.modes import Collected, select_mode
from alignzoo.engine.prepare import prepare_step
from alignzoo.plugin import Modifier, hookimpl
from alignzoo.registry import ENTRY_POINT_GROUP, Registry, build_plugin_manager
from alignzoo.types import AlgorithmRequirements

from .conftest import read_jsonl, tiny_experiment


class Counted(Behaviour):
    """A behaviour policy that counts the batches it is given before the update."""

    def __init__(self) -> None:
        super().__init__(scorer=None, online=True)
        self.sizes: list[int] = []

    def before_update(self, batch: RolloutBatch) -> dict[str, float]:
        self.sizes.append(batch.size)
        return {"entropy": 0.5}


def _collected(size: int) -> Collected:
    batch = RolloutBatch(
        prompt_ids=torch.ones(size, 2, dtype=torch.long),
        prompt_mask=torch.ones(size, 2, dtype=torch.long),
        response_ids=torch.ones(size, 3, dtype=torch.long),
        response_mask=torch.ones(size, 3),
        group_ids=torch.arange(size) // 2,
        scores=torch.zeros(size),
    )
    return Collected(batch, samples=size, tokens=3 * size)


def test_the_behaviour_policy_sees_each_collected_batch_once_and_an_empty_one_never():
    mode = select_mode(AlgorithmRequirements(), online=True)
    hooks = Hooks(build_plugin_manager([]))
    behaviour = Counted()
    collected = _collected(4)
    batch = prepare_step(collected, behaviour, mode, hooks, None, None, step=1)
    assert batch is not None and batch.size == 4
    assert behaviour.sizes == [4] and collected.metrics == {"entropy": 0.5}
    assert prepare_step(_collected(0), behaviour, mode, hooks, None, None, step=2) is None
    assert behaviour.sizes == [4]


class DropAll(Modifier):
    """A batch transform that filters every sample out (a test plugin)."""

    @hookimpl
    def transform_batch(self, batch, run):
        return batch.select([])


def test_a_step_whose_batch_is_filtered_empty_trains_nothing(write_experiment, tmp_path) -> None:
    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(DropAll, "drop_all")
    spec = tiny_experiment(
        budget={"steps": 2}, arms={"a": {"algorithm": "grpo", "modifiers": ["drop_all"]}}
    )
    loaded = load_experiment(write_experiment(spec), registry=registry)
    summary = run_one(loaded, "a", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("loss" not in r and "reward/mean" in r for r in rows)  # sampled, not trained


def test_the_prepare_stage_is_timed_apart_from_the_update(write_experiment, tmp_path, monkeypatch):
    """A slow behaviour pass counts towards ``timing/prepare``, not ``timing/update``."""
    original = SeparatePass.before_update

    def slow(self, batch):
        time.sleep(0.5)
        return original(self, batch)

    monkeypatch.setattr(SeparatePass, "before_update", slow)
    spec = tiny_experiment(budget={"steps": 2}, training={"fuse_behaviour": False})
    summary = run_one(load_experiment(write_experiment(spec)), "grpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    for row in read_jsonl(tmp_path / "run" / "metrics.jsonl"):
        assert row["timing/prepare"] >= 0.5 > row["timing/update"], row
        assert row["timing/step"] >= row["timing/prepare"] + row["timing/update"]
