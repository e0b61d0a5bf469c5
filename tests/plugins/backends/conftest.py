"""Tiny causal LMs for backend tests, saved and loaded back through the Auto classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignzoo.config.schema import EmbeddedModelConfig
from alignzoo.world.model import build_model, save_policy
from alignzoo.world.tokenizer import build_tokenizer

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def _save_tiny_policy(
    folder: Path, scale: float, layer_scale: float, eos_boost: float, dims: dict | None = None
) -> Path:
    """A tiny Qwen2 policy with peaked, context-dependent logits and, optionally, a taste for EOS.

    The embeddings are tied to the output layer: at initialisation the model mostly predicts
    the token it just read. Scaling the layer's projections by ``layer_scale`` lets the
    context dominate, so greedy continuations differ between prompts. Setting feature 0 of every embedding to 1 and
    that of EOS to ``1 + eos_boost`` adds (about) ``eos_boost * h_0`` to the EOS logit at every
    position, so sampled responses end at varied lengths. ``dims``: the model's sizes
    (default TINY).
    """
    tokenizer = build_tokenizer()
    model = build_model(EmbeddedModelConfig(**(dims or TINY), seed=3), tokenizer)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(scale)
        for name, param in model.model.layers.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(layer_scale)
        if eos_boost:
            emb[:, 0] = 1.0
            emb[tokenizer.eos_token_id, 0] = 1.0 + eos_boost
    return save_policy(model, tokenizer, folder)


@pytest.fixture(scope="session")
def policy_dirs(tmp_path_factory) -> dict[str, Path]:
    """'plain': rarely stops before max_new_tokens; 'stopping': ends at varied lengths."""
    root = tmp_path_factory.mktemp("policies")
    return {
        "plain": _save_tiny_policy(root / "plain", scale=4.0, layer_scale=10.0, eos_boost=0.0),
        "stopping": _save_tiny_policy(root / "stopping", scale=1.0, layer_scale=1.0, eos_boost=0.7),
    }


def load_policy(folder: Path):
    """(model, tokenizer) through the user's path: AutoModelForCausalLM / AutoTokenizer."""
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
