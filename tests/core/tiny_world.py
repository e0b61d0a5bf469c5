"""A tiny untrained embedded model (no warm start) and a batch its HF backend sampled: the
world of the update, forward-pass, hook-layout, labeling and hf backend tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import EmbeddedModelConfig
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.types import SamplingParams
from alignzoo.world.model import build_model
from alignzoo.world.tokenizer import build_tokenizer

TINY = EmbeddedModelConfig(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_steps=0, seed=3
)
PROMPTS = ["12+7=", "3+45=", "1+1=", "100+250="]  # different lengths: left padding matters


def build_world() -> tuple[object, object]:
    """(model, tokenizer): the embedded model of TINY's size, untrained."""
    tokenizer = build_tokenizer()
    return build_model(TINY, tokenizer), tokenizer


def sampled(model, tokenizer, n: int = 2) -> RolloutBatch:
    backend = HFBackend({"max_batch_size": 3})
    backend.on_run_start(
        SimpleNamespace(tokenizer=tokenizer, device=lambda role: "cpu", actor=model)
    )
    torch.manual_seed(0)
    return backend.generate(PROMPTS, [], n, SamplingParams(max_new_tokens=6))
