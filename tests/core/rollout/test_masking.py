"""Masking is complete: every online algorithm of the zoo gives the same loss and the same
gradients on a multi-turn batch (environment tokens inside the response, response_mask 0) as on
the single-turn batch that holds only its trained tokens, whatever the environment tokens'
log-probs, values and ids."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignzoo.registry import build_plugin_manager, get_registry
from alignzoo.testing.strategies import make_batch

ONLINE = ["grpo", "rloo", "reinforce_pp", "ppo"]
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("grpo", {"beta": 0.04}),
    ("grpo", {"importance_ratio": "sequence"}),
    ("grpo", {"surrogate": "cispo"}),
    ("ppo", {}),
    ("rloo", {}),
    ("reinforce_pp", {}),
]


def loss_and_grads(name: str, params: dict[str, Any], tensors: dict[str, torch.Tensor]):
    algorithm = get_registry().get("algorithm", name)(params)
    pm = build_plugin_manager([algorithm])
    # float64: a whitened loss (REINFORCE++) divides by a standard deviation that can be small,
    # which turns float32 summation-order noise into visible differences.
    batch, outputs = make_batch(**tensors, dtype=torch.float64)
    batch = pm.hook.compute_advantages(batch=batch) or batch
    result = pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())
    result.loss.backward()
    grads = [outputs.logprobs.grad]
    if outputs.values is not None and outputs.values.grad is not None:
        grads.append(outputs.values.grad)
    return float(result.loss.detach()), grads


@st.composite
def episodes(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[int], dict[str, Any]]:
    groups, per_group = draw(st.integers(1, 3)), draw(st.integers(2, 3))
    size, width = groups * per_group, draw(st.integers(2, 6))
    floats = st.floats(-3.0, 0.0, width=32)

    def rows(values=floats, w=width):
        return torch.tensor(draw(st.lists(st.lists(values, min_size=w, max_size=w),
                                          min_size=size, max_size=size)))  # fmt: skip

    lengths = [draw(st.integers(1, width)) for _ in range(size)]
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    tensors = {
        "logprobs": rows(),
        "old_logprobs": rows(),
        "ref_logprobs": rows(),
        "values": rows(st.floats(-2.0, 2.0, width=32)),
        "policy_values": rows(st.floats(-2.0, 2.0, width=32)),
        "mask": mask,
        "scores": torch.tensor(
            draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=size, max_size=size))
        ),
        "group_ids": torch.arange(groups).repeat_interleave(per_group),
    }
    holes = draw(st.lists(st.integers(1, width - 1), min_size=1, max_size=3))  # insert before
    garbage = {"seed": draw(st.integers(0, 2**16))}
    return tensors, sorted(set(holes)), garbage


def with_holes(tensors, holes, garbage) -> dict[str, torch.Tensor]:
    """The same batch with environment tokens (mask 0, arbitrary values) before ``holes``."""
    gen = torch.Generator().manual_seed(garbage["seed"])
    out = dict(tensors)
    for name in ("logprobs", "old_logprobs", "ref_logprobs", "values", "policy_values", "mask"):
        pieces, start = [], 0
        t = tensors[name]
        for h in holes:
            pieces.append(t[:, start:h])
            fill = (
                torch.zeros(t.shape[0], 2)
                if name == "mask"
                else -5 * torch.rand(t.shape[0], 2, generator=gen)
            )
            pieces.append(fill)
            start = h
        pieces.append(t[:, start:])
        out[name] = torch.cat(pieces, dim=1)
    # A row that ended before a hole has nothing of its own after it: the hole is padding there,
    # which the contract's padding check covers; here every hole sits inside trained tokens or
    # after them, and the trained tokens are the same.
    return out


@pytest.mark.parametrize(("name", "params"), VARIANTS)
@settings(max_examples=25, deadline=None)
@given(example=episodes())
def test_environment_tokens_inside_a_response_change_no_loss(name, params, example):
    tensors, holes, garbage = example
    holed = with_holes(tensors, holes, garbage)
    assert torch.equal(holed["mask"].sum(dim=1), tensors["mask"].sum(dim=1))
    base_loss, base_grads = loss_and_grads(name, params, tensors)
    loss, grads = loss_and_grads(name, params, holed)
    # Whitened advantages (REINFORCE++) sum to zero, so such a loss is summation-order noise
    # around 0 amplified by a small standard deviation; in float64 that noise is below 1e-9.
    assert loss == pytest.approx(base_loss, rel=1e-9, abs=1e-9)
    keep = holed["mask"].bool()
    for g, g_base in zip(grads, base_grads, strict=True):
        flat_trained = g[keep]
        flat_base = g_base[tensors["mask"].bool()]
        torch.testing.assert_close(flat_trained, flat_base, rtol=1e-9, atol=1e-12)
        assert float(g[~keep].abs().max()) == 0.0  # environment tokens get no gradient
