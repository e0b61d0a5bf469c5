"""The hooks facade's checks (alignzoo.engine.hooks): a backend batch that breaks the layout
contract is named."""

from __future__ import annotations

import copy

import pytest

from alignzoo.engine.hooks import check_layout
from alignzoo.errors import RunError

from ..tiny_world import build_world, sampled


@pytest.fixture(scope="module")
def world() -> tuple[object, object]:
    return build_world()


def test_a_backend_batch_that_breaks_the_contract_is_named(world) -> None:
    model, tokenizer = world
    batch = sampled(model, tokenizer)
    check_layout(batch, 2)
    with pytest.raises(RunError, match="group_ids must be i // n"):
        check_layout(batch, 4)
    bad = copy.copy(batch)
    bad.response_mask = batch.response_mask[:, :-1]
    with pytest.raises(RunError, match="response_mask has shape"):
        check_layout(bad, 2)
    bad = copy.copy(batch)
    bad.responses = batch.responses[:-1]
    with pytest.raises(RunError, match="responses has 7 items for 8"):
        check_layout(bad, 2)
