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

Probes beyond pairwise accuracy (:func:`probe`, in ``train_rm.json`` under ``probes``): top-1
accuracy over candidate sets (each held-out chosen response against perturbations of it from
the same kind of function as ``negatives``, applied in a chain: a shortcut that ranks the pairs
still fails to single the right response out), the scores of out-of-distribution responses
(empty, one constant answer, a very long one) relative to the chosen response, and the Wilson
95% interval of the held-out accuracy with a warning when the held-out set is too small to say
anything (fewer than :data:`MIN_HELDOUT` pairs or an interval wider than
:data:`MAX_INTERVAL`).

Ensembles (:func:`train_ensemble`, ``train-rm --ensemble K``): K members, each a normal
reward-model folder ``OUT/member-i`` trained with seed ``seed + i`` on a bootstrap resample of
the training pairs (the held-out prompts are the same for all), listed in ``OUT/ensemble.json``.
The ``reward_model`` labeler loads such a folder and aggregates the members' scores
(:func:`aggregate`: the mean, or conservatively mean - lambda * std or the min, as in
Coste et al. 2024, "Reward Model Ensembles Help Mitigate Overoptimization").
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from alignzoo.errors import UserError

METRICS_FILE = "train_rm.json"
ENSEMBLE_FILE = "ensemble.json"
Negatives = Callable[[str, str], "str | Sequence[str] | None"]
Aggregate = Literal["mean", "mean_minus_std", "min"]
# A held-out set is too small to say anything below this many pairs, or when the Wilson 95%
# interval of its accuracy is wider than MAX_INTERVAL.
MIN_HELDOUT = 30
MAX_INTERVAL = 0.2
# Candidates per top-1 set: the chosen response and up to this many perturbations of it.
TOP1_PERTURBATIONS = 4


def load_classifier(folder: Path, dtype: str) -> tuple[Any, Any]:
    """(tokenizer, AutoModelForSequenceClassification) from a local ``folder`` in ``dtype``;
    a folder that holds none is a UserError naming ``labeler.params.path``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from alignzoo.errors import UserError

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=getattr(torch, dtype)
        )
    except (OSError, ValueError) as exc:
        raise UserError(
            f"labeler.params.path: cannot load a sequence-classification model and "
            f"tokenizer from '{folder}': {exc}"
        ) from exc
    return tokenizer, model


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


def recorded_path(path: str | Path, out: str | Path) -> str:
    """``path`` as ``train_rm.json`` records it: relative to the output folder ``out`` when it
    lies in the folder that holds ``out`` (a pipeline's or a run's own files: the warm start
    and preferences beside it), so the record stays true when that folder is moved or read
    from another working directory; anything else (a hub id, a model elsewhere) as given."""
    given = Path(path).expanduser()
    if not given.exists():
        return str(path)
    home = Path(out).absolute()
    found = given.absolute()
    if not found.is_relative_to(home.parent):
        return str(found)
    return os.path.relpath(found, home)


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
    heldout_interval: list[float] = field(default_factory=list)
    probes: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    bootstrap: bool = False
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


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% for z = 1.96) of a proportion ``successes / n``."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def heldout_warning(accuracy: float, n: int) -> str | None:
    """Why ``n`` held-out pairs are too few to say anything (None when they are enough)."""
    lo, hi = wilson(accuracy * n, n) if not math.isnan(accuracy) else (0.0, 1.0)
    if n < MIN_HELDOUT or hi - lo > MAX_INTERVAL:
        return (
            f"held-out set too small to say much: {n} pair(s), accuracy "
            f"{accuracy:.3f} with a 95% interval [{lo:.3f}, {hi:.3f}] (wanted at least "
            f"{MIN_HELDOUT} pairs and an interval at most {MAX_INTERVAL} wide)"
        )
    return None


def aggregate(values: Sequence[float], how: Aggregate = "mean", std_coef: float = 1.0) -> float:
    """One score from the ensemble members' ``values``: their mean, mean - ``std_coef`` * std
    (population std, over the members) or their min (Coste et al. 2024)."""
    if not values:
        raise ValueError("aggregate needs at least one member score")
    mean = sum(values) / len(values)
    if how == "mean":
        return mean
    if how == "min":
        return min(values)
    if how == "mean_minus_std":
        return mean - std_coef * member_std(values)
    raise ValueError(f"aggregate: unknown {how!r} (mean, mean_minus_std, min)")


def member_std(values: Sequence[float]) -> float:
    """The members' disagreement on one sample: the population std of their scores."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def perturbed(perturb: Negatives, prompt: str, response: str) -> list[str]:
    """What ``perturb`` makes of ``response``, as a list: a function may return one
    perturbation, several, or None (nothing to perturb)."""
    made = perturb(prompt, response)
    if made is None:
        return []
    return [made] if isinstance(made, str) else [str(m) for m in made]


def candidates(
    prompt: str, chosen: str, perturb: Negatives, k: int = TOP1_PERTURBATIONS
) -> list[str]:
    """``chosen`` and its distinct perturbations: every one of them when ``perturb`` returns
    several, else up to ``k`` from applying it in a chain (to the chosen response, then to
    each perturbation), so a deterministic near-miss function still gives several."""
    out = [chosen]
    first = perturbed(perturb, prompt, chosen)
    if len(first) > 1:
        return out + [c for c in dict.fromkeys(first) if c != chosen]
    current = chosen
    for _ in range(4 * k):
        if len(out) > k:
            break
        made = perturbed(perturb, prompt, current)
        if not made:
            break
        nxt = made[0]
        if nxt not in out:
            out.append(nxt)
        current = nxt
    return out


def _scores(
    model: Any, tokenizer: Any, texts: Sequence[str], max_length: int, batch_size: int
) -> list[float]:
    out: list[float] = []
    for start in range(0, len(texts), batch_size):
        out += rewards(model, tokenizer, texts[start : start + batch_size], max_length).tolist()
    return out


def probe(
    model: Any,
    tokenizer: Any,
    held: Sequence[Pair],
    perturb: Negatives | None,
    max_length: int = 256,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Top-1 accuracy over candidate sets (with ``perturb``) and out-of-distribution scores on
    the held-out chosen responses; see the module docstring."""
    chosen = list(dict.fromkeys((p.prompt, p.chosen) for p in held))
    result: dict[str, Any] = {}
    if not chosen:
        return result
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            base = _scores(model, tokenizer, [x + y for x, y in chosen], max_length, batch_size)
            if perturb is not None:
                made = [candidates(x, y, perturb) for x, y in chosen]
                sets = [(i, c) for i, c in enumerate(made) if len(c) > 1]
                texts = [chosen[i][0] + c for i, cs in sets for c in cs]
                flat = _scores(model, tokenizer, texts, max_length, batch_size)
                right, at = 0, 0
                for _, cs in sets:
                    scores = flat[at : at + len(cs)]
                    at += len(cs)
                    right += int(scores[0] > max(scores[1:]))
                result["top1_accuracy"] = right / len(sets) if sets else math.nan
                result["top1_sets"] = len(sets)
                result["top1_candidates"] = (
                    sum(len(cs) for _, cs in sets) / len(sets) if sets else 0.0
                )
            common = max(
                sorted({y for _, y in chosen}), key=[y for _, y in chosen].count
            )  # one constant answer, the same for every prompt
            ood = {
                "empty": ["" for _ in chosen],
                "constant": [common for _ in chosen],
                "long": [" ".join([y] * 64) for _, y in chosen],
            }
            result["ood"] = {}
            for name, responses in ood.items():
                texts = [x + r for (x, _), r in zip(chosen, responses, strict=True)]
                scores = _scores(model, tokenizer, texts, max_length, batch_size)
                gaps = [s - b for s, b in zip(scores, base, strict=True)]
                result["ood"][name] = {
                    "mean_score_minus_chosen": sum(gaps) / len(gaps),
                    "share_above_chosen": sum(g > 0 for g in gaps) / len(gaps),
                }
            result["chosen_mean_score"] = sum(base) / len(base)
    finally:
        model.train(was_training)
    return result


def load_pairs(data: str | Path) -> list[Pair]:
    """Preference pairs from a file or ``save_to_disk`` folder with prompt, chosen, rejected
    (what ``alignzoo annotate export`` writes), read as an experiment's data is."""
    from alignzoo.config.schema import DataConfig
    from alignzoo.engine.datasets import load_split

    rows = load_split(DataConfig(train=str(data), eval="embedded"), "train", "preference")
    return [Pair(r["prompt"], r["chosen"], r["rejected"]) for r in rows.to_list()]


def with_negatives(
    pairs: Sequence[Pair],
    negatives: Negatives | None,
    max_per_pair: int | None = None,
    seed: int = 0,
) -> tuple[list[Pair], int]:
    """``pairs`` plus (chosen, perturbation) for each perturbation ``negatives`` makes of a
    pair's chosen response (one, several or none; one equal to the chosen response, or a pair
    already there, is skipped). ``max_per_pair``: at most that many of a pair's
    perturbations, drawn with ``seed`` (all of them when None)."""
    out = list(pairs)
    added = 0
    if negatives is None:
        return out, 0
    seen = {(p.prompt, p.chosen, p.rejected) for p in pairs}  # a pair the data has already
    for pair in pairs:
        made = perturbed(negatives, pair.prompt, pair.chosen)
        if max_per_pair is not None and len(made) > max_per_pair:
            draw = random.Random(f"negatives/{seed}/{pair.prompt}/{pair.chosen}")
            made = draw.sample(made, max_per_pair)
        for miss in made:
            key = (pair.prompt, pair.chosen, miss)
            if miss == pair.chosen or key in seen:
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
    perturbations: Negatives | None = None,
    bootstrap: bool = False,
    split_seed: int | None = None,
    max_negatives: int | None = None,
) -> RewardModelReport:
    """Train a Bradley-Terry reward model from ``base`` (a model folder) on the pairs in
    ``data`` into ``out``; returns the held-out metrics (also written to ``out/train_rm.json``).

    ``perturbations`` makes the top-1 probe's candidates (default: ``negatives``; no top-1
    probe when both are None). ``bootstrap``: train on a resample (with replacement, drawn with
    ``seed``) of the training pairs. ``split_seed`` (default ``seed``) draws the held-out
    prompts. ``max_negatives``: at most that many of ``negatives``' perturbations per training
    pair (drawn with ``seed``; the top-1 probe still uses every one)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    pairs = load_pairs(data)
    if len(pairs) < 2:
        raise UserError(f"{data}: {len(pairs)} preference pair(s); train-rm needs at least 2")
    train, held = split_by_prompt(pairs, heldout, seed if split_seed is None else split_seed)
    if bootstrap and train:
        draw = random.Random(f"bootstrap/{seed}")
        train = [train[draw.randrange(len(train))] for _ in train]
    train, added = with_negatives(train, negatives, max_negatives, seed)
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
            losses.append(float(loss.detach()))
        last = sum(losses) / len(losses)
        row = {"epoch": epoch + 1, "train_loss": last}
        held_metrics = evaluate_pairs(model, tokenizer, held, max_length)
        row.update({f"heldout_{k}": v for k, v in held_metrics.items()})
        history.append(row)
        log(
            f"epoch {epoch + 1}: train loss {last:.4f}, held-out accuracy {row['heldout_accuracy']:.3f}"
        )
    final = evaluate_pairs(model, tokenizer, held, max_length)
    lo, hi = wilson(final["accuracy"] * len(held), len(held)) if held else (0.0, 1.0)
    warning = heldout_warning(final["accuracy"], len(held))
    probes = probe(model, tokenizer, held, perturbations or negatives, max_length)
    report = RewardModelReport(
        base=recorded_path(base, out),
        data=recorded_path(data, out),
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
        heldout_interval=[lo, hi],
        probes=probes,
        warnings=[warning] if warning else [],
        bootstrap=bootstrap,
        history=history,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / METRICS_FILE).write_text(json.dumps(asdict(report), indent=2), encoding="utf-8")
    return report


@dataclass
class EnsembleReport:
    """What :func:`train_ensemble` measured (``ensemble.json`` in the output lists members)."""

    members: list[RewardModelReport]
    heldout_accuracy_mean: float
    heldout_accuracy_std: float


def train_ensemble(
    data: str | Path,
    base: str,
    out: str | Path,
    k: int,
    seed: int = 0,
    log: Callable[[str], None] = lambda _: None,
    **kwargs: Any,
) -> EnsembleReport:
    """``k`` reward models in ``out/member-0`` ... ``out/member-{k-1}``, member i trained with
    seed ``seed + i`` on a bootstrap resample of the training pairs (the held-out prompts drawn
    with ``seed``, the same for all); ``out/ensemble.json`` lists them. ``kwargs`` go to
    :func:`train_reward_model`."""
    if k < 2:
        raise UserError(f"--ensemble {k}: an ensemble has at least 2 members")
    out = Path(out)
    reports = []
    for i in range(k):
        log(f"member {i + 1}/{k} (seed {seed + i}, bootstrap of the training pairs)")
        reports.append(
            train_reward_model(
                data,
                base,
                out / f"member-{i}",
                seed=seed + i,
                split_seed=seed,
                bootstrap=True,
                log=log,
                **kwargs,
            )
        )
    accuracies = [r.heldout_accuracy for r in reports]
    manifest = {
        "members": [f"member-{i}" for i in range(k)],
        "seeds": [seed + i for i in range(k)],
        "bootstrap": True,
        "heldout_accuracy": accuracies,
    }
    (out / ENSEMBLE_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return EnsembleReport(reports, sum(accuracies) / k, member_std(accuracies))


def ensemble_members(folder: str | Path) -> list[Path] | None:
    """The member folders ``folder/ensemble.json`` lists (None when ``folder`` is one model)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / ENSEMBLE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UserError(f"{folder / ENSEMBLE_FILE}: cannot read the ensemble ({exc})") from None
    members = manifest.get("members") if isinstance(manifest, dict) else None
    if not isinstance(members, list) or not members:
        raise UserError(f"{folder / ENSEMBLE_FILE}: 'members' must be a non-empty list")
    return [folder / str(m) for m in members]


# The starting model and the perturbations `alignzoo train-rm` names.


def negatives_function(name: str | None, option: str) -> Negatives | None:
    """``--negatives`` / ``--perturbations``: a built-in perturbation of the embedded task
    (``alignzoo.world.task.NEGATIVES``: 'arithmetic', 'arithmetic-shifts'), or 'file.py:fn' /
    'module:fn'; None for none."""
    from alignzoo.world.task import NEGATIVES

    if name in NEGATIVES:
        return NEGATIVES[name]
    if name is not None:
        from alignzoo.config.callables import load_callable

        return load_callable(name, option)
    return None


def base_model(base: str, arm: str | None, data: Path, say: Callable[[str], None]) -> str:
    """The folder ``--base`` names: a model folder, an experiment file (its arm's starting
    policy, built if need be, the first arm unless ``arm``), or "embedded": the warm start of
    the experiment that ``data`` records it came from (its export's alignzoo_export.json), as
    the default embedded settings are another model than the one the samples came from."""
    if base == "embedded":
        try:
            export_info = json.loads((data / "alignzoo_export.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            export_info = {}
        if not isinstance(export_info, dict):
            export_info = {}
        experiment = export_info.get("experiment")
        if not (isinstance(experiment, str) and Path(experiment).is_file()):
            raise UserError(
                f"--base embedded: {data} does not record which experiment produced its "
                "samples, and the default embedded warm start is not the one that "
                "experiment used; pass the experiment file instead (--base "
                "experiments/NAME.yaml, with --arm for another arm than the first)"
            )
        base = experiment
        if arm is None and isinstance(export_info.get("arm"), str):
            arm = export_info["arm"]
        say(f"--base embedded: the warm start of {base} (arm {arm})")
    from alignzoo.config.schema import DataConfig, ModelConfig
    from alignzoo.engine.policy import policy_path

    if base == "embedded":
        return policy_path(ModelConfig(), DataConfig(), say)
    if base.endswith((".yaml", ".yml")):
        from alignzoo.config.loader import load_experiment

        loaded = load_experiment(Path(base))
        name = arm or next(iter(loaded.spec.arms))
        if name not in loaded.spec.arms:
            raise UserError(f"--arm {name}: {base} has arms {', '.join(loaded.spec.arms)}")
        return policy_path(loaded.spec.arms[name].model, loaded.spec.data, say)
    if not Path(base).expanduser().is_dir():
        raise UserError(
            f"--base {base}: not a model folder, 'embedded', or an experiment file (.yaml)"
        )
    return str(Path(base).expanduser())
