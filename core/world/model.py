"""The embedded policy: a small Qwen2 (or Llama) causal LM built from a transformers config.

It is saved with ``save_pretrained`` (safetensors) together with its tokenizer, and every later
use loads it back through ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``: the same
path a user with a real checkpoint takes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from alignzoo.config.schema import EmbeddedModelConfig

MAX_POSITIONS = 512
METADATA_FILE = "alignzoo_world.json"


def build_model(cfg: EmbeddedModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """Build a randomly initialised causal LM sized by ``cfg``, seeded by ``cfg.seed``.

    The vocabulary is the tokenizer's, pad/eos ids come from it, input and output embeddings
    are tied. ``cfg.architecture`` picks Qwen2ForCausalLM ("qwen2") or LlamaForCausalLM.
    The global torch RNG is left as it was.
    """
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"model.embedded.hidden_size ({cfg.hidden_size}) must be divisible by "
            f"num_heads ({cfg.num_heads})"
        )
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.architecture == "llama":
            model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**common))
        else:
            model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.eos_token_id
    return model


def save_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: str | Path,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write model (safetensors) and tokenizer to ``folder`` atomically and return its path.

    Everything is written to a temporary sibling folder first, then moved into place with
    ``os.replace``: a reader never sees a half-written folder. An existing ``folder`` is
    replaced. ``metadata``, when given, is written inside as ``METADATA_FILE`` (json).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if metadata is not None:
            (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
        if folder.exists():
            # os.replace cannot replace a non-empty directory: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            os.replace(folder, old / "x")
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
