"""The contract suites of labelers, backends, device mappers and modifiers: the built-ins pass,
and each deliberately broken component is caught by the property it breaks, with its example."""

from __future__ import annotations

import random

import pytest
import torch

from alignzoo import DeviceMapper, Labeler, LabelRequest, Modifier, Score, hookimpl
from alignzoo.errors import UserError
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.testing.components import (
    KIND_CHECKS,
    assert_contract,
    check_backend,
    check_device_mapper,
    check_labeler,
    check_modifier,
)

FEW = 8


def failed(results):
    return {r.name: r.detail for r in results if not r.passed}


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("arithmetic", None),
        ("regex", {"pattern": r"\d+"}),
        ("format", None),
        ("length_penalty", None),
        ("combine", {"labelers": ["arithmetic", "length_penalty"]}),
        ("panel", {"labelers": ["arithmetic", "format"], "aggregate": "mean"}),
    ],
)
def test_builtin_labelers_meet_the_contract(name, params):
    results = assert_contract("labeler", name, params, max_examples=FEW)
    assert [r.name for r in results] == list(KIND_CHECKS["labeler"])


def test_builtin_mappers_and_backend_meet_the_contract():
    for name in ("single", "split"):
        assert_contract("device_mapper", name, max_examples=30)
    for params in (None, {"weights": "copy"}):
        results = assert_contract("backend", "hf", params, max_examples=3)
        assert [r.name for r in results] == list(KIND_CHECKS["backend"])


# --------------------------------------------------------------------------- broken labelers


class RaisesOnEmpty(Labeler):
    def score(self, request: LabelRequest) -> Score:
        if not request.response:
            raise ValueError("empty")
        return Score(1.0)


class OneTooFew(Labeler):
    @hookimpl
    def score_batch(self, requests):
        return [Score(1.0) for _ in requests[1:]]


class Reversed(Labeler):
    @hookimpl
    def score_batch(self, requests):
        return [Score(float(len(r.response))) for r in reversed(requests)]


class Noisy(Labeler):
    def score(self, request: LabelRequest) -> Score:
        return Score(random.random())


class Declared(Noisy):
    deterministic = False


class NaNValue(Labeler):
    def score(self, request: LabelRequest) -> Score:
        return Score(float("nan") if "NaN" in request.response else 0.0)


@pytest.mark.parametrize(
    ("labeler", "check", "message"),
    [
        (RaisesOnEmpty, "one_score_per_request", "raised ValueError"),
        (OneTooFew, "one_score_per_request", "scores for"),
        (Reversed, "batch_equals_items", "differs from the per-request answers"),
        (Noisy, "deterministic", "scored again"),
        (NaNValue, "one_score_per_request", "would be rejected: the labeler returned a non-finite"),
    ],
)
def test_broken_labelers_are_caught_with_an_example(labeler, check, message):
    problems = failed(check_labeler(labeler, max_examples=30))
    assert check in problems, problems
    assert message in problems[check] and "example" in problems[check].lower()
    assert "BatchCase" not in problems[check]  # hints fit the kind: no batches here
    assert "LabelRequest(prompt, response, extra)" in problems[check]


class LongResponses(Labeler):
    """Fails only on a batch of long responses: the example must be summarised, not dumped."""

    @hookimpl
    def score_batch(self, requests):
        if sum(len(r.response) for r in requests) > 200:
            return []
        return [Score(1.0) for _ in requests]


def test_a_failing_example_is_summarised_not_dumped():
    from alignzoo.testing.contract import summarise

    problems = failed(check_labeler(LongResponses, max_examples=40))
    detail = problems["one_score_per_request"]
    assert "Smallest failing example: [LabelRequest(prompt=" in detail
    assert len(detail) < 1500, detail
    text = summarise([LabelRequest("p" * 5000, "r", {"tests": list(range(100))})] * 10)
    assert len(text) <= 600 and "(5000 chars)" in text and "(10 items)" in text
    tensor = summarise({"logprobs": torch.zeros(64, 512)})
    assert tensor == "{'logprobs': tensor[64, 512] float32 [0, 0, 0, 0, …]}"


def test_a_labeler_that_declares_itself_nondeterministic_is_not_held_to_it():
    assert failed(check_labeler(Declared, max_examples=FEW)) == {}


# --------------------------------------------------------------------------- broken backends


class WrongGroups(HFBackend):
    @hookimpl
    def generate(self, prompts, extras, n, sampling):
        batch = HFBackend.generate(self, prompts, extras, n, sampling)
        batch.group_ids = torch.arange(len(prompts)).repeat(n)  # i % P, not i // n
        return batch


class PastEOS(HFBackend):
    @hookimpl
    def generate(self, prompts, extras, n, sampling):
        batch = HFBackend.generate(self, prompts, extras, n, sampling)
        batch.response_ids[:, 0] = self.tokenizer.eos_token_id  # EOS first, more tokens after
        batch.response_mask[:, :2] = 1.0
        return batch


class IgnoresSync(HFBackend):
    """Samples with its own copy of the policy and loads only the first weights it is sent."""

    def __init__(self, params=None):
        super().__init__(params or {"weights": "copy"})

    @hookimpl
    def sync_weights(self, weights):
        if self.version is None:
            HFBackend.sync_weights(self, weights)


class StaleLogprobs(HFBackend):
    @hookimpl
    def generate(self, prompts, extras, n, sampling):
        batch = HFBackend.generate(self, prompts, extras, n, sampling)
        batch.rollout_logprobs = batch.rollout_logprobs - 0.5 * batch.response_mask
        return batch


@pytest.mark.parametrize(
    ("backend", "check", "message"),
    [
        (WrongGroups, "layout", "group_ids"),
        (PastEOS, "layout", "after the EOS"),
        (IgnoresSync, "sync_changes_outputs", "did not change"),
        (StaleLogprobs, "sampling_logprobs", "forward pass of the synced weights"),
    ],
)
def test_broken_backends_are_caught(backend, check, message):
    problems = failed(check_backend(backend, max_examples=3))
    assert check in problems, problems
    assert message in problems[check]


# --------------------------------------------------------------------------- broken mappers


class Imaginary(DeviceMapper):
    @hookimpl
    def place_roles(self, roles, available):
        return {role: "cuda:7" for role in roles}


class Crashes(DeviceMapper):
    @hookimpl
    def place_roles(self, roles, available):
        return {role: available[1] for role in roles}  # IndexError with one device


class Moody(DeviceMapper):
    @hookimpl
    def place_roles(self, roles, available):
        return {role: random.choice(available) for role in roles}


class Refuses(DeviceMapper):
    @hookimpl
    def place_roles(self, roles, available):
        if "cuda:0" not in available:
            raise UserError("needs a GPU")
        return {role: "cuda:0" for role in roles}


@pytest.mark.parametrize(
    ("mapper", "check", "message"),
    [
        (Imaginary, "places_every_role", "not available"),
        (Crashes, "places_every_role", "IndexError"),
        (Moody, "stable", "another placement"),
    ],
)
def test_broken_mappers_are_caught(mapper, check, message):
    problems = failed(check_device_mapper(mapper, max_examples=100))
    assert check in problems and message in problems[check], problems


def test_a_mapper_that_refuses_with_a_user_error_passes():
    assert failed(check_device_mapper(Refuses, max_examples=50)) == {}


# --------------------------------------------------------------------------- broken modifiers


class PaddingLeak(Modifier):
    """Adds a term that sees the padding: breaks every algorithm's padding invariance."""

    @hookimpl(wrapper=True)
    def compute_loss(self, batch, outputs, context):
        result = yield
        result.loss = result.loss + 1e-2 * outputs.logprobs.sum()
        return result


class DropsRows(Modifier):
    @hookimpl
    def transform_batch(self, batch, run):
        batch.scores = batch.scores[:-1] if batch.scores is not None else None
        return batch


def test_broken_modifiers_are_caught_for_every_builtin_algorithm():
    problems = failed(check_modifier(PaddingLeak, algorithms=("grpo", "dpo"), max_examples=FEW))
    assert {"grpo/padding_invariance", "dpo/padding_invariance"} <= set(problems), problems
    layout = failed(check_modifier(DropsRows, algorithms=(), max_examples=FEW))
    assert "transform_batch_layout" in layout and "scores has" in layout["transform_batch_layout"]


def test_check_commands_for_every_kind(capsys, tmp_path):
    from alignzoo.cli import main

    assert main(["check", "labeler", "regex", "--params", '{"pattern": "\\\\d+"}',
                 "--max-examples", "5"]) == 0  # fmt: skip
    assert "pass deterministic" in capsys.readouterr().out
    params = tmp_path / "params.yaml"
    params.write_text("function: nowhere.py:f\n")
    assert main(["check", "labeler", "python", "--params", str(params)]) == 1
    assert "nowhere.py" in capsys.readouterr().out
    assert main(["check", "device_mapper", "split"]) == 0
    assert main(["check", "device-mapper", "single"]) == 0
    assert main(["check", "modifier", "dedupe", "--max-examples", "3"]) == 0
    assert "pass grpo/padding_invariance" in capsys.readouterr().out
    assert main(["check", "labeler", "regex", "--params", "[1]"]) == 2
    assert "expected a mapping" in capsys.readouterr().err
