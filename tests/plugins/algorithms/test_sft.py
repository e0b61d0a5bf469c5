"""Supervised fine-tuning (plugins/algorithms/sft.py) and the demonstrations data mode: the loss
is the completion's negative log-likelihood, equal to transformers' own causal-LM loss with
the prompt's labels masked (what TRL's SFTTrainer trains on with its completion-only loss); the
contract; demonstrations read from text and from conversations, refused when malformed; a tiny
run on the embedded world."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from alignzoo.engine.modes.demonstrations import demonstrations_batch
from alignzoo.kernels.forward import policy_forward
from alignzoo.plugins.algorithms.sft import SFT
from alignzoo.testing.contract import check_algorithm
from alignzoo.testing.strategies import make_batch
from tests.core.tiny_world import build_world

TINY = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "sft_steps": 20,
}
ROWS = [
    {"prompt": "12+7=", "completion": "19"},
    {"prompt": "100+250=", "completion": "350"},
    {"prompt": "3+4=", "completion": "7"},
]


def test_the_loss_is_the_completions_token_mean_nll_and_per_sequence_on_request():
    logprobs = [[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]]
    mask = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    for aggregation, expected in (
        ("token-mean", 10.0 / 4),
        ("seq-mean-token-mean", (2.0 + 4.0) / 2),
    ):
        batch, outputs = make_batch(logprobs, mask=mask)
        out = SFT({"loss_aggregation": aggregation}).compute_loss(
            batch, outputs, batch.loss_context()
        )
        assert float(out.loss.detach()) == pytest.approx(expected), aggregation
        assert out.metrics["sft/nll"] == pytest.approx(10.0 / 4)


def test_sft_passes_the_algorithm_contract():
    failed = [r for r in check_algorithm("sft", max_examples=15) if not r.passed]
    assert failed == [], [(r.name, r.detail) for r in failed]


def test_the_loss_equals_transformers_causal_lm_loss_with_the_prompt_masked():
    """A second implementation: the model's own ``labels=`` loss, the prompt's (and padding's)
    labels -100, as TRL's completion-only SFT computes it."""
    model, tokenizer = build_world()
    model.eval()
    batch = demonstrations_batch(tokenizer, ROWS, max_new_tokens=16)
    logprobs, _ = policy_forward(model, batch)
    ours = SFT().compute_loss(batch, type("O", (), {"logprobs": logprobs})(), batch.loss_context())
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, batch.response_mask.long()], dim=1)
    labels = torch.where(attention.bool(), ids, -100)
    labels[:, : batch.prompt_ids.shape[1]] = -100  # the prompt is context, never a target
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    theirs = model(
        input_ids=ids, attention_mask=attention, position_ids=position_ids, labels=labels
    ).loss
    assert float(ours.loss) == pytest.approx(float(theirs), abs=1e-5)
    # the completions end with EOS: what the model learns to stop with
    assert all(row[row_mask.bool()][-1] == tokenizer.eos_token_id
               for row, row_mask in zip(batch.response_ids, batch.response_mask, strict=True))  # fmt: skip


def experiment(tmp_path: Path, data: dict | None = None, steps: int = 2) -> Path:
    spec = {
        "name": "sft",
        "seeds": [0],
        "budget": {"steps": steps},
        "model": {"embedded": TINY},
        "data": data or {"task": {"train_size": 32, "eval_size": 4}},
        "training": {"prompts_per_step": 4, "sampling": {"max_new_tokens": 4}},
        "evaluation": {"every": steps},
        "logging": {"sinks": ["jsonl"]},
        "arms": {"sft": {"algorithm": "sft"}},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def alignzoo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**__import__("os").environ, "ALIGNZOO_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "alignzoo", *args], capture_output=True, text=True, env=env
    )


def test_demonstrations_missing_a_completion_or_its_assistant_turn_are_refused(tmp_path):
    from alignzoo.config.schema import DataConfig
    from alignzoo.engine.datasets import load_split
    from alignzoo.errors import UserError
    from tests.core.rollout.bpe_chat import build_bpe_chat_tokenizer

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(UserError, match=r"missing column.*completion"):
        load_split(DataConfig(train=str(text), eval="embedded"), "train", "demonstrations")
    chat = tmp_path / "chat.jsonl"
    good = {
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    }
    bad = {"messages": [{"role": "user", "content": "hello?"}]}
    chat.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    tokenizer = build_bpe_chat_tokenizer()
    with pytest.raises(UserError, match=r"row 2: column 'messages'.*assistant turn"):
        load_split(DataConfig(train=str(chat), eval="embedded"), "train", "demonstrations",
                   tokenizer)  # fmt: skip
    chat.write_text(json.dumps(good) + "\n")
    rows = load_split(DataConfig(train=str(chat), eval="embedded"), "train", "demonstrations",
                      tokenizer)  # fmt: skip
    (row,) = list(rows)
    assert row["prompt"].endswith("<|im_start|>assistant\n")  # rendered with the template
    assert row["completion"].startswith("4<|im_end|>")  # what the template adds after it
    # The trained completion ends where sampling stops: at the end of turn (this tokenizer's
    # EOS), not at the template's text after it, and with no second EOS appended.
    plain = {"prompt": "2+2?", "completion": "4"}
    batch = demonstrations_batch(tokenizer, [dict(row), plain], max_new_tokens=16)
    eos = tokenizer.eos_token_id
    assert row["completion"] != "4<|im_end|>"  # premise: the template adds text after it
    for ids, mask in zip(batch.response_ids, batch.response_mask, strict=True):
        trained = ids[mask.bool()].tolist()
        assert tokenizer.decode(trained) == "4<|im_end|>" and trained.count(eos) == 1
    # Several turns in one completion keep every turn (only the whitespace after the last end
    # of turn goes); an EOS inside a text followed by more text keeps it all and gets its own.
    turns = "a<|im_end|>\n<|im_start|>tool\nX<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
    rows = [{"prompt": "q", "completion": turns}, {"prompt": "q", "completion": "x<|im_end|>y"}]
    batch = demonstrations_batch(tokenizer, rows, max_new_tokens=64)
    trained = [ids[m.bool()].tolist() for ids, m in zip(batch.response_ids, batch.response_mask, strict=True)]  # fmt: skip
    assert tokenizer.decode(trained[0]) == turns[:-1]
    assert tokenizer.decode(trained[1]) == "x<|im_end|>y<|im_end|>"


@pytest.mark.slow
def test_sft_trains_on_the_embedded_worlds_demonstrations(tmp_path):
    result = alignzoo(tmp_path, "run", str(experiment(tmp_path)), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "out/sft/seed-0/metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # four demonstrations a step, read not sampled: the loss is their nll
        assert row["samples"] == 4 * row["step"] and row["loss"] == pytest.approx(row["sft/nll"])
    evals = [json.loads(line) for line in (tmp_path / "out/sft/seed-0/eval.jsonl").open()]
    assert [e["step"] for e in evals] == [0, 2]  # evaluated as every arm is


def test_an_sft_arm_asked_to_sample_is_refused_at_validate(tmp_path):
    path = experiment(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["arms"]["sft"]["online"] = True
    path.write_text(yaml.safe_dump(spec))
    result = alignzoo(tmp_path, "validate", str(path))
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "arms.sft.online" in output and "exp.yaml" in output
    assert "nothing to sample" in output and "Traceback" not in output


@pytest.mark.slow
def test_a_packed_sft_arm_trains_on_the_same_loss_as_the_padded_one(tmp_path):
    """training.packing: the same demonstrations, the same seed: the packed arm's per-step loss
    equals the padded arm's (up to summation order, compounded over three updates), with far
    less of its forward spent on padding (the premise that it did pack)."""
    rows = tmp_path / "demonstrations.jsonl"
    with rows.open("w") as out:  # prompts and completions of very different lengths
        for i in range(24):
            a, b = 7 ** (i % 9), 3 * i + 1
            out.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
    path = experiment(tmp_path, {"train": str(rows), "eval": "embedded"}, steps=3)
    spec = yaml.safe_load(path.read_text())
    spec["training"]["micro_batch_size"] = 3  # 4 prompts a step: micro-batches of 3 and 1
    spec["arms"]["packed"] = {"algorithm": "sft", "training": {"packing": True}}
    spec["arms"]["packed_long"] = {
        "algorithm": "sft",
        "training": {"packing": True, "packing_length": 64},
    }
    path.write_text(yaml.safe_dump(spec))
    result = alignzoo(tmp_path, "run", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    def rows(arm: str) -> list[dict]:
        lines = (tmp_path / f"out/{arm}/seed-0/metrics.jsonl").open()
        return [json.loads(line) for line in lines]

    padded = rows("sft")
    for arm in ("packed", "packed_long"):
        packed = rows(arm)
        assert [r["step"] for r in packed] == [1, 2, 3]
        for a, b in zip(padded, packed, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (arm, a["step"])
            assert b["timing/padding_frac"] <= a["timing/padding_frac"], (arm, a["step"])
        mean = sum(r["timing/padding_frac"] for r in packed) / 3
        assert mean < 0.5 * sum(r["timing/padding_frac"] for r in padded) / 3, arm
    assert sum(r["timing/padding_frac"] for r in padded) / 3 > 0.15  # premise: padding


def test_packing_length_without_packing_is_refused_naming_the_field(tmp_path):
    path = experiment(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["arms"]["sft"]["training"] = {"packing_length": 128}
    path.write_text(yaml.safe_dump(spec))
    result = alignzoo(tmp_path, "validate", str(path))
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "exp.yaml" in output and "packing_length" in output
    assert "set packing: true" in output and "Traceback" not in output


def test_with_seq_kd_a_step_trains_on_what_the_teacher_writes_not_on_the_rows():
    """The demonstrations mode of an algorithm with teacher_completions: each row's completion
    is the teacher's own sample of its prompt (greedy here, so it is known: the teacher's
    greedy continuation), one per row; the rows' completions are not read."""
    from types import SimpleNamespace

    from alignzoo.config.schema import TrainingConfig
    from alignzoo.engine.modes import select_mode
    from alignzoo.engine.modes.base import StepSource
    from alignzoo.engine.modes.demonstrations import TeacherWriter
    from alignzoo.plugins.backends.hf import HFBackend
    from alignzoo.types import SamplingParams

    teacher, tokenizer = build_world()
    requirements = SFT({"seq_kd": True}).algorithm_requirements()
    assert requirements.teacher and requirements.teacher_completions
    assert not requirements.teacher_logprobs  # it reads no teacher scores: no scoring pass
    mode = select_mode(requirements, online=False)
    mode.teacher_writer = TeacherWriter(teacher, tokenizer, "cpu", None)
    training = TrainingConfig(sampling={"temperature": 0.0, "max_new_tokens": 5})
    source = StepSource(hooks=None, tokenizer=tokenizer, training=training, seeds=[1, 2, 3])
    collected = mode.collect(ROWS, source)
    batch = collected.batch
    assert batch.size == 3 and batch.prompts == [r["prompt"] for r in ROWS]
    assert "timing/teacher_generate" in collected.metrics
    greedy = HFBackend()
    greedy.on_run_start(SimpleNamespace(tokenizer=tokenizer, device=lambda r: "cpu", actor=teacher))
    expected = greedy.generate([r["prompt"] for r in ROWS], [], 1, SamplingParams(temperature=0.0, max_new_tokens=5))  # fmt: skip
    assert batch.responses == expected.responses
    assert batch.responses != [
        r["completion"] for r in ROWS
    ]  # premise: the untrained teacher writes otherwise
    assert batch.sampling is None and batch.rollout_logprobs is None  # read as data by the policy


@pytest.mark.slow
def test_an_sft_arm_with_seq_kd_trains_on_its_teachers_samples(tmp_path):
    path = experiment(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["model"]["teacher"] = {"embedded": {"sft_steps": 40, "sft_slip": 0.0}}
    spec["arms"]["sft"]["algorithm"] = {"name": "sft", "params": {"seq_kd": True}}
    path.write_text(yaml.safe_dump(spec))
    result = alignzoo(tmp_path, "run", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "out/sft/seed-0/metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # four teacher samples a step, one per prompt, trained on by their nll
        assert row["samples"] == 4 * row["step"] and row["timing/teacher_generate"] > 0
        assert row["loss"] == pytest.approx(row["sft/nll"])


def test_a_scorer_told_its_teacher_scores_go_unread_skips_the_teachers_pass():
    from types import SimpleNamespace

    from alignzoo.engine.behaviour import frozen_views
    from alignzoo.engine.scoring import Scorer

    teacher, tokenizer = build_world()
    models = SimpleNamespace(reference=None, critic=None, teacher=teacher, autocast=None)
    batch = demonstrations_batch(tokenizer, ROWS, max_new_tokens=16)
    scorer = Scorer(models, micro_batch_size=8)  # type: ignore[arg-type]
    scorer.teacher_scores = False
    frozen_views(scorer, batch)
    assert batch.teacher_logprobs is None
    scorer.teacher_scores = True
    models.autocast = __import__("contextlib").nullcontext
    frozen_views(scorer, batch)
    assert (
        batch.teacher_logprobs is not None
        and batch.teacher_logprobs.shape == batch.response_ids.shape
    )
