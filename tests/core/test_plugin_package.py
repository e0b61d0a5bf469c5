"""An outside package's components are selectable from YAML and its modifier wraps built-ins."""

from __future__ import annotations

import textwrap

import pytest
import torch

from alignzoo import get_registry, load_experiment
from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.registry import build_plugin_manager


def small_batch(seed: int = 0) -> tuple[RolloutBatch, PolicyOutputs]:
    generator = torch.Generator().manual_seed(seed)
    b, r = 6, 5
    mask = torch.ones(b, r)
    mask[1, 3:] = 0
    mask[4, 2:] = 0
    old = -torch.rand(b, r, generator=generator)
    batch = RolloutBatch(
        prompt_ids=torch.zeros(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.long),
        response_ids=torch.zeros(b, r, dtype=torch.long),
        response_mask=mask,
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        old_logprobs=old,
        ref_logprobs=old - 0.1,
        scores=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0]),
    )
    logprobs = (old + 0.05 * torch.randn(b, r, generator=generator)).requires_grad_(True)
    return batch, PolicyOutputs(logprobs=logprobs, entropy=torch.rand(b, r, generator=generator))


def loss_through_hooks(components) -> tuple[float, dict]:
    pm = build_plugin_manager(components)
    batch, outputs = small_batch()
    batch = pm.hook.compute_advantages(batch=batch)
    result = pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())
    return float(result.loss.detach()), result.metrics


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "vanilla_pg"])
def test_outside_modifier_wraps_any_algorithm(algorithm):
    registry = get_registry()
    algo_cls = registry.get("algorithm", algorithm)
    scale = registry.get("modifier", "loss_scale")
    plain, _ = loss_through_hooks([algo_cls()])
    scaled, metrics = loss_through_hooks([algo_cls(), scale({"factor": 3.0})])
    assert plain != 0.0
    assert scaled == pytest.approx(3.0 * plain, rel=1e-6)
    assert metrics["loss_scale/factor"] == 3.0


def test_outside_components_selectable_from_yaml(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(
        textwrap.dedent("""\
        name: outside
        seeds: [0]
        budget: {steps: 1}
        arms:
          custom:
            algorithm: {name: vanilla_pg, params: {baseline: false}}
            labeler: {name: keyword, params: {keyword: "7"}}
            backend: {name: canned, params: {responses: ["7", "8"]}}
            devices: all_cpu
            modifiers: [loss_scale]
        """)
    )
    loaded = load_experiment(path)
    components = loaded.components["custom"]
    assert type(components["algorithm"]).__module__ == "alignzoo_testplugin.components"
    assert components["algorithm"].params.baseline is False
    assert components["labeler"].params.keyword == "7"
    assert components["backend"].params.responses == ["7", "8"]
    assert components["modifiers.0"].params.factor == 2.0
    pm = build_plugin_manager(components.values())
    placed = pm.hook.place_roles(roles=["actor", "ref"], available=["cpu", "cuda:0"])
    assert placed == {"actor": "cpu", "ref": "cpu"}
