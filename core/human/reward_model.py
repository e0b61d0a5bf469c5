"""Bradley-Terry reward models: ``alignzoo train-rm DATA --base MODEL --out DIR``.

A reward model r(x, y) is an ``AutoModelForSequenceClassification`` with one output, read at
the last token of ``prompt + response``. Trained on preference pairs (prompt, chosen, rejected)
with the Bradley-Terry likelihood (Bradley & Terry 1952; Ouyang et al. 2022, eq. 1):

    P(chosen > rejected) = sigmoid(r(x, y_c) - r(x, y_r))
    loss = -mean log sigmoid(r(x, y_c) - r(x, y_r))

The pairs are split by prompt into training and held-out sets (no prompt in both). Reported on
the held-out pairs: the pairwise accuracy (r(x, y_c) > r(x, y_r)), and the calibration of
P(chosen > rejected) as the expected calibration error over 10 bins and the Brier score, both
over each pair in both orders (so the outcomes are not all 1).

Synthetic negatives (``negatives``): a function ``fn(prompt, response) -> str | None`` that
turns a chosen response into a near miss (for arithmetic, the same answer off by a little:
``alignzoo.world.task.near_miss``) adds the pair (chosen, near miss) for each training pair, so
the model learns the fine distinction. The output folder (``save_pretrained``, with the
tokenizer) is what the ``reward_model`` labeler loads; ``train_rm.json`` holds the metrics.

Texts are encoded as the ``reward_model`` labeler encodes them (:func:`encode`): right padding,
truncation from the left, the tokenizer's special tokens.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from alignzoo.errors import UserError

METRICS_FILE = "train_rm.json"
Negatives = Callable[[str, str], "str | None"]


def prepare(tokenizer: Any, model: Any | None = None) -> Any:
    """Set ``tokenizer`` up as reward models read text: a pad token (the EOS when it has none),
    right padding, truncation from the left (the end of a response is kept); the model learns
    the pad id, so it reads the score at the last real token."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def encode(tokenizer: Any, texts: Sequence[str], max_length: int, special: bool = True) -> Any:
    """``texts`` as one padded batch (``input_ids``, ``attention_mask``)."""
    return tokenizer(
        list(texts),
        padding=True,
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
        add_special_tokens=special,
    )


def rewards(model: Any, tokenizer: Any, texts: Sequence[str], max_length: int) -> torch.Tensor:
    """r for each text ``[N]`` (with gradients when the model is training)."""
    batch = encode(tokenizer, texts, max_length)
    device = next(model.parameters()).device
    out = model(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
    )
    return out.logits[:, 0].float()


@dataclass
class Pair:
    prompt: str
    chosen: str
    rejected: str


@dataclass
class RewardModelReport:
    """What :func:`train_reward_model` measured (also ``train_rm.json`` in the output)."""

    base: str
    data: str
    train_pairs: int
    heldout_pairs: int
    synthetic_negatives: int
    epochs: int
    final_train_loss: float
    heldout_accuracy: float
    heldout_ece: float
    heldout_brier: float
    heldout_loss: float
    seed: int
    train_accuracy: float = math.nan
    history: list[dict[str, float]] = field(default_factory=list)


def split_by_prompt(
    pairs: Sequence[Pair], heldout: float, seed: int
) -> tuple[list[Pair], list[Pair]]:
    """Training and held-out pairs, whole prompts on one side (about ``heldout`` of them held
    out, at least one when there are two prompts or more)."""
    prompts = sorted({p.prompt for p in pairs})
    random.Random(seed).shuffle(prompts)
    n_out = min(len(prompts) - 1, max(1, round(heldout * len(prompts)))) if len(prompts) > 1 else 0
    out = set(prompts[:n_out])
    return [p for p in pairs if p.prompt not in out], [p for p in pairs if p.prompt in out]


def calibration(margins: torch.Tensor, bins: int = 10) -> tuple[float, float]:
    """Expected calibration error and Brier score of P = sigmoid(margin) for pairs whose first
    response is the chosen one, each pair counted in both orders (P with outcome 1, 1 - P with 0)."""
    p = torch.sigmoid(margins.double())
    probs = torch.cat([p, 1 - p])
    outcomes = torch.cat([torch.ones_like(p), torch.zeros_like(p)])
    brier = float(((probs - outcomes) ** 2).mean())
    ece = 0.0
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    for k in range(bins):
        upper = probs <= edges[k + 1] if k == bins - 1 else probs < edges[k + 1]
        inside = (probs >= edges[k]) & upper
        if inside.any():
            gap = abs(float(probs[inside].mean()) - float(outcomes[inside].mean()))
            ece += gap * float(inside.double().mean())
    return ece, brier


def _margins(
    model: Any, tokenizer: Any, pairs: Sequence[Pair], max_length: int, batch_size: int
) -> torch.Tensor:
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        texts = [p.prompt + p.chosen for p in chunk] + [p.prompt + p.rejected for p in chunk]
        r = rewards(model, tokenizer, texts, max_length)
        out.append(r[: len(chunk)] - r[len(chunk) :])
    return torch.cat(out) if out else torch.zeros(0)


def evaluate_pairs(
    model: Any, tokenizer: Any, pairs: Sequence[Pair], max_length: int = 256, batch_size: int = 32
) -> dict[str, float]:
    """Accuracy, Bradley-Terry loss, ECE and Brier score of ``model`` on ``pairs``."""
    if not pairs:
        return {"accuracy": math.nan, "loss": math.nan, "ece": math.nan, "brier": math.nan}
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            margins = _margins(model, tokenizer, pairs, max_length, batch_size)
    finally:
        model.train(was_training)
    ece, brier = calibration(margins)
    return {
        "accuracy": float((margins > 0).double().mean()),
        "loss": float(-torch.nn.functional.logsigmoid(margins.double()).mean()),
        "ece": ece,
        "brier": brier,
    }


def load_pairs(data: str | Path) -> list[Pair]:
    """Preference pairs from a file or ``save_to_disk`` folder with prompt, chosen, rejected
    (what ``alignzoo annotate export`` writes), read as an experiment's data is."""
    from alignzoo.config.schema import DataConfig
    from alignzoo.engine.datasets import load_split

    rows = load_split(DataConfig(train=str(data), eval="embedded"), "train", "preference")
    return [Pair(r["prompt"], r["chosen"], r["rejected"]) for r in rows.to_list()]


def with_negatives(pairs: Sequence[Pair], negatives: Negatives | None) -> tuple[list[Pair], int]:
    """``pairs`` plus (chosen, near miss) for each pair whose chosen response ``negatives``
    can perturb (a near miss equal to the chosen response is skipped)."""
    out = list(pairs)
    added = 0
    if negatives is None:
        return out, 0
    seen = set()
    for pair in pairs:
        miss = negatives(pair.prompt, pair.chosen)
        key = (pair.prompt, pair.chosen, miss)
        if miss is None or miss == pair.chosen or key in seen:
            continue
        seen.add(key)
        out.append(Pair(pair.prompt, pair.chosen, miss))
        added += 1
    return out, added


def train_reward_model(
    data: str | Path,
    base: str,
    out: str | Path,
    epochs: int = 3,
    lr: float = 1e-3,
    batch_size: int = 16,
    heldout: float = 0.2,
    max_length: int = 256,
    seed: int = 0,
    negatives: Negatives | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> RewardModelReport:
    """Train a Bradley-Terry reward model from ``base`` (a model folder) on the pairs in
    ``data`` into ``out``; returns the held-out metrics (also written to ``out/train_rm.json``)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    pairs = load_pairs(data)
    if len(pairs) < 2:
        raise UserError(f"{data}: {len(pairs)} preference pair(s); train-rm needs at least 2")
    train, held = split_by_prompt(pairs, heldout, seed)
    train, added = with_negatives(train, negatives)
    torch.manual_seed(seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    except (OSError, ValueError) as exc:
        raise UserError(f"--base {base}: cannot load a model and tokenizer ({exc})") from None
    prepare(tokenizer, model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    order = random.Random(seed)
    history = []
    last = math.nan
    for epoch in range(epochs):
        shuffled = list(train)
        order.shuffle(shuffled)
        losses = []
        for start in range(0, len(shuffled), batch_size):
            chunk = shuffled[start : start + batch_size]
            margins = _margins(model, tokenizer, chunk, max_length, batch_size)
            loss = -torch.nn.functional.logsigmoid(margins).mean()  # -log sigmoid(r_c - r_r)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        last = sum(losses) / len(losses)
        row = {"epoch": epoch + 1, "train_loss": last}
        held_metrics = evaluate_pairs(model, tokenizer, held, max_length)
        row.update({f"heldout_{k}": v for k, v in held_metrics.items()})
        history.append(row)
        log(
            f"epoch {epoch + 1}: train loss {last:.4f}, held-out accuracy {row['heldout_accuracy']:.3f}"
        )
    final = evaluate_pairs(model, tokenizer, held, max_length)
    report = RewardModelReport(
        base=str(base),
        data=str(data),
        train_pairs=len(train),
        heldout_pairs=len(held),
        synthetic_negatives=added,
        epochs=epochs,
        final_train_loss=last,
        heldout_accuracy=final["accuracy"],
        heldout_ece=final["ece"],
        heldout_brier=final["brier"],
        heldout_loss=final["loss"],
        seed=seed,
        train_accuracy=evaluate_pairs(model, tokenizer, train, max_length)["accuracy"],
        history=history,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / METRICS_FILE).write_text(json.dumps(asdict(report), indent=2), encoding="utf-8")
    return report
