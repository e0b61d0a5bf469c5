"""The embedded default world: an arithmetic task, a tokenizer and a small causal LM built locally.

- :mod:`alignzoo.world.task`: the arithmetic task (``"12+7="`` -> ``"19"``), deterministic
  train/eval splits, answer extraction and checking.
- :mod:`alignzoo.world.tokenizer`: a byte-level BPE tokenizer, one token per byte (per digit).
- :mod:`alignzoo.world.model`: a small Qwen2 / Llama causal LM and atomic ``save_policy``.
- :mod:`alignzoo.world.warmstart`: ``ensure_policy`` (the folder a run loads its policy from),
  the cached supervised warm start and ``greedy_exact_match``.

Importing this package imports nothing heavy; the submodules (except ``task``) import torch
and transformers.
"""
