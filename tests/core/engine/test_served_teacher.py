"""The served teacher (model.teacher.served, core/engine/served.py) against a real HTTP server
that speaks vLLM's protocol (teacher_server.py, a local HF model behind Starlette): its log-probs
are the local forward pass's on left- and right-padded batches, in batched concurrent requests;
failures (HTTP 500, a connection refused, a list that cannot be aligned, logits) fail the step
with the endpoint named; validate checks the endpoint and the temperature; an opd arm trains
from it. The same client against a real vLLM server: test_served_teacher_vllm.py."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from alignzoo.config.schema import ServedTeacherConfig
from alignzoo.engine import served as served_module
from alignzoo.engine.served import ServedTeacher, server_root
from alignzoo.errors import RunError, UserError
from alignzoo.kernels.forward import policy_forward
from alignzoo.world.tokenizer import build_tokenizer

from .teacher_server import PAIRS, TINY, batch_of, save_teacher, serving


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_teacher(tmp_path_factory.mktemp("teacher") / "teacher")


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(served_module, "RETRY_WAIT_S", 0.01)


def teacher(url: str, **cfg) -> ServedTeacher:
    return ServedTeacher(ServedTeacherConfig(base_url=url, model="teacher", **cfg))


@pytest.mark.parametrize("field", ["prompt_logprobs", "echo"])
def test_the_served_log_probs_are_the_local_forward_pass_in_batched_requests(folder, field):
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    batch = batch_of(tokenizer, PAIRS)
    local, _ = policy_forward(AutoModelForCausalLM.from_pretrained(folder).eval(), batch,
                              truncate=False)  # fmt: skip
    with serving(folder) as double:
        client = teacher(double.url, batch_size=2, max_concurrency=2, logprobs_field=field)
        got = client.logprobs(batch)
        client.close()
    mask = batch.response_mask > 0
    assert got.shape == batch.response_ids.shape and got.dtype == torch.float32
    torch.testing.assert_close(got[mask], local.detach()[mask], atol=1e-5, rtol=0)
    assert bool((got[~mask] == 0).all())  # padding: nothing asked, nothing filled in
    assert float(got[mask].std()) > 0.3, "premise: log-probs that differ token to token"
    # 5 samples in requests of at most 2, each a list of token-id lists: prompt then response
    assert sorted(len(r["prompt"]) for r in double.requests) == [1, 2, 2]  # concurrent
    sent = [ids for r in double.requests for ids in r["prompt"]]
    first = tokenizer("12+7=19<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert first in sent and all(isinstance(t, int) for ids in sent for t in ids)
    body = double.requests[0]
    if field == "prompt_logprobs":
        assert (body["prompt_logprobs"], body["max_tokens"]) == (0, 1) and "echo" not in body
    else:
        assert (body["echo"], body["logprobs"], body["max_tokens"]) == (True, 0, 0)


def test_context_tokens_are_sent_and_only_attended_tokens_scored(folder):
    """A multi-turn sample: environment tokens are attended (context) but not trained; the
    served teacher sees them, as the local forward pass does."""
    from transformers import AutoModelForCausalLM

    batch = batch_of(build_tokenizer(), PAIRS[:3])
    batch.response_attention = (batch.response_mask > 0).long()
    batch.response_mask = batch.response_mask.clone()
    batch.response_mask[0, 1] = 0.0  # an environment token of sample 0: context, not trained
    local, _ = policy_forward(AutoModelForCausalLM.from_pretrained(folder).eval(), batch,
                              truncate=False)  # fmt: skip
    with serving(folder) as double:
        got = teacher(double.url).logprobs(batch)
    attended = batch.response_attention > 0
    torch.testing.assert_close(got[attended], local.detach()[attended], atol=1e-5, rtol=0)
    assert len(double.requests[0]["prompt"][0]) == 5 + 3  # "12+7=" + "19<eos>", all sent


def test_a_server_error_is_retried_then_fails_the_step_naming_the_endpoint(folder):
    batch = batch_of(build_tokenizer(), PAIRS[:2])
    with serving(folder) as double:
        double.faults.fail = 2  # two 500s, then answers: the retries carry the step
        assert teacher(double.url, retries=2).logprobs(batch).shape == (2, 3)
        assert len(double.requests) == 3
        double.requests.clear()
        double.faults.fail = 10
        with pytest.raises(RunError) as failed:
            teacher(double.url, retries=2).logprobs(batch)
    message = str(failed.value)
    assert len(double.requests) == 3  # the first try and two more
    assert "model.teacher.served" in message and f"{double.url}/v1/completions" in message
    assert "HTTP 500" in message and "3 time(s)" in message


def test_a_refused_request_fails_at_once(folder):
    with serving(folder) as double:
        double.faults.fail, double.faults.status = 5, 400
        with pytest.raises(RunError, match="was refused, HTTP 400"):
            teacher(double.url, retries=3).logprobs(batch_of(build_tokenizer(), PAIRS[:1]))
        assert len(double.requests) == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_connection_refused_names_the_base_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RunError) as failed:
        teacher(url, retries=1).logprobs(batch_of(build_tokenizer(), PAIRS[:1]))
    message = str(failed.value)
    assert "model.teacher.served.base_url" in message and url in message
    assert "cannot connect" in message and "2 time(s)" in message


@pytest.mark.parametrize("field", ["prompt_logprobs", "echo"])
def test_a_log_prob_list_that_cannot_be_aligned_fails_the_step(folder, field):
    with serving(folder) as double:
        double.faults.short = True
        with pytest.raises(RunError, match=r"7 log-probs for the 8 tokens sent; they cannot be"):
            teacher(double.url, logprobs_field=field).logprobs(
                batch_of(build_tokenizer(), PAIRS[:1])
            )


def test_logits_are_not_taken_for_log_probs(folder):
    with serving(folder) as double:
        double.faults.logits = True
        with pytest.raises(RunError, match="which is no log-prob"):
            teacher(double.url).logprobs(batch_of(build_tokenizer(), PAIRS[:1]))


def test_a_batch_sampled_at_another_temperature_is_refused(folder):
    with serving(folder) as double, pytest.raises(UserError, match="at temperature 1"):
        teacher(double.url).logprobs(batch_of(build_tokenizer(), PAIRS[:1], temperature=0.7))
    assert double.requests == []


def test_the_endpoint_check_names_the_model_and_compares_tokenizers(folder, tmp_path):
    from tests.core.rollout.bpe_chat import save_bpe_chat_policy

    policy = build_tokenizer()
    with serving(folder) as double:
        assert teacher(double.url).problems(policy) == []
        assert teacher(f"{double.url}/v1/").problems(policy) == []  # the OpenAI client's form
        wrong = ServedTeacher(ServedTeacherConfig(base_url=double.url, model="other"))
        assert wrong.problems(policy) == [("model", f"{double.url} serves 'teacher', not 'other'")]
        double.faults.no_tokenize = True
        [(sub, why)] = teacher(double.url).problems(policy)
        assert sub == "tokenizer" and "has no /tokenize endpoint" in why
        assert teacher(double.url, tokenizer=str(folder)).problems(policy) == []
        chat = save_bpe_chat_policy(tmp_path / "chat")
        [(sub, why)] = teacher(double.url, tokenizer=str(chat)).problems(policy)
        assert sub == "tokenizer" and "is not the policy's" in why and str(chat) in why
    with serving(folder, tokenizer_folder=chat) as other:
        [(sub, why)] = teacher(other.url).problems(policy)
        assert sub == "model" and "tokenizes otherwise than the policy" in why
    [(sub, why)] = teacher(f"http://127.0.0.1:{free_port()}").problems(policy)
    assert sub == "base_url" and "cannot connect" in why


def test_a_served_teacher_is_placed_on_no_device_a_local_one_on_the_references():
    from alignzoo.config.schema import ArmSpec
    from alignzoo.engine.assemble import needed_roles
    from alignzoo.types import AlgorithmRequirements

    distills = AlgorithmRequirements(teacher=True)
    served = {"served": {"base_url": "http://127.0.0.1:8000", "model": "t"}}
    arm = ArmSpec(algorithm="opd", model={"teacher": served})
    assert needed_roles(distills, arm) == ["actor", "rollout", "labeler"]
    local = ArmSpec(algorithm="opd", model={"teacher": {"path": "teacher"}})
    assert "ref" in needed_roles(distills, local)


def test_server_root():
    assert server_root("http://h:8000/v1/") == server_root("http://h:8000") == "http://h:8000"


# -- validate and a run ---------------------------------------------------------------------------


def experiment(tmp_path: Path, teacher_cfg: dict, **training) -> Path:
    spec = {
        "name": "opd",
        "seeds": [0],
        "budget": {"steps": 2},
        "model": {"embedded": {**TINY, "sft_steps": 20}, "teacher": teacher_cfg},
        "data": {"task": {"train_size": 32, "eval_size": 4}},
        "training": {
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "sampling": {"max_new_tokens": 4},
            **training,
        },
        "evaluation": {"every": 2},
        "logging": {"sinks": ["jsonl"]},
        "arms": {"distill": {"algorithm": "opd"}},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def validate(path: Path, cache: Path) -> tuple[int, str]:
    env = {**__import__("os").environ, "ALIGNZOO_CACHE": str(cache), "COLUMNS": "400"}
    done = subprocess.run([sys.executable, "-m", "alignzoo", "validate", str(path)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def test_validate_refuses_a_bad_served_teacher_naming_the_file_and_the_field(folder, tmp_path):
    cache = tmp_path / "cache"
    cases = [
        ({"served": {"model": "teacher"}}, {}, ["model.teacher.served.base_url", "required field is missing"]),
        ({"served": {"base_url": "localhost:8000", "model": "t"}}, {},
         ["model.teacher.served.base_url", "is not an http(s):// URL"]),
        ({"path": str(folder), "served": {"base_url": "http://h", "model": "t"}}, {},
         ["set exactly one of path"]),
        ({"served": {"base_url": f"http://127.0.0.1:{free_port()}", "model": "teacher"}}, {},
         ["model.teacher.served.base_url", "cannot connect"]),
    ]  # fmt: skip
    with serving(folder) as double:
        good = {"served": {"base_url": double.url, "model": "teacher"}}
        cases += [
            (good, {"sampling": {"temperature": 0.7, "max_new_tokens": 4}},
             ["model.teacher.served", "temperature 1", "0.7"]),
            ({"served": {**good["served"], "model": "nope"}}, {},
             ["model.teacher.served.model", "serves 'teacher', not 'nope'"]),
        ]  # fmt: skip
        for teacher_cfg, training, says in cases:
            code, output = validate(experiment(tmp_path, teacher_cfg, **training), cache)
            assert code == 2 and "Traceback" not in output, output
            assert "exp.yaml" in output and all(s in output for s in says), (says, output)
        code, output = validate(experiment(tmp_path, good), cache)
        assert code == 0, output
        gkd = experiment(tmp_path, good)  # whole distributions: a served teacher has none
        spec = yaml.safe_load(gkd.read_text())
        spec["arms"]["distill"]["algorithm"] = "gkd"
        gkd.write_text(yaml.safe_dump(spec))
        code, output = validate(gkd, cache)
        assert code == 2 and "Traceback" not in output, output
        assert "model.teacher.served" in output and "whole next-token distribution" in output
        spec["arms"]["distill"]["algorithm"] = {"name": "sft", "params": {"seq_kd": True}}
        gkd.write_text(yaml.safe_dump(spec))  # the teacher writes: a served one cannot here
        code, output = validate(gkd, cache)
        assert code == 2 and "Traceback" not in output, output
        assert "model.teacher.served" in output and "completions the teacher writes" in output
    assert not cache.exists()  # nothing was built or loaded to check the teacher


@pytest.mark.slow
def test_opd_trains_from_a_served_teacher(folder, tmp_path):
    env = {**__import__("os").environ, "ALIGNZOO_CACHE": str(tmp_path / "cache")}
    with serving(folder) as double:
        path = experiment(tmp_path, {"served": {"base_url": double.url, "model": "teacher",
                                                "batch_size": 3}})  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "alignzoo", "run", str(path), "--out", str(tmp_path / "out")],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "out/distill/seed-0/metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["opd/teacher_logprob"] < 0 and math.isfinite(row["opd/reverse_kl"])
    # 2 steps x 4 samples in requests of at most 3 token-id sequences
    assert sorted(len(r["prompt"]) for r in double.requests) == [1, 1, 3, 3]
    assert "served by" in done.stdout + done.stderr
