"""Simulated annotators: the rule seen through each annotator's noise and bias, the same
judgements every time, more noise less agreement; and the labeler that drives the queue."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from alignzoo.human.export import agreement
from alignzoo.human.queue import HumanQueue
from alignzoo.human.simulate import Simulation, rule_scorer, simulate
from alignzoo.plugins.labelers.simulated import SimulatedAnnotatorsLabeler
from alignzoo.types import LabelRequest, Outcome

ODD = {"name": "regex", "params": {"pattern": "[13579]"}}
RESPONSES = [str(n) for n in range(20)]  # the rule: 1 with an odd digit ("10" too), else 0


def _queue(tmp_path, name="q"):
    queue = HumanQueue(tmp_path / name)
    queue.enqueue([LabelRequest(prompt="p", response=r) for r in RESPONSES], 3, (1, 5))
    queue.enqueue_pairs([("p", "1", "2"), ("p", "4", "3"), ("p", "5", "7")], raters=3)
    return queue


def _sim(**annotator) -> Simulation:
    names = ("a", "b", "c")
    return Simulation(rule=ODD, annotators=[{"name": n, **annotator} for n in names], seed=3)


def test_without_noise_the_annotators_give_the_rule(tmp_path) -> None:
    queue = _queue(tmp_path)
    assert simulate(queue, _sim(), rule_scorer(_sim().rule)) == 3 * (len(RESPONSES) + 3)
    for item, given in queue.items():
        values = {v for _, v in given}
        if item.kind == "pair":
            expected = {("1", "2"): 1.0, ("4", "3"): 0.0, ("5", "7"): 0.5}[
                (item.response, item.other)
            ]
        else:
            expected = 5.0 if re.search("[13579]", item.response) else 1.0
        assert values == {expected}, item
    assert simulate(queue, _sim(), rule_scorer(_sim().rule)) == 0  # nothing left to judge


def test_the_same_queue_is_judged_the_same_way_and_noise_costs_agreement(tmp_path) -> None:
    noisy = _sim(noise=0.4, bias=0.1)
    runs = []
    for name in ("one", "two"):
        queue = _queue(tmp_path, name)
        simulate(queue, noisy, rule_scorer(noisy.rule))
        runs.append([(item.response, item.other, given) for item, given in queue.items()])
    assert runs[0] == runs[1]
    precise = _queue(tmp_path, "precise")
    simulate(precise, _sim(noise=0.05), rule_scorer(_sim().rule))
    alpha_noisy = agreement(HumanQueue(tmp_path / "one"))["ratings"]["krippendorff_alpha"]
    alpha_precise = agreement(precise)["ratings"]["krippendorff_alpha"]
    assert alpha_precise > alpha_noisy


def test_the_labeler_queues_judges_and_labels(tmp_path) -> None:
    params = {
        "queue": str(tmp_path / "q"),
        "raters": 3,
        "min_raters": 2,
        "rule": ODD,
        "annotators": [{"name": "a"}, {"name": "b", "cannot_judge": 1.0}, {"name": "c"}],
    }
    labeler = SimulatedAnnotatorsLabeler(params)
    scores = labeler.score_batch([LabelRequest(prompt="p", response=r) for r in ("3", "8")])
    assert [s.value for s in scores] == [1.0, 0.0]  # a and c: 5 and 1 on the scale 1..5
    assert scores[0].info["ratings"] == [5.0, 5.0]  # b could not judge: two values are enough
    queue = HumanQueue(tmp_path / "q")
    assert [[v for _, v in given] for _, given in queue.items()] == [[5, None, 5], [1, None, 1]]
    declining = SimulatedAnnotatorsLabeler(
        {
            **params,
            "raters": 1,
            "min_raters": 1,
            "annotators": [{"name": "b", "cannot_judge": 1.0}],
            "queue": str(tmp_path / "q2"),
        }
    )
    assert (
        declining.score_batch([LabelRequest(prompt="p", response="3")])[0].outcome
        == Outcome.ABSTAIN
    )
    with pytest.raises(ValidationError, match="raters \\(4\\) exceeds the 3 annotators"):
        SimulatedAnnotatorsLabeler({**params, "raters": 4})
