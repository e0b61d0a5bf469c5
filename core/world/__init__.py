"""The embedded default world: an arithmetic task, a tokenizer and a small causal LM built locally."""
