"""On-policy distillation (plugins/algorithms/opd.py) and the teacher role: the per-token reverse
KL advantage by hand, the contract suite (its direction check with a teacher that prefers each
group's best sample), a gradient step that moves probability toward the teacher, the refusals
(no teacher, a teacher with another tokenizer) and a tiny run with the embedded world's teacher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from alignzoo.errors import UserError
from alignzoo.plugins.algorithms.opd import OPD, reverse_kl_advantages
from alignzoo.testing.contract import check_algorithm
from alignzoo.testing.strategies import make_batch

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def test_the_advantage_is_minus_beta_times_the_per_token_reverse_kl():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -9.0]])
    teacher = torch.tensor([[-0.5, -4.0, -0.5], [-1.0, -0.2, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    got = reverse_kl_advantages(old, teacher, mask, kl_coef=0.5)
    # -0.5 * (old - teacher): positive where the teacher finds the token likelier; 0 on padding
    expected = torch.tensor([[0.25, -1.0, 0.0], [1.0, -0.05, 0.0]])
    torch.testing.assert_close(got, expected)


def test_opd_passes_the_algorithm_contract():
    failed = [r for r in check_algorithm("opd", max_examples=15) if not r.passed]
    assert failed == [], [(r.name, r.detail) for r in failed]


def test_a_step_moves_probability_toward_what_the_teacher_prefers():
    # one sample, three tokens the policy gives -1 each; the teacher likes token 0, dislikes 2
    batch, outputs = make_batch(
        [[-1.0, -1.0, -1.0]],
        old_logprobs=[[-1.0, -1.0, -1.0]],
        teacher_logprobs=[[-0.2, -1.0, -3.0]],
        scores=[0.0],
    )
    algorithm = OPD()
    batch = algorithm.compute_advantages(batch)
    out = algorithm.compute_loss(batch, outputs, batch.loss_context())
    out.loss.backward()
    step = -outputs.logprobs.grad[0]  # how a descent step changes each token's log-prob
    assert step[0] > 0 and step[2] < 0 and abs(float(step[1])) < 1e-7
    assert out.metrics["opd/reverse_kl"] == pytest.approx((-0.8 + 0.0 + 2.0) / 3)


def experiment(tmp_path: Path, teacher: dict | None) -> Path:
    spec = {
        "name": "opd",
        "seeds": [0],
        "budget": {"steps": 2},
        "model": {"embedded": {**TINY, "sft_steps": 20}},
        "data": {"task": {"train_size": 32, "eval_size": 4}},
        "training": {
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "sampling": {"max_new_tokens": 4},
        },
        "evaluation": {"every": 2},
        "logging": {"sinks": ["jsonl"]},
        "arms": {"distill": {"algorithm": "opd"}},
    }
    if teacher is not None:
        spec["model"]["teacher"] = teacher
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def alignzoo(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**__import__("os").environ, "ALIGNZOO_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "alignzoo", *args], capture_output=True, text=True, env=env
    )


@pytest.mark.parametrize(
    ("teacher", "says"),
    [
        (None, "model.teacher: opd distills from a teacher and the arm has none"),
        ({"path": "x", "embedded": dict(TINY)}, "set exactly one of path"),
        ({}, "set exactly one of path"),
    ],
)
def test_a_missing_or_ambiguous_teacher_is_refused_at_validate(tmp_path, teacher, says):
    result = alignzoo("validate", str(experiment(tmp_path, teacher)), cache=tmp_path / "cache")
    output = result.stdout + result.stderr
    assert result.returncode == 2 and says in output and "exp.yaml" in output, output
    assert "Traceback" not in output


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    from types import SimpleNamespace

    from alignzoo.config.schema import ModelConfig
    from alignzoo.engine.models import load_teacher
    from alignzoo.world.tokenizer import build_tokenizer
    from tests.core.rollout.bpe_chat import save_bpe_chat_policy

    folder = save_bpe_chat_policy(tmp_path / "chat")
    policy = SimpleNamespace(tokenizer=build_tokenizer(), policy_path="embedded-policy")
    with pytest.raises(UserError) as refused:
        load_teacher(str(folder), ModelConfig(), "cpu", policy)
    message = str(refused.value)
    assert "model.teacher" in message and str(folder) in message and "embedded-policy" in message


@pytest.mark.slow
def test_opd_trains_from_the_embedded_worlds_teacher(tmp_path):
    teacher = {"embedded": {"sft_steps": 80}}  # the policy's tiny settings, trained longer
    result = alignzoo("run", str(experiment(tmp_path, teacher)), "--out", str(tmp_path / "out"),
                      cache=tmp_path / "cache")  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "out/distill/seed-0/metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # at ratio 1 the surrogate is the reverse KL itself; the teacher scored every token
        assert row["opd/teacher_logprob"] < 0 and row["actor/pg_loss"] == pytest.approx(
            row["opd/reverse_kl"], abs=1e-4
        )
    # the teacher and the policy are two warm starts of the cache (built once each), the
    # teacher with the policy's settings but for what it changes
    configs = list((tmp_path / "cache" / "embedded").glob("*/config.json"))
    assert len(configs) == 2
    assert {json.loads(c.read_text())["hidden_size"] for c in configs} == {TINY["hidden_size"]}


def test_validate_names_both_tokenizers_of_a_teacher_that_tokenizes_otherwise(tmp_path):
    from tests.core.rollout.bpe_chat import save_bpe_chat_policy

    folder = save_bpe_chat_policy(tmp_path / "chat")
    result = alignzoo("validate", str(experiment(tmp_path, {"path": str(folder)})),
                      cache=tmp_path / "cache")  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert "model.teacher.path" in output and str(folder) in output and "embedded" in output
    assert "is not the policy's" in output
    missing = alignzoo("validate", str(experiment(tmp_path, {"path": str(tmp_path / "none")})),
                       cache=tmp_path / "cache")  # fmt: skip
    assert missing.returncode == 2 and "is not a folder" in missing.stdout + missing.stderr


def test_the_embedded_teacher_is_resolved_once_so_a_dumped_experiment_reads_back_the_same():
    from alignzoo.config.schema import ModelConfig

    model = ModelConfig.model_validate(
        {
            "embedded": {"sft_steps": 1500, "sft_lr": 0.001, "sft_slip": 0.7},
            "teacher": {"embedded": {"sft_slip": 0.0}},
        }
    )
    teacher = model.teacher.embedded
    assert (teacher.sft_steps, teacher.sft_lr, teacher.sft_slip) == (1500, 0.001, 0.0)
    again = ModelConfig.model_validate(model.model_dump())  # as config.json / experiment.yaml
    assert again.teacher == model.teacher


def test_an_embedded_teacher_for_a_policy_folder_is_refused_at_validate(tmp_path):
    from tests.core.rollout.bpe_chat import save_bpe_chat_policy

    path = experiment(tmp_path, {"embedded": {"sft_steps": 40}})
    spec = yaml.safe_load(path.read_text())
    spec["model"]["policy"] = str(save_bpe_chat_policy(tmp_path / "chat"))
    path.write_text(yaml.safe_dump(spec))
    result = alignzoo("validate", str(path), cache=tmp_path / "cache")
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "model.teacher.embedded" in output, output
    assert "give the teacher as a path" in output
