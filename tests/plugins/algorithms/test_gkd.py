"""Generalized knowledge distillation (plugins/algorithms/gkd.py): the loss and its gradient
equal TRL 1.16's GKDTrainer.generalized_jsd_loss at every beta (forward KL, JSD, reverse KL),
with padding; the contract suite, direction included, at default and other params; a flipped
sign is caught; the lambda mixture of the demonstrations mode; a tiny run with a teacher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.plugin import hookimpl
from alignzoo.plugins.algorithms.gkd import GKD, generalized_jsd
from alignzoo.testing.contract import check_algorithm
from alignzoo.types import LossOutput

trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")


def _case(seed: int, rows: int = 3, width: int = 5, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, width, vocab, generator=g, dtype=torch.float64) * 2.0
    teacher = torch.randn(rows, width, vocab, generator=g, dtype=torch.float64) * 2.0
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0] = width  # one row without padding, the others padded
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    return student, teacher, mask, ids


def _ours(student, teacher, mask, ids, **params) -> tuple[float, torch.Tensor]:
    logits = student.clone().requires_grad_(True)
    rows = mask.shape[0]
    batch = RolloutBatch(
        prompt_ids=torch.ones(rows, 1, dtype=torch.long),
        prompt_mask=torch.ones(rows, 1, dtype=torch.long),
        response_ids=ids,
        response_mask=mask,
        group_ids=torch.arange(rows),
    )
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    outputs = PolicyOutputs(logprobs=logprobs, logits=logits, teacher_logits=teacher)
    out = GKD(params).compute_loss(batch, outputs, batch.loss_context())
    assert isinstance(out, LossOutput)
    out.loss.backward()
    assert logits.grad is not None
    return float(out.loss.detach()), logits.grad


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_loss_and_gradient_equal_trls_generalized_jsd(beta: float, seed: int) -> None:
    """TRL computes the divergence on the shifted logits with labels -100 on padding
    (``batchmean``: the sum over real positions over their count); alignzoo on the response
    positions under its mask, token-mean over the step."""
    student, teacher, mask, ids = _case(seed)
    ours, our_grad = _ours(student, teacher, mask, ids, beta=beta)
    theirs_logits = student.clone().requires_grad_(True)
    labels = torch.where(mask > 0, ids, -100)
    theirs = trl_gkd.GKDTrainer.generalized_jsd_loss(
        theirs_logits, teacher, labels=labels, beta=beta
    )
    theirs.backward()
    assert ours == pytest.approx(float(theirs.detach()), abs=1e-5)
    assert theirs_logits.grad is not None
    torch.testing.assert_close(our_grad, theirs_logits.grad, atol=1e-5, rtol=0)
    assert float(theirs.detach()) > 1e-3  # premise: the distributions differ, the loss is not 0


def test_the_ends_are_the_forward_and_the_reverse_kl_and_equal_distributions_give_zero() -> None:
    student, teacher, _, _ = _case(4)
    p, q = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    forward = (p.exp() * (p - q)).sum(-1)  # KL(teacher || student)
    reverse = (q.exp() * (q - p)).sum(-1)  # KL(student || teacher)
    torch.testing.assert_close(generalized_jsd(student, teacher, 0.0), forward)
    torch.testing.assert_close(generalized_jsd(student, teacher, 1.0), reverse)
    # the JSD is continuous in beta at both ends (the mixture tends to one distribution)
    torch.testing.assert_close(generalized_jsd(student, teacher, 1e-7) / 1e-7, forward, atol=1e-3, rtol=1e-3)  # fmt: skip
    assert float(generalized_jsd(teacher, teacher, 0.5).abs().max()) < 1e-12


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"beta": 0.0, "lmbda": 1.0},
        {"beta": 1.0, "lmbda": 0.0},
        {"beta": 0.3, "loss_aggregation": "seq-mean-token-mean"},
    ],
)
def test_gkd_passes_the_algorithm_contract(params: dict) -> None:
    failed = [r for r in check_algorithm(GKD(params), max_examples=25) if not r.passed]
    assert failed == [], [(r.name, r.detail) for r in failed]


def test_a_gkd_whose_loss_ascends_is_caught_by_the_direction_check() -> None:
    class Ascending(GKD):
        @hookimpl
        def compute_loss(self, batch, outputs, context):  # type: ignore[override]
            out = super().compute_loss(batch, outputs, context)
            return LossOutput(-out.loss, out.metrics)

    results = {r.name: r for r in check_algorithm(Ascending(), max_examples=25)}
    assert not results["direction"].passed
    assert "demonstrated completion" in results["direction"].detail


def test_lmbda_is_the_share_of_steps_the_policy_samples() -> None:
    """The demonstrations mode draws each step from its first row's seed: lambda 0 never
    samples, 1 always, 0.5 about half of 400 steps, and the same seed draws the same."""
    from alignzoo.engine.modes import select_mode
    from alignzoo.engine.modes.base import StepSource

    def draws(lmbda: float) -> list[bool]:
        mode = select_mode(GKD({"lmbda": lmbda}).algorithm_requirements(), online=False)
        source = StepSource(hooks=None, tokenizer=None, training=None)  # type: ignore[arg-type]
        out = []
        for seed in range(400):
            source.seeds = [seed * 7919 + 1, 5]
            out.append(mode.samples_this_step(source))
        return out

    assert not any(draws(0.0)) and all(draws(1.0))
    half = draws(0.5)
    assert 160 < sum(half) < 240 and half == draws(0.5)


TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


@pytest.mark.slow
def test_a_gkd_arm_trains_on_a_mixture_of_its_samples_and_the_demonstrations(tmp_path: Path):
    spec = {
        "name": "gkd",
        "seeds": [0],
        "budget": {"steps": 4},
        "model": {
            "embedded": {**TINY, "sft_steps": 20},
            "teacher": {"embedded": {"sft_steps": 40, "sft_slip": 0.0}},
        },
        "data": {"task": {"train_size": 32, "eval_size": 4}},
        "training": {"prompts_per_step": 4, "sampling": {"max_new_tokens": 6}},
        "evaluation": {"every": 4},
        "logging": {"sinks": ["jsonl"]},
        "arms": {
            "sampled": {"algorithm": {"name": "gkd", "params": {"lmbda": 1.0, "beta": 1.0}}},
            "read": {"algorithm": {"name": "gkd", "params": {"lmbda": 0.0, "beta": 0.0}}},
        },
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**__import__("os").environ, "ALIGNZOO_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-m", "alignzoo", "run", str(path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    def rows(arm: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / f"out/{arm}/seed-0/metrics.jsonl").open()]

    sampled, read = rows("sampled"), rows("read")
    assert [r["step"] for r in sampled] == [1, 2, 3, 4] == [r["step"] for r in read]
    assert all(r["batch/on_policy"] == 1.0 and "timing/generate" in r for r in sampled)
    assert all("batch/on_policy" not in r and "timing/generate" not in r for r in read)
    for row in sampled + read:  # the loss is the mean divergence, one response a prompt
        assert row["samples"] == 4 * row["step"]
        assert row["loss"] == pytest.approx(row["gkd/jsd"], rel=1e-5) and row["gkd/jsd"] > 0


def test_seq_kd_has_the_teacher_write_the_steps_the_student_does_not_sample() -> None:
    requirements = GKD({"seq_kd": True, "lmbda": 0.25}).algorithm_requirements()
    assert requirements.teacher_completions and requirements.on_policy_fraction == 0.25
    assert not GKD().algorithm_requirements().teacher_completions  # TRL's default: off


def test_a_teacher_head_padded_wider_than_the_students_is_read_on_the_shared_rows() -> None:
    student, teacher, mask, ids = _case(5)
    wider = torch.cat([teacher, torch.randn(*teacher.shape[:2], 3, dtype=teacher.dtype)], dim=-1)
    same, _ = _ours(student, teacher, mask, ids)
    padded, _ = _ours(student, wider, mask, ids)
    assert padded == pytest.approx(same, abs=1e-12)


def test_the_teacher_logprob_metric_comes_from_the_teachers_logits_without_a_scoring_pass():
    assert not GKD().algorithm_requirements().teacher_logprobs
    student, teacher, mask, ids = _case(6)
    batch = RolloutBatch(
        prompt_ids=torch.ones(3, 1, dtype=torch.long),
        prompt_mask=torch.ones(3, 1, dtype=torch.long),
        response_ids=ids,
        response_mask=mask,
        group_ids=torch.arange(3),
    )
    logprobs = torch.log_softmax(student, -1).gather(-1, ids[..., None])[..., 0]
    outputs = PolicyOutputs(logprobs=logprobs, logits=student, teacher_logits=teacher)
    out = GKD().compute_loss(batch, outputs, batch.loss_context())
    expected = torch.log_softmax(teacher, -1).gather(-1, ids[..., None])[..., 0]
    assert out.metrics["gkd/teacher_logprob"] == pytest.approx(
        float((expected * mask).sum() / mask.sum())
    )
