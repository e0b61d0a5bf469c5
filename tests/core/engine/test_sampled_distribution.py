"""The trainer's log-probs of a sampled token are those of the distribution it was drawn from
(temperature, then top-k and top-p renormalised): checked against transformers' own warpers,
against the exact gradient of the expected reward on a small categorical policy (enumerated,
through the zoo's GRPO, RLOO and REINFORCE++ losses), and against an independent forward of a
run's own weights; a token outside the trainer's support is masked and counted, never trained
through -inf; temperature 1 without filters is the untouched path."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.kernels.forward import outside_support, policy_forward
from alignzoo.ops import sampling_rows, warp_logits
from alignzoo.types import LossContext


def hf_warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers, in generate's order, over ``[N, V]`` logits (with gradients)."""
    if temperature == 0:
        return logits
    out = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k > 0:
        out = TopKLogitsWarper(top_k)(None, out)
    if top_p < 1:
        out = TopPLogitsWarper(top_p)(None, out)
    return out


def near_tie(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> bool:
    """Whether a token sits so close to a top-k or nucleus boundary that two correct
    implementations may round it to different sides."""
    z = logits.double() / (temperature or 1.0)
    ordered = z.sort(dim=-1, descending=True).values
    if top_k > 0 and top_k < z.shape[-1]:
        gaps = ordered[..., top_k - 1] - ordered[..., top_k]
        if bool((gaps < 1e-4).any()):
            return True
    if top_p < 1:
        if 0 < top_k < z.shape[-1]:
            ordered = ordered.masked_fill(ordered < ordered[..., top_k - 1 : top_k], -float("inf"))
        mass = ordered.softmax(-1).cumsum(-1)
        if bool(((mass - top_p).abs() < 1e-4).any()):
            return True
    return False


SETTINGS = st.tuples(
    st.sampled_from([0.0, 0.3, 0.5, 0.7, 1.0, 1.5]),
    st.sampled_from([0, 1, 2, 3, 5]),
    st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2]),
)


@given(
    rows=st.lists(SETTINGS, min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    vocab=st.integers(2, 12),
)
def test_warp_logits_is_transformers_warpers_row_by_row(rows, seed, vocab) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), 3, vocab, generator=gen) * 3
    for row, setting in enumerate(rows):
        assume(not near_tie(logits[row], *setting))
    sampling = torch.cat([sampling_rows(*setting, 1) for setting in rows])
    ours = torch.log_softmax(warp_logits(logits, sampling), dim=-1)
    for row, setting in enumerate(rows):
        theirs = torch.log_softmax(hf_warped(logits[row].clone(), *setting), dim=-1)
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(theirs)), setting
        finite = torch.isfinite(theirs)
        torch.testing.assert_close(ours[row][finite], theirs[finite], atol=1e-5, rtol=1e-5)
    # the temperature alone (the reference's distribution) cuts nothing
    tempered = warp_logits(logits, sampling, truncate=False)
    assert bool(torch.isfinite(tempered).all())


def test_untouched_rows_give_the_same_tensor_and_greedy_rows_the_raw_logits() -> None:
    logits = torch.randn(2, 3, 7)
    assert warp_logits(logits, None) is logits
    assert warp_logits(logits, sampling_rows(1.0, 0, 1.0, 2)) is logits
    assert warp_logits(logits, sampling_rows(0.0, 5, 0.5, 2)) is logits  # greedy: raw
    mixed = torch.cat([sampling_rows(0.0, 0, 1.0, 1), sampling_rows(0.5, 0, 1.0, 1)])
    out = warp_logits(logits, mixed)
    assert torch.equal(out[0], logits[0]) and torch.allclose(out[1], logits[1] / 0.5)


class TablePolicy(torch.nn.Module):
    """A one-step categorical policy: the same logits theta at every position, whatever the
    input (so the response token's distribution is softmax of the warped theta)."""

    def __init__(self, theta: torch.Tensor) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(theta.clone())

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.theta.expand(*input_ids.shape, -1))


def enumerated(vocab: int, sampling: torch.Tensor | None, q: torch.Tensor) -> RolloutBatch:
    """Every token of the vocabulary as a one-token response to one prompt token, weighted by
    its probability ``q`` under the sampled distribution (the expectation, exactly)."""
    return RolloutBatch(
        prompt_ids=torch.zeros(vocab, 1, dtype=torch.long),
        prompt_mask=torch.ones(vocab, 1, dtype=torch.long),
        response_ids=torch.arange(vocab).unsqueeze(1),
        response_mask=torch.ones(vocab, 1),
        group_ids=torch.zeros(vocab, dtype=torch.long),
        weights=q.detach() * vocab,
        sampling=sampling,
    )


def algorithm(name: str) -> Any:
    from alignzoo.registry import get_registry

    cls = get_registry().get("algorithm", name)
    params = {"grpo": {"beta": 0.0}, "rloo": {}, "reinforce_pp": {"kl_coef": 0.0}}[name]
    return cls(cls.Params.model_validate(params))


def loss_gradient(
    name: str, theta: torch.Tensor, sampling: torch.Tensor | None, q: torch.Tensor, reward
) -> torch.Tensor:
    """The gradient in theta of the algorithm's loss over the enumerated batch (advantage =
    reward; old log-probs = current, so the ratio is 1), through the engine's own forward."""
    policy = TablePolicy(theta)
    batch = enumerated(theta.shape[0], sampling, q)
    logprobs, _ = policy_forward(policy, batch)
    logprobs, outside = outside_support(logprobs, batch.response_mask)
    batch.response_mask = batch.response_mask * ~outside  # as the engine masks them
    batch.old_logprobs = logprobs.detach()
    batch.advantages = reward.view(-1, 1).expand_as(logprobs).clone()
    context = LossContext(tokens=float(theta.shape[0]), sequences=theta.shape[0], groups=1)
    out = algorithm(name).compute_loss(batch, PolicyOutputs(logprobs=logprobs), context)
    loss = out.loss if hasattr(out, "loss") else out[0]
    (grad,) = torch.autograd.grad(loss, policy.theta)
    return grad


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp"])
@given(
    seed=st.integers(0, 2**16),
    vocab=st.integers(3, 8),
    setting=st.sampled_from([(0.5, 0, 1.0), (0.5, 0, 0.8), (0.7, 3, 0.9), (1.5, 0, 0.6)]),
)
def test_the_expected_gradient_is_that_of_the_sampled_distributions_reward(
    name, seed, vocab, setting
) -> None:
    """E_q[A grad log q] over every token (q: the sampled distribution, exactly enumerated)
    equals minus the gradient of E_q[R], with q computed by transformers' warpers; the raw
    log-probs (what the trainer used before) give another gradient."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocab, generator=gen, dtype=torch.float32) * 2
    reward = torch.rand(vocab, generator=gen)
    assume(not near_tie(theta.unsqueeze(0), *setting))
    exact = theta.clone().requires_grad_(True)
    q = torch.softmax(hf_warped(exact.unsqueeze(0), *setting), dim=-1).squeeze(0)
    (truth,) = torch.autograd.grad((q * reward).sum(), exact)
    assume(float(truth.abs().max()) > 1e-3)  # a gradient to compare
    got = loss_gradient(name, theta, sampling_rows(*setting, vocab), q, reward)
    torch.testing.assert_close(got, -truth, atol=1e-5, rtol=1e-4)
    raw = loss_gradient(name, theta, None, q, reward)
    assert float((raw + truth).abs().max()) > 1e-4, "the untempered log-probs' gradient"


def test_a_sampled_token_outside_the_trainers_support_is_masked_not_trained_through() -> None:
    theta = torch.tensor([3.0, 2.0, 0.0, -1.0])
    policy = TablePolicy(theta)
    q = torch.full((4,), 0.25)
    batch = enumerated(4, sampling_rows(1.0, 2, 1.0, 4), q)  # top-2 keeps tokens 0 and 1
    logprobs, _ = policy_forward(policy, batch)
    assert torch.isneginf(logprobs[2:]).all() and torch.isfinite(logprobs[:2]).all()
    filled, outside = outside_support(logprobs, batch.response_mask)
    assert outside.squeeze(1).tolist() == [False, False, True, True]
    assert bool(torch.isfinite(filled).all())
    (filled * ~outside).sum().backward()  # no NaN reaches the weights
    assert bool(torch.isfinite(policy.theta.grad).all())


def test_the_reference_compares_tempered_distributions() -> None:
    theta = torch.tensor([2.0, 1.0, 0.0])
    batch = enumerated(3, sampling_rows(0.5, 1, 0.5, 3), torch.full((3,), 1 / 3))
    ref, _ = policy_forward(TablePolicy(theta), batch, truncate=False)
    expected = torch.log_softmax(theta / 0.5, dim=-1).unsqueeze(1)
    torch.testing.assert_close(ref, expected)


class Recorder:
    """A test plugin keeping each step's batch as the algorithm receives it (after scoring)."""

    batches: list[RolloutBatch] = []  # noqa: RUF012 - shared with the test

    from alignzoo.plugin import hookimpl

    @hookimpl
    def transform_batch(self, batch, run):
        if run.step == 1:
            Recorder.batches.append(batch.select(list(range(batch.size))))


def _run(write_experiment, tmp_path, sampling: dict[str, Any], name: str, **arm: Any):
    from importlib import metadata

    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.loop import run_one
    from alignzoo.plugin import Modifier
    from alignzoo.registry import ENTRY_POINT_GROUP, Registry

    from .conftest import read_jsonl, tiny_experiment

    class Record(Recorder, Modifier):
        pass

    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(Record, "record")
    spec = tiny_experiment(
        budget={"steps": 2},
        training={"sampling": {"max_new_tokens": 4, **sampling}},
        arms={"grpo": {"algorithm": "grpo", "labeler": "arithmetic", "modifiers": ["record"],
                       **arm}},
    )  # fmt: skip
    loaded = load_experiment(write_experiment(spec, name=f"{name}.yaml"), registry=registry)
    Recorder.batches = []
    summary = run_one(loaded, "grpo", 0, tmp_path / name)
    assert summary.status == "finished", summary.error
    return loaded, Recorder.batches[0], read_jsonl(tmp_path / name / "metrics.jsonl")


@pytest.mark.slow
def test_a_run_at_temperature_and_nucleus_trains_on_what_it_sampled(
    write_experiment, tmp_path
) -> None:
    """GRPO sampled at temperature 0.5 and top-p 0.8: its behaviour log-probs are an independent
    forward of the warm start through transformers' warpers, its reference's the tempered
    forward; the backend's recorded log-probs agree (rollout/logprob_diff) and the tokens
    outside the support are counted."""
    from alignzoo.engine.models import load_actor
    from alignzoo.engine.policy import policy_path

    setting = {"temperature": 0.5, "top_k": 0, "top_p": 0.8}
    loaded, batch, rows = _run(write_experiment, tmp_path, setting, "warped")
    arm = loaded.spec.arms["grpo"]
    model = load_actor(policy_path(arm.model, loaded.spec.data, lambda _: None), arm.model, "cpu")
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, (batch.response_mask > 0).long()], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits  # fmt: skip
    width = batch.prompt_ids.shape[1]
    logits = logits[:, width - 1 : -1].float()
    flat = logits.reshape(-1, logits.shape[-1])
    sampled = torch.log_softmax(hf_warped(flat.clone(), 0.5, 0, 0.8), -1).view(logits.shape)
    tempered = torch.log_softmax(logits / 0.5, -1)
    tokens = batch.response_ids.unsqueeze(-1)
    mask = batch.response_mask > 0
    expect_old = sampled.gather(-1, tokens).squeeze(-1)
    expect_ref = tempered.gather(-1, tokens).squeeze(-1)
    assert batch.sampling is not None and batch.sampling[0].tolist() == pytest.approx([0.5, 0, 0.8])
    torch.testing.assert_close(batch.old_logprobs[mask], expect_old[mask], atol=2e-4, rtol=0)
    torch.testing.assert_close(batch.ref_logprobs[mask], expect_ref[mask], atol=2e-4, rtol=0)
    raw = torch.log_softmax(logits, -1).gather(-1, tokens).squeeze(-1)
    assert float((raw - expect_old)[mask].abs().max()) > 0.1, "premise: warping matters here"
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3  # the backend drew from the same
        assert row["rollout/outside_support"] == 0.0


@pytest.mark.slow
def test_temperature_one_without_filters_is_the_untouched_path(
    write_experiment, tmp_path, monkeypatch
) -> None:
    """At T = 1, top-k 0, top-p 1 the batch's recorded sampling changes nothing: the same run
    with the field removed (the trainer as it was before) has bit-identical metrics."""
    from alignzoo.engine import hooks

    plain = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    _, batch, with_field = _run(write_experiment, tmp_path, plain, "recorded")
    assert batch.sampling is not None
    monkeypatch.setattr(hooks, "sampling_rows", lambda *a: None)
    _, batch, without = _run(write_experiment, tmp_path, plain, "unrecorded")
    assert batch.sampling is None
    volatile = ("time_s", "timing/", "throughput/", "memory/")
    strip = [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in with_field]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in without]


def test_validate_refuses_greedy_sampling_for_an_arm_that_trains_on_its_samples(
    write_experiment, tmp_path, capsys
) -> None:
    """temperature 0 for a sampling arm: exit 2, naming the field; an offline arm may keep it
    (it samples nothing); nothing is written."""
    from alignzoo.cli import main

    from .conftest import tiny_experiment

    greedy = {"training": {"sampling": {"temperature": 0.0, "max_new_tokens": 4}}}
    spec = tiny_experiment(
        arms={
            "grpo": {"algorithm": "grpo", **greedy},
            "dpo_online": {"algorithm": "dpo", **greedy},
            "dpo_offline": {"algorithm": "dpo", "online": False, **greedy},
        }
    )
    path = write_experiment(spec)
    assert main(["validate", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "arms.grpo.training.sampling.temperature: 0 samples greedily" in err
    assert "arms.dpo_online.training.sampling.temperature" in err
    assert "arms.dpo_offline" not in err
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
