"""A test double of the served teacher's protocol: a real HTTP server (Starlette on uvicorn, in a
thread) that answers the three requests a served teacher makes of a vLLM OpenAI server, in
vLLM's shapes (vllm/entrypoints/openai/completion/protocol.py of vLLM 0.32):

``GET /v1/models``           ``{"object": "list", "data": [{"id": <name>, ...}]}``
``POST /v1/completions``     a ``prompt`` of token-id lists; ``prompt_logprobs: 0`` answers each
                             choice's ``prompt_logprobs`` (None, then ``{"<id>": {"logprob", "rank",
                             "decoded_token"}}``), ``echo`` + ``logprobs`` its
                             ``logprobs.token_logprobs``; ``return_token_ids`` adds
                             ``prompt_token_ids``, ``return_tokens_as_token_ids`` "token_id:<id>"
``POST /tokenize``           ``{"tokens": [...], "count", "max_model_len"}``

The log-probs are a local HF model's: one forward pass over each sequence (no padding), the
log-softmax of its raw logits (temperature 1, as vLLM's prompt log-probs). ``Faults`` make it
fail in the ways the client must report. The real server is tested in test_served_teacher_vllm.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import EmbeddedModelConfig
from alignzoo.world.model import build_model, save_policy
from alignzoo.world.tokenizer import build_tokenizer

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def save_teacher(folder: Path, seed: int = 5, dims: dict[str, int] | None = None) -> Path:
    """A tiny random Qwen2 over the embedded tokenizer (the embedded policy's), saved;
    ``dims``: its sizes (default TINY)."""
    tokenizer = build_tokenizer()
    model = build_model(EmbeddedModelConfig(**(dims or TINY), seed=seed), tokenizer)
    with torch.no_grad():  # peakier than at initialisation: log-probs far from uniform
        model.get_input_embeddings().weight.mul_(4.0)
    return save_policy(model, tokenizer, folder)


def batch_of(tokenizer, pairs, temperature: float = 1.0) -> RolloutBatch:
    """Prompts left-padded, responses right-padded, as a backend returns them."""
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in pairs]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for _, r in pairs]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    b = len(pairs)
    prompt_ids = torch.zeros((b, width_p), dtype=torch.long)
    prompt_mask = torch.zeros((b, width_p), dtype=torch.long)
    response_ids = torch.zeros((b, width_r), dtype=torch.long)
    response_mask = torch.zeros((b, width_r))
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, width_p - len(p) :] = torch.tensor(p)
        prompt_mask[i, width_p - len(p) :] = 1
        response_ids[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = 1.0
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        group_ids=torch.arange(b),
        sampling=torch.tensor([[temperature, 0.0, 1.0]] * b),
    )


PAIRS = [("12+7=", "19<|endoftext|>"), ("3+45=", "48"), ("100+250=", "350!<|endoftext|>"),
         ("9+9=", "1"), ("1+1=", "2<|endoftext|>")]  # fmt: skip


@dataclass
class Faults:
    """What the double does wrong: ``fail`` the next N completions with ``status``; drop the
    last log-prob of every choice (``short``); answer logits above 0 (``logits``); have no
    /tokenize (``no_tokenize``)."""

    fail: int = 0
    status: int = 500
    short: bool = False
    logits: bool = False
    no_tokenize: bool = False


@dataclass
class Double:
    """The running double: its URL, the completions bodies it received, its faults."""

    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    faults: Faults = field(default_factory=Faults)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@torch.no_grad()
def prompt_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1, from one unpadded forward pass at temperature 1."""
    logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


def build_app(folder: Path, name: str, double: Double, tokenizer_folder: Path | None = None) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder or folder)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        double.requests.append(body)
        faults = double.faults
        if faults.fail > 0:
            faults.fail -= 1
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=faults.status)
        if body.get("model") != name:
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        prompts = body["prompt"]
        prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
        choices = []
        for index, ids in enumerate(prompts):
            values: list[float | None] = [None, *prompt_logprobs(model, ids)]
            if faults.logits:
                values = [None if v is None else 3.0 for v in values]
            if faults.short:
                values = values[:-1]
            choice: dict[str, Any] = {"index": index, "text": "", "finish_reason": "length"}
            if body.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = [
                    None if v is None else
                    {str(t): {"logprob": v, "rank": 1, "decoded_token": tokenizer.decode([t])}}
                    for t, v in zip(ids, values, strict=False)
                ]  # fmt: skip
                if body.get("return_token_ids"):
                    choice["prompt_token_ids"] = ids
            elif body.get("echo") and body.get("logprobs") is not None:
                as_ids = body.get("return_tokens_as_token_ids")
                choice["logprobs"] = {
                    "token_logprobs": values,
                    "tokens": [f"token_id:{t}" if as_ids else tokenizer.decode([t]) for t in ids],
                    "text_offset": [],
                    "top_logprobs": [],
                }
            else:
                return JSONResponse({"error": {"message": "no log-probs asked"}}, status_code=400)
            choices.append(choice)
        return JSONResponse({"object": "text_completion", "model": name, "choices": choices})

    async def tokenize(request: Request) -> JSONResponse:
        if double.faults.no_tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await request.json()
        special = body.get("add_special_tokens", True)
        ids = tokenizer(body["prompt"], add_special_tokens=special)["input_ids"]
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 512})

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
        ]
    )


@contextmanager
def serving(
    folder: Path, name: str = "teacher", tokenizer_folder: Path | None = None
) -> Iterator[Double]:
    """The double serving ``folder``'s model as ``name`` on 127.0.0.1, for the block."""
    port = _free_port()
    double = Double(url=f"http://127.0.0.1:{port}")
    app = build_app(folder, name, double, tokenizer_folder)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the teacher double did not start"
    try:
        yield double
    finally:
        server.should_exit = True
        thread.join(timeout=10)
