"""The embedded policy, warm-started by a short supervised phase and cached by its config.

:func:`ensure_policy` is what a run calls: for ``model.policy: embedded`` it returns a model
folder (save_pretrained layout) under the cache, building it on first use. The cache key is a
hash of the embedded model config, the task config and :data:`FORMAT_VERSION`; the cache root is
``$ALIGNZOO_CACHE`` or ``~/.cache/alignzoo``. A build is written to a temporary folder and
renamed into place, under a per-key file lock: a killed build leaves no half folder, and two
processes asking for the same key at once build it once.

The warm start is teacher forcing on ``prompt + answer + EOS`` with the loss on the answer and
EOS tokens only (AdamW, short linear warm-up then cosine decay), seeded by the config's seed.
Its demonstrations come from :func:`~alignzoo.world.task.teacher_demonstrations`: with
``sft_slip > 0`` a share of the carrying/borrowing prompts show the answer with the units carry
(or borrow) dropped, so the policy starts with a wrong greedy answer that it still samples the
right answer to now and then, which RL from the verifier can train it out of.
The greedy exact match on the eval split is measured and stored in the folder's
``alignzoo_world.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from alignzoo.config.schema import EmbeddedModelConfig, ModelConfig, TaskConfig
from alignzoo.errors import UserError
from alignzoo.world.calculator import scripted_demonstrations
from alignzoo.world.model import METADATA_FILE, build_model, save_policy
from alignzoo.world.task import is_correct, make_examples, teacher_demonstrations
from alignzoo.world.tokenizer import build_tokenizer

FORMAT_VERSION = 1
"""Bump when the tokenizer, model builder, task or warm start change what a key builds."""

IGNORE_INDEX = -100


def cache_root() -> Path:
    """``$ALIGNZOO_CACHE`` or ``~/.cache/alignzoo``."""
    env = os.environ.get("ALIGNZOO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "alignzoo"


def cache_key(
    embedded: EmbeddedModelConfig, task: TaskConfig, examples: Examples | None = None
) -> str:
    """A short hash naming the cached policy for these configs (and, for ``sft_on: train``,
    the demonstrations and eval rows themselves)."""
    # Fields added after a policy was cached leave its key alone while at their defaults.
    unset = {"sft_tool_share"} if embedded.sft_tool_share == 0 else set()
    unset |= {"sft_on"} if embedded.sft_on == "task" else set()
    content: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "embedded": embedded.model_dump(mode="json", exclude=unset),
        "task": task.model_dump(mode="json"),
    }
    if examples is not None:
        content["examples"] = hashlib.sha256(
            json.dumps(examples, sort_keys=True).encode()
        ).hexdigest()
    payload = json.dumps(content, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


Examples = dict[str, list[dict[str, str]]]
"""The warm start's ``train`` demonstrations and ``eval`` rows (``prompt``, ``answer``)."""


def read_metadata(folder: str | Path) -> dict[str, Any]:
    """The warm start's record (configs, steps, final loss, eval exact match) of a cached policy."""
    return json.loads((Path(folder) / METADATA_FILE).read_text())


def ensure_policy(
    model_cfg: ModelConfig,
    task_cfg: TaskConfig,
    cache_dir: Path | None = None,
    log: Callable[[str], None] = print,
    examples: Examples | None = None,
) -> Path:
    """The folder to ``from_pretrained`` the policy (and its tokenizer) from.

    A path policy is returned as is (it must be an existing folder). ``"embedded"`` is built,
    warm-started and cached on first use (see the module docstring); later calls return the
    cached folder at once. ``examples``: with ``model.embedded.sft_on: train``, the
    experiment's own train and eval rows (:func:`alignzoo.engine.datasets.warm_start_examples`).
    """
    if model_cfg.policy != "embedded":
        path = Path(model_cfg.policy).expanduser()
        if not path.is_dir():
            raise UserError(
                f"model.policy: {model_cfg.policy!r} is not a folder (give 'embedded' or a local "
                "folder written by save_pretrained; no hub downloads on this machine)"
            )
        return path
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    if model_cfg.embedded.sft_on == "train" and examples is None:
        raise UserError("model.embedded.sft_on: train needs the experiment's data")
    if model_cfg.embedded.sft_on == "task":
        examples = None
    key = cache_key(model_cfg.embedded, task_cfg, examples)
    folder = root / "embedded" / key
    if _cache_problem(folder) is None:
        log(f"embedded policy: using cached {folder}")
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder.parent / f"{key}.lock"):
        problem = _cache_problem(folder)
        if problem is None:  # another process built it while we waited
            log(f"embedded policy: using cached {folder}")
            return folder
        if folder.exists():
            log(f"embedded policy: the cached {folder} is damaged ({problem}); rebuilding it")
        _build(model_cfg.embedded, task_cfg, folder, log, examples)
    return folder


def _cache_problem(folder: Path) -> str | None:
    """Why the cached folder cannot be used (absent, or a file missing or unreadable), or None.

    A folder is only ever renamed into place complete, so damage means someone or something
    changed it afterwards (a full disk, a copy cut short); every tensor is read to be sure.
    """
    if not folder.is_dir():
        return "not built yet"
    for name in (METADATA_FILE, "config.json", "tokenizer.json", "model.safetensors"):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        try:
            if name.endswith(".json"):
                json.loads(path.read_bytes().decode("utf-8"))
            else:
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                        handle.get_tensor(key)
        except Exception as exc:  # bad UTF-8 or JSON, a truncated safetensors file
            return f"{name} is unreadable: {type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl); without fcntl the atomic rename alone protects."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(
    cfg: EmbeddedModelConfig,
    task: TaskConfig,
    folder: Path,
    log: Callable[[str], None],
    examples: Examples | None = None,
) -> None:
    log(
        f"embedded policy: building {cfg.architecture} (hidden {cfg.hidden_size}, "
        f"{cfg.num_layers} layers) and warm-starting for {cfg.sft_steps} steps -> {folder}"
    )
    start = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(cfg, tokenizer)
    if examples is None:
        examples = {split: make_examples(task, split) for split in ("train", "eval")}  # type: ignore[arg-type]
    demonstrations, slips = teacher_demonstrations(examples["train"], cfg.sft_slip, cfg.seed)
    traces, tool_calls = scripted_demonstrations(demonstrations, cfg.sft_tool_share, cfg.seed)
    final_loss = supervised_warm_start(model, tokenizer, traces, cfg, log)
    eval_examples = examples["eval"]
    exact = greedy_exact_match(model, tokenizer, eval_examples, _max_answer_tokens(eval_examples))
    seconds = time.perf_counter() - start
    metadata = {
        "format": FORMAT_VERSION,
        "embedded": cfg.model_dump(mode="json"),
        "task": task.model_dump(mode="json"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_final_loss": final_loss,
        "sft_slipped_demonstrations": slips,
        "sft_demonstrations": len(demonstrations),
        "sft_tool_demonstrations": tool_calls,
        "eval_exact_match": exact,
        "eval_size": len(eval_examples),
        "build_seconds": round(seconds, 1),
    }
    save_policy(model, tokenizer, folder, metadata=metadata)
    log(f"embedded policy: eval exact match {exact:.1%} after {seconds:.0f}s")


def _max_answer_tokens(examples: Sequence[dict[str, str]]) -> int:
    # One token per character, plus EOS and a little slack for longer wrong answers.
    return max(len(ex["answer"]) for ex in examples) + 2


def _encode_sft(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[dict[str, Any]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + EOS`` ids, attention mask and labels (answer + EOS).

    An example with ``segments`` (a scripted calculator trace, ``(text, trained)`` pairs)
    has them in place of its answer, labels only on the trained ones (and EOS)."""
    rows, labels = [], []
    for ex in examples:
        prompt = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
        row, label = list(prompt), [IGNORE_INDEX] * len(prompt)
        for text, trained in ex.get("segments") or [(ex["answer"], True)]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            row += ids
            label += ids if trained else [IGNORE_INDEX] * len(ids)
        rows.append([*row, tokenizer.eos_token_id])
        labels.append([*label, tokenizer.eos_token_id])
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (row, lab) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        targets[i, : len(lab)] = torch.tensor(lab)
    return ids, mask, targets


def supervised_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[dict[str, Any]],
    cfg: EmbeddedModelConfig,
    log: Callable[[str], None] = print,
) -> float:
    """Train ``model`` in place for ``cfg.sft_steps`` steps of teacher forcing; return the mean
    loss of the last steps (``nan`` when ``sft_steps`` is 0).

    Each step draws ``cfg.sft_batch_size`` examples with replacement; the loss is the mean
    cross-entropy of the answer and EOS tokens. Seeded by ``cfg.seed``.
    """
    if cfg.sft_steps == 0:
        return math.nan
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    ids, mask, targets = _encode_sft(tokenizer, examples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    warmup = max(1, cfg.sft_steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.sft_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    recent: list[float] = []
    report_every = max(1, cfg.sft_steps // 5)
    for step in range(cfg.sft_steps):
        index = torch.randint(len(examples), (cfg.sft_batch_size,), generator=generator)
        width = int(mask[index].sum(dim=1).max())
        batch_ids, batch_mask, batch_targets = (t[index, :width] for t in (ids, mask, targets))
        logits = model(input_ids=batch_ids, attention_mask=batch_mask).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            batch_targets[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        recent = [*recent[-19:], float(loss.detach())]
        if (step + 1) % report_every == 0 or step + 1 == cfg.sft_steps:
            log(
                f"  warm start step {step + 1}/{cfg.sft_steps} loss {sum(recent) / len(recent):.4f}"
            )
    model.eval()
    return sum(recent) / len(recent)


@torch.no_grad()
def greedy_exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[dict[str, str]],
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Fraction of ``examples`` whose greedy completion states the right answer (batched).

    Prompts are left-padded; completions stop at EOS; correctness is
    :func:`alignzoo.world.task.is_correct`. The model's train/eval mode is restored.
    """
    if not examples:
        return 0.0
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    correct = 0
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            enc = tokenizer(
                [ex["prompt"] for ex in chunk],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(device)
            out = model.generate(  # type: ignore[operator]
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(
                out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
            )
            correct += sum(is_correct(t, ex["answer"]) for t, ex in zip(texts, chunk, strict=True))
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return correct / len(examples)
