"""A small local chat model as real ones are built: a Qwen2-style byte-level BPE tokenizer with
merges (Qwen2's pre-tokenizer regex, NFC), ChatML special tokens and a Qwen2.5-style
tool-calling chat template (tools listed in the system message, calls between ``<tool_call>``
tags, tool results in ``<tool_response>`` inside a user turn), on a randomly initialised Qwen2
model. Built offline in a second; saved with ``save_pretrained`` so that both backends (hf, and
vLLM which loads the folder itself) read it the way they read a downloaded checkpoint.

With merges, text decoded from sampled ids does not encode back to the same ids in general (a
sampled "a" + "bc" re-encodes as "ab" + "c"): the drift that multi-turn rollouts must avoid.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from alignzoo.config.schema import EmbeddedModelConfig
from alignzoo.plugin import Environment, hookimpl
from alignzoo.rollout.episode import EpisodeStart, StepResult
from alignzoo.world.model import build_model, save_policy

# Qwen2's pre-tokenizer split (tokenizer.json of the Qwen2 family).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOOL_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
        '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'system' and loop.first %}
    {%- elif m.role == 'user' or m.role == 'system' or (m.role == 'assistant' and not m.tool_calls) %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if m.content %}{{- '\\n' + m.content }}{%- endif %}
        {%- for tc in m.tool_calls %}
            {{- '\\n<tool_call>\\n{\\"name\\": \\"' + tc.function.name + '\\", \\"arguments\\": ' }}
            {{- tc.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "an",
    "each",
    "she",
    "which",
    "do",
    "their",
    "time",
    "if",
    "will",
    "way",
    "about",
    "many",
    "then",
    "them",
    "write",
    "would",
    "like",
    "so",
    "these",
    "her",
    "long",
    "make",
    "thing",
    "see",
    "him",
    "two",
    "has",
    "look",
    "more",
    "day",
    "could",
    "go",
    "come",
    "did",
    "number",
    "sound",
    "no",
    "most",
    "people",
    "my",
    "over",
    "know",
    "water",
    "than",
    "call",
    "first",
    "who",
    "may",
    "down",
    "side",
    "been",
    "now",
    "find",
    "any",
    "new",
    "work",
    "part",
    "take",
    "get",
    "place",
    "made",
    "live",
    "where",
    "after",
    "back",
    "little",
    "only",
    "round",
    "man",
    "year",
    "came",
    "show",
    "every",
    "good",
    "me",
    "give",
    "our",
    "under",
    "name",
    "very",
    "through",
    "just",
    "form",
    "sentence",
    "great",
    "think",
    "say",
    "help",
    "calculator",
    "add",
    "search",
    "weather",
    "result",
    "answer",
    "error",
    "function",
    "arguments",
    "expression",
    "tool",
]


def _corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out += [
            words.capitalize() + rng.choice([".", "?", "!", ""]),
            f'{{"name": "{rng.choice(WORDS)}", "arguments": {{"a": {a}, "b": {b}}}}}',
            f"{a}{rng.choice('+-*')}{b}={a + b}",
        ]
    return out


def build_bpe_chat_tokenizer(vocab_size: int = 800) -> PreTrainedTokenizerFast:
    """The Qwen2-style BPE tokenizer with the tool-calling chat template (EOS ``<|im_end|>``,
    pad ``<|endoftext|>``, left padding)."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=512,
    )
    tokenizer.add_tokens(ADDED)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def save_bpe_chat_policy(folder: Path, dims: dict[str, int] | None = None, seed: int = 0) -> Path:
    """A random Qwen2 model over that tokenizer, saved with it to ``folder``."""
    tokenizer = build_bpe_chat_tokenizer()
    sizes = dims or {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "intermediate_size": 128}
    model = build_model(EmbeddedModelConfig(**sizes, seed=seed), tokenizer)
    return save_policy(model, tokenizer, folder)


class Recorder:
    """Plugin that forwards ``generate_ids`` to ``backend`` and keeps every call's contexts and
    outputs (register it instead of the backend)."""

    kind = "backend"

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.calls: list[tuple[list[list[int]], list[tuple[list[int], list[float]]]]] = []

    @hookimpl
    def generate_ids(self, contexts, sampling, seeds, stop_token_ids):
        out = self.backend.generate_ids(contexts, sampling, seeds, stop_token_ids)
        self.calls.append(([list(c) for c in contexts], [(list(i), list(lp)) for i, lp in out]))
        return out


class Answers(Environment):
    """Offers a calculator schema (rendered by the template) and answers each turn with the
    row's ``answers`` (one tool message per text, in turn order) until they run out."""

    @hookimpl
    def env_reset(self, row, seed):
        messages = [{"role": "user", "content": row["prompt"]}]
        return EpisodeStart({"left": list(row["answers"])}, messages, tools=[CALCULATOR])

    @hookimpl
    def env_step(self, state, turn):
        if not state["left"]:
            return StepResult(done=True)
        text = state["left"].pop(0)
        return StepResult([{"role": "tool", "name": "calculator", "content": text}])


CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def runs(mask_row: list[float], ids: list[int], value: int) -> list[list[int]]:
    """The maximal runs of ``ids`` whose mask is ``value``, in order."""
    out: list[list[int]] = []
    previous = None
    for m, t in zip(mask_row, ids, strict=True):
        if int(m) == value:
            if previous != value:
                out.append([])
            out[-1].append(t)
        previous = int(m)
    return out


def check_token_in_token_out(
    batch: Any, recorder: Recorder, tokenizer: Any, model: Any, atol: float = 1e-4
) -> int:
    """The drift property on one batch of episodes; returns how many rows would have drifted
    had their text been re-tokenised (the premise that this tokenizer can drift).

    - the prompt part is the rendered start, tokenised once;
    - every trained run is one backend output, as sampled, and each turn was sampled from
      exactly the ids before it (prompt, earlier turns, environment answers);
    - the mask is 1 exactly on sampled ids, 0 on the environment's (each run the tokenised
      text the template puts between turns);
    - the trainer's log-probs of the sampled ids equal the sampler's (within ``atol``).
    """
    import torch

    from alignzoo.kernels.forward import policy_forward

    outputs: dict[tuple[int, ...], list[list[int]]] = {}  # context -> what was sampled from it
    for contexts, outs in recorder.calls:
        for context, (ids, _) in zip(contexts, outs, strict=True):
            outputs.setdefault(tuple(context), []).append(ids)
    drifted = 0
    for row in range(batch.size):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        length = int(batch.response_attention[row].sum())
        ids = batch.response_ids[row, :length].tolist()
        trained = batch.response_mask[row, :length].tolist()
        assert set(trained) <= {0.0, 1.0} and batch.response_attention[row, length:].sum() == 0
        position, sampled_turns = 0, 0
        cut = batch.extras[row]["episode"]["outcome"] == "truncated"
        while position < length:
            if trained[position]:  # a model turn: exactly what the backend returned here
                end = position
                while end < length and trained[end]:
                    end += 1
                context = tuple(prompt + ids[:position])
                run = ids[position:end]
                # A turn is kept whole, or cut at the episode's token limit (its last run).
                assert any(
                    out == run or (cut and end == length and out[: len(run)] == run)
                    for out in outputs.get(context, [])
                ), f"row {row}: ids[{position}:{end}] are not a turn sampled from the ids before"
                position = end
                sampled_turns += 1
            else:  # the environment's answer: tokenised once, never trained
                end = position
                while end < length and not trained[end]:
                    end += 1
                between = ids[position:end]
                assert (cut and end == length) or (
                    tokenizer(tokenizer.decode(between), add_special_tokens=False)["input_ids"]
                    == between
                ), f"row {row}: the environment's ids are not one tokenisation"
                position = end
        assert sampled_turns == batch.extras[row]["episode"]["turns"]
        text = tokenizer.decode(prompt + ids)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != prompt + ids:
            drifted += 1
    with torch.no_grad():
        logprobs, _ = policy_forward(model, batch)
    mask = batch.response_mask.bool()
    difference = (logprobs - batch.rollout_logprobs).abs()[mask]
    assert float(difference.max()) < atol, float(difference.max())
    return drifted
