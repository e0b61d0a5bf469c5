"""The embedded tokenizer: a byte-level BPE with no merges, so every byte is one token.

Why byte-level BPE and not a character vocabulary: under transformers 5 a model folder whose
config says ``qwen2`` reloads its tokenizer through ``Qwen2Tokenizer``, which rebuilds the
pre-tokenizer (GPT-2-style regex split + ByteLevel) and adds an NFC normalizer. A plain
character-level vocabulary loses its spaces on that path; a byte-level BPE with one token per
byte (so one token per digit) encodes and decodes identically before and after the reload.

Padding side is **left** (saved in ``tokenizer_config.json``): batched generation pads prompts
on the left so every prompt ends where the response begins. Code that pads full sequences for
training can still pass explicit masks; nothing here depends on right padding.

Special tokens: ``<|pad|>`` (id 0) and ``<|endoftext|>`` (id 1, the EOS; also the model's BOS
id). No BOS is added when encoding.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 512


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the embedded tokenizer: 2 special tokens + the 256 byte-level symbols, no merges.

    Every printable ASCII character (each digit in particular) is exactly one token, and
    ``decode(encode(text)) == text`` for any printable ASCII text, also after
    ``save_pretrained`` and ``AutoTokenizer.from_pretrained`` of a Qwen2 or Llama model folder.
    """
    vocab: dict[str, int] = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    # Sorted so that ids are deterministic (the alphabet is returned as an unordered list).
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        model_max_length=MODEL_MAX_LENGTH,
    )
    return tokenizer
