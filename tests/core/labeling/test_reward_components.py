"""A labeler's several rewards (``Score.info["rewards"]``) reach the batch apart: the labeling
pass puts them in ``batch.reward_components`` under ``batch.reward_names`` (NaN where one does
not apply), they survive select, concat, to and the label store and wire, and a malformed
``info["rewards"]`` is a rejected score."""

from __future__ import annotations

import json
import math

import torch

from alignzoo import Labeler
from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import LabelingConfig
from alignzoo.engine.collect import _UNLABELED
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.modes.base import part_rewards
from alignzoo.labeling.interface import check_scores, reward_table
from alignzoo.labeling.orchestrator import LabelingStage, label
from alignzoo.labeling.protocol import score_from_json, score_to_json
from alignzoo.labeling.store import LabelStore
from alignzoo.plugins.labelers.combine import CombineLabeler
from alignzoo.registry import build_plugin_manager
from alignzoo.types import LabelRequest, Outcome, Score

NAN = math.nan


def batch_of(responses: list[str]) -> RolloutBatch:
    n = len(responses)
    return RolloutBatch(
        prompt_ids=torch.zeros((n, 1), dtype=torch.long),
        prompt_mask=torch.ones((n, 1), dtype=torch.long),
        response_ids=torch.ones((n, 2), dtype=torch.long),
        response_mask=torch.ones((n, 2)),
        group_ids=torch.arange(n) // 2,
        prompts=["p"] * n,
        responses=list(responses),
        extras=[{} for _ in range(n)],
    )


def labeled_by(labeler: Labeler, responses: list[str]) -> RolloutBatch:
    hooks = Hooks(build_plugin_manager([labeler]))
    stage = LabelingStage.build(LabelingConfig(store=None), [("l0", labeler, hooks)])
    batch = batch_of(responses)
    label(hooks, batch, stage)
    return batch


def same(a: torch.Tensor | None, b: list[list[float]]) -> bool:
    """Equal, NaN where ``b`` has NaN."""
    assert a is not None
    return bool(torch.allclose(a, torch.tensor(b, dtype=a.dtype), equal_nan=True, rtol=0, atol=0))


def test_a_combine_labelers_parts_reach_the_batch_raw_in_their_order() -> None:
    combine = CombineLabeler(
        {
            "labelers": [
                {"name": "regex", "params": {"pattern": "b"}},
                {"name": "format", "params": {"pattern": "[a-z]+", "ok": 2.0}},
            ],
            "names": ["has_b", "lowercase"],
        }
    )
    batch = labeled_by(combine, ["ab", "A", "b", "xyz"])
    assert batch.reward_names == ("has_b", "lowercase")
    assert batch.reward_components is not None
    assert batch.reward_components.dtype == torch.float32
    assert same(batch.reward_components, [[1, 2], [0, 0], [1, 2], [0, 2]])
    assert batch.scores is not None and batch.scores.tolist() == [3.0, 0.0, 3.0, 2.0]
    assert combine.reward_components == {"has_b": 1.0, "lowercase": 1.0}


class Several(Labeler):
    """TRL's several reward functions in one labeler: "length" always, "digit" only for a
    response with a digit (None otherwise), and nothing at all for the empty response."""

    def score(self, request: LabelRequest) -> Score:
        if not request.response:
            return Score(0.0)
        digit = 1.0 if any(c.isdigit() for c in request.response) else None
        if request.response == "skip":
            return Score.abstain("no")
        rewards = {"length": float(len(request.response)), "digit": digit}
        return Score(float(len(request.response)), info={"rewards": rewards})


def test_none_is_nan_and_a_score_without_rewards_is_a_row_of_nan() -> None:
    batch = labeled_by(Several(), ["a1", "bb", "", "skip"])
    assert batch.reward_names == ("length", "digit")
    assert batch.reward_components is not None
    assert same(batch.reward_components, [[2, 1], [2, NAN], [NAN, NAN], [NAN, NAN]])
    assert part_rewards(batch.label_info) == {"reward/length": 2.0, "reward/digit": 1.0}


def test_a_labeler_that_reports_no_rewards_leaves_the_fields_empty() -> None:
    batch = labeled_by(CombineLabeler({"labelers": ["format"]}), ["1"])
    assert batch.reward_names == ("format",)  # one part: one reward, reported
    plain = labeled_by(Several(), [""])
    assert plain.reward_components is None and plain.reward_names == ()


def test_reward_table_takes_names_in_first_seen_order() -> None:
    scores = [
        Score(1.0, info={"rewards": {"b": 1.0}}),
        Score(1.0, info={"rewards": {"a": 2, "b": 3.0}}),
        Score.abstain("x"),
    ]
    names, rows = reward_table(scores)
    assert names == ("b", "a")
    assert rows[0][0] == 1.0 and math.isnan(rows[0][1]) and rows[1] == [3.0, 2.0]
    assert all(math.isnan(v) for v in rows[2])
    assert reward_table([Score(1.0), Score(0.0, info={"rewards": {}})]) == ((), [])


def test_malformed_rewards_are_rejected_scores() -> None:
    scores = [
        Score(1.0, info={"rewards": {"a": 1.0, "b": None, "c": NAN}}),  # fine
        Score(1.0, info={"rewards": [1.0, 2.0]}),
        Score(1.0, info={"rewards": {"a": "high"}}),
        Score(1.0, info={"rewards": {"a": math.inf}}),
        Score(1.0, info={"rewards": {"a": torch.ones(2)}}),
        Score.abstain("not a value: not checked"),
    ]
    checked = check_scores(scores, len(scores))
    assert isinstance(checked, list)
    outcomes = [s.outcome for s in checked]
    assert outcomes == [Outcome.VALUE] + [Outcome.REJECTED] * 4 + [Outcome.ABSTAIN]
    reasons = [s.info["reason"] for s in checked[1:5]]
    assert "not a dict" in reasons[0] and "'high'" in reasons[1]
    assert "finite" in reasons[2] and "expected a number" in reasons[3]


def test_rewards_that_float_takes_are_values() -> None:
    """What a labeler reported before the rewards were read apart keeps working: a bool, a
    one-element tensor, a numpy number (reward/<name> has always logged float() of them)."""
    import numpy as np

    reported = {"ok": True, "rm": torch.tensor(0.5), "np": np.float32(0.25), "n": 3}
    checked = check_scores([Score(1.0, info={"rewards": reported})], 1)
    assert isinstance(checked, list) and checked[0].outcome == Outcome.VALUE
    names, rows = reward_table(checked)
    assert names == ("ok", "rm", "np", "n") and rows == [[1.0, 0.5, 0.25, 3.0]]


def test_rewards_keep_their_order_and_nones_through_the_store_and_the_wire(tmp_path) -> None:
    score = Score(0.5, info={"rewards": {"z": 1.0, "a": None, "m": 0.25}})
    back = score_from_json(json.loads(json.dumps(score_to_json(score))))
    assert list(back.info["rewards"].items()) == [("z", 1.0), ("a", None), ("m", 0.25)]
    store = LabelStore(tmp_path / "labels.sqlite")
    store.put("several", [("k", LabelRequest("p", "r"), score)], 0.1)
    found = store.lookup("several", ["k"])["k"]
    assert list(found.info["rewards"].items()) == [("z", 1.0), ("a", None), ("m", 0.25)]
    store.close()


def with_rewards(responses: list[str], names: tuple[str, ...], rows: list[list[float]]):
    batch = batch_of(responses)
    batch.reward_components = torch.tensor(rows, dtype=torch.float32)
    batch.reward_names = names
    return batch


def test_select_to_and_concat_carry_the_rewards_under_their_names() -> None:
    first = with_rewards(["a", "b"], ("x", "y"), [[1, 2], [3, 4]])
    picked = first.select([1]).to("cpu")
    assert picked.reward_names == ("x", "y") and same(picked.reward_components, [[3, 4]])
    other = with_rewards(["c"], ("y", "z"), [[5, 6]])
    none = batch_of(["d"])  # a part without rewards (a replayed group from before them)
    both = RolloutBatch.concat([first, other, none])
    assert both.reward_names == ("x", "y", "z")
    assert same(
        both.reward_components,
        [[1, 2, NAN], [3, 4, NAN], [NAN, 5, 6], [NAN, NAN, NAN]],
    )
    plain = RolloutBatch.concat([batch_of(["a"]), batch_of(["b"])])
    assert plain.reward_components is None and plain.reward_names == ()


def test_a_checkpointed_look_ahead_batch_leaves_them_to_the_next_labeling() -> None:
    assert {"reward_components", "reward_names"} <= set(_UNLABELED)
