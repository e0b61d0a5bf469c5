"""A DPO variant is one entry: a function registered with ``register_loss`` is a ``loss_type``
the params accept (and list in the JSON Schema), validate what it reads by its traits, and train
on, alone or in a list."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from alignzoo.plugins.algorithms import dpo
from alignzoo.plugins.algorithms.dpo import DPO, DPOParams, Pairs
from alignzoo.registry import build_plugin_manager

from .pref_helpers import neg_log_sigmoid, run_loss
from .test_dpo import H_A, H_B, golden_batch


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, dpo.LossType]:
    """``dpo.LOSS_TYPES`` as a copy the test registers into (the built-ins' registry is left
    as it was)."""
    monkeypatch.setattr(dpo, "LOSS_TYPES", dict(dpo.LOSS_TYPES))
    return dpo.LOSS_TYPES


def squared_hinge(pairs: Pairs, params: DPOParams) -> torch.Tensor:
    """A toy variant: (1 - ε) max(0, 1 - βh)²."""
    return (1.0 - params.label_smoothing) * torch.relu(1.0 - params.beta * pairs.margin) ** 2


def test_a_registered_function_is_a_loss_type(registry: dict[str, dpo.LossType]) -> None:
    assert (
        "squared_hinge"
        not in DPOParams.model_json_schema()["properties"]["loss_type"]["anyOf"][0]["enum"]
    )
    with pytest.raises(ValidationError, match="unknown DPO loss_type 'squared_hinge'"):
        DPO({"loss_type": "squared_hinge"})

    dpo.register_loss("squared_hinge", smoothed=True)(squared_hinge)

    schema = DPOParams.model_json_schema()["properties"]["loss_type"]
    assert "squared_hinge" in schema["anyOf"][0]["enum"]
    assert "squared_hinge" in schema["anyOf"][1]["items"]["enum"]
    params = {"loss_type": "squared_hinge", "beta": 0.5, "label_smoothing": 0.1}
    result = run_loss(DPO(params), *golden_batch())
    # golden_batch: h = 1.25 and -1.5, so 0.9 max(0, 1 - h/2)² = 0.9 (0.375², 1.75²)
    expected = 0.9 * (0.375**2 + 1.75**2) / 2
    assert result.loss.item() == pytest.approx(expected, rel=1e-12)
    assert result.metrics["dpo/loss"] == pytest.approx(expected, rel=1e-12)

    both = run_loss(
        DPO({"loss_type": ["sigmoid", "squared_hinge"], "loss_weights": [1.0, 2.0]}),
        *golden_batch(),
    )
    dpo_term = (neg_log_sigmoid(0.1 * H_A) + neg_log_sigmoid(0.1 * H_B)) / 2
    toy_term = ((1 - 0.1 * H_A) ** 2 + (1 - 0.1 * H_B) ** 2) / 2
    assert both.loss.item() == pytest.approx(dpo_term + 2.0 * toy_term, rel=1e-12)
    assert both.metrics["dpo/loss/squared_hinge"] == pytest.approx(toy_term, rel=1e-12)


def test_a_variants_traits_are_what_the_params_and_the_plugin_check(
    registry: dict[str, dpo.LossType],
) -> None:
    def refuse_large_beta(params: DPOParams) -> None:
        if params.beta > 1.0:
            raise ValueError("sorted_hinge keeps beta <= 1")

    def sorted_hinge(pairs: Pairs, params: DPOParams) -> torch.Tensor:
        return torch.relu(1.0 - params.beta * torch.sort(pairs.margin).values)

    dpo.register_loss(
        "sorted_hinge", sorts=True, params=("discopop_tau",), check=refuse_large_beta
    )(sorted_hinge)

    with pytest.raises(ValidationError, match="label_smoothing applies"):
        DPO({"loss_type": "sorted_hinge", "label_smoothing": 0.1})  # not smoothed
    with pytest.raises(ValidationError, match="keeps beta <= 1"):
        DPO({"loss_type": "sorted_hinge", "beta": 2.0})
    with pytest.raises(
        ValidationError, match="discopop_tau applies to loss_type discopop, sorted_hinge"
    ):
        DPO({"loss_type": "ipo", "discopop_tau": 0.1})
    DPO({"loss_type": "sorted_hinge", "discopop_tau": 0.1})
    hook = build_plugin_manager([DPO({"loss_type": "sorted_hinge"})]).hook
    assert hook.algorithm_requirements().weights is False  # it sorts: no pair weights
    batch, outputs = golden_batch()
    batch.weights = torch.ones(batch.size, dtype=torch.float64)
    with pytest.warns(UserWarning, match="sorted_hinge ignores batch.weights"):
        run_loss(DPO({"loss_type": "sorted_hinge"}), batch, outputs)


def test_a_name_is_registered_once(registry: dict[str, dpo.LossType]) -> None:
    with pytest.raises(ValueError, match="'ipo' is registered twice"):
        dpo.register_loss("ipo")(squared_hinge)
    assert registry["ipo"].loss is dpo.ipo
