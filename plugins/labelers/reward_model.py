"""Labeler "reward_model": scores with any local ``AutoModelForSequenceClassification`` (one output).

The model is loaded in ``on_run_start`` on the device the mapper placed for the ``labeler`` role,
put in eval mode with every parameter frozen, and run in batches under ``torch.inference_mode``.
Each (prompt, response) pair is written as ``prompt + response`` (or through the tokenizer's chat
template), right-padded so that positions match an unpadded forward, and truncated from the
left so that the end of the response, where the score is read, is always kept.

A folder with an ``ensemble.json`` (``alignzoo train-rm --ensemble K``) is an ensemble: every
member scores every pair and ``aggregate`` makes one score of theirs (the mean; mean - lambda *
std, lambda = ``std_coef``; or the min: Coste et al. 2024). The members' disagreement, the
std of their scores, is in ``Score.info['rm_std']`` per sample and in :meth:`stats` (logged as
``labeler/<name>/rm_std``: its mean over the last call).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.plugin import Labeler, hookimpl
from alignzoo.types import LabelRequest, Score

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


class RewardModelLabeler(Labeler):
    """A local sequence-classification reward model (num_labels=1), batched, eval mode, no grad."""

    marks_correct = False
    # labeling.normalize when the arm leaves it unset: logits whitened over the run to the
    # mean and spread of a 0/1 rule right half the time (alignzoo.labeling.normalize).
    default_normalize: ClassVar[dict[str, Any]] = {
        "mode": "running",
        "target_mean": 0.5,
        "target_std": 0.5,
    }

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        path: str = Field(
            description="Local folder of an AutoModelForSequenceClassification with num_labels=1 "
            "and its tokenizer (as written by save_pretrained); default: the arm's "
            "model.reward_model."
        )
        batch_size: int = Field(16, ge=1, description="Pairs per forward pass.")
        max_length: int = Field(
            256, ge=1, description="Tokens per pair; longer pairs lose their beginning."
        )
        normalize: bool = Field(
            False,
            description="Standardise the scores of each batch to mean 0, std 1 "
            "(the raw logit stays in Score.info['raw']).",
        )
        template: Literal["concat", "chat"] = Field(
            "concat",
            description="'concat': prompt + response; 'chat': the tokenizer's chat template with "
            "a user and an assistant turn.",
        )
        dtype: Literal["float32", "bfloat16", "float16"] = Field(
            "float32", description="Weights dtype of the reward model."
        )
        aggregate: Literal["mean", "mean_minus_std", "min"] = Field(
            "mean",
            description="An ensemble's score from its members': 'mean', 'mean_minus_std' "
            "(mean - std_coef * std, conservative) or 'min' (Coste et al. 2024); one model: "
            "its score.",
        )
        std_coef: float = Field(
            1.0, ge=0.0, description="lambda in mean - lambda * std (aggregate: mean_minus_std)."
        )

    @classmethod
    def params_for_arm(cls, params: dict[str, Any], arm: Any) -> dict[str, Any]:
        # model.reward_model names the reward model once; params.path still wins.
        reward_model = getattr(getattr(arm, "model", None), "reward_model", None)
        if "path" not in params and reward_model:
            return {**params, "path": reward_model}
        return params

    def __init__(self, params: BaseModel | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: str = "cpu"
        # (tokenizer, model) of each ensemble member; one entry for a single model.
        self.members: list[tuple[Any, Any]] = []
        self.is_ensemble = False
        self._last_std: float = 0.0

    # ------------------------------------------------------------------ lifecycle
    @hookimpl
    def on_run_start(self, run: Any) -> None:
        self.load(run.device("labeler"))
        out_dir = getattr(run, "out_dir", None)
        # The labeler the arm trains against says which reward model it was (not one that
        # only evaluates: evaluation.labeler).
        if out_dir is not None and getattr(run, "labeling_role", "training") == "training":
            self._record(Path(out_dir))

    def _record(self, out_dir: Path) -> None:
        """Write ``reward_model.json`` in the run folder: which reward model scored the run
        and, when `alignzoo train-rm` trained it, its held-out metrics (the report shows them)."""
        import json

        from alignzoo.human.reward_model import METRICS_FILE

        folder = Path(self.params.path).expanduser()
        row: dict[str, Any] = {"path": str(folder.resolve())}
        try:
            row["trained"] = json.loads((folder / METRICS_FILE).read_text(encoding="utf-8"))
            row["trained"].pop("history", None)
        except (OSError, ValueError):
            pass  # trained elsewhere: the path says which model it was
        if self.is_ensemble:
            from alignzoo.human.reward_model import ENSEMBLE_FILE

            row["ensemble"] = {
                **json.loads((folder / ENSEMBLE_FILE).read_text(encoding="utf-8")),
                "aggregate": self.params.aggregate,
                "std_coef": self.params.std_coef,
            }
            members = []
            for member in row["ensemble"].get("members", []):
                try:
                    members.append(json.loads((folder / member / METRICS_FILE).read_text("utf-8")))
                except (OSError, ValueError):
                    continue
            if members:  # the members' mean: what the report shows for an ensemble
                row["trained"] = members_mean(members)
        (out_dir / "reward_model.json").write_text(json.dumps(row, indent=2), encoding="utf-8")

    def load(self, device: str = "cpu") -> None:
        """Load tokenizer and model from ``params.path`` onto ``device``, frozen and in eval
        mode (every member of an ensemble folder)."""
        from alignzoo.human.reward_model import ensemble_members

        folder = Path(self.params.path).expanduser()
        if not folder.is_dir():
            raise UserError(
                f"labeler.params.path: reward model folder '{self.params.path}' does not exist "
                "(expected a local folder written by save_pretrained)"
            )
        listed = ensemble_members(folder)
        self.is_ensemble = listed is not None
        self.members = []
        for member in listed or [folder]:
            if not member.is_dir():
                raise UserError(
                    f"labeler.params.path: ensemble member '{member}' listed in "
                    f"'{folder}/ensemble.json' does not exist"
                )
            self._load_one(member, device)
            self.members.append((self.tokenizer, self.model))
        self.tokenizer, self.model = self.members[0]

    def _load_one(self, folder: Path, device: str) -> None:
        from alignzoo.human.reward_model import load_classifier

        tokenizer, model = load_classifier(folder, self.params.dtype)
        if model.config.num_labels != 1:
            raise UserError(
                f"labeler.params.path: '{folder}' has num_labels={model.config.num_labels}; "
                "a reward model has exactly one output (num_labels=1)"
            )
        if self.params.template == "chat" and not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"labeler.params.template: 'chat' asked, but the tokenizer in '{folder}' has "
                "no chat template; use template: concat"
            )
        from alignzoo.human.reward_model import prepare

        # Right padding (positions match an unpadded forward), truncation from the left (the
        # end of the response is kept), and the pad id the score is read before: as
        # `alignzoo train-rm` trained it.
        self.tokenizer = prepare(tokenizer, model)
        self.device = device
        self.model = model.to(device)
        self._freeze()

    def _freeze(self) -> None:
        for _, model in self.members or [(None, self.model)]:
            model.eval()
            model.requires_grad_(False)

    def stats(self) -> dict[str, float]:
        """What the labeling stage logs as ``labeler/<name>/*``, for an ensemble: ``rm_std``,
        the members' disagreement (the std of their scores) averaged over the last call's
        samples, and ``rm_members``."""
        if not self.is_ensemble:
            return {}
        return {"rm_std": self._last_std, "rm_members": float(len(self.members))}

    # ------------------------------------------------------------------ scoring
    def score(self, request: LabelRequest) -> Score:
        return self.score_batch([request])[0]

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        if self.model is None:
            raise RuntimeError("RewardModelLabeler used before on_run_start loaded the model")
        if not requests:
            return []
        # Enforced, not assumed: a caller may have flipped the module to training.
        members = self.members or [(self.tokenizer, self.model)]
        if any(m.training or any(p.requires_grad for p in m.parameters()) for _, m in members):
            self._freeze()
        texts = [self._text(r) for r in requests]
        size = self.params.batch_size
        if not self.is_ensemble:
            raw: list[float] = []
            for start in range(0, len(texts), size):
                raw += self._forward(texts[start : start + size])
            return self._scores(raw, [{} for _ in raw])
        from alignzoo.human.reward_model import aggregate, member_std

        per_member: list[list[float]] = []
        for tokenizer, model in members:
            scores: list[float] = []
            for start in range(0, len(texts), size):
                scores += self._forward(texts[start : start + size], tokenizer, model)
            per_member.append(scores)
        columns = [list(col) for col in zip(*per_member, strict=True)]
        raw = [aggregate(col, self.params.aggregate, self.params.std_coef) for col in columns]
        stds = [member_std(col) for col in columns]
        self._last_std = sum(stds) / len(stds)
        extra = [
            {"rm_mean": sum(col) / len(col), "rm_std": sd, "rm_members": col}
            for col, sd in zip(columns, stds, strict=True)
        ]
        return self._scores(raw, extra)

    def _scores(self, raw: list[float], extra: list[dict[str, Any]]) -> list[Score]:
        values = raw
        if self.params.normalize:
            mean = sum(raw) / len(raw)
            std = (sum((x - mean) ** 2 for x in raw) / len(raw)) ** 0.5
            values = [(x - mean) / (std + 1e-8) for x in raw]
        return [
            Score(value=v, info={"raw": r, **e}) for v, r, e in zip(values, raw, extra, strict=True)
        ]

    def _text(self, request: LabelRequest) -> str:
        if self.params.template == "chat":
            messages = [
                {"role": "user", "content": request.prompt},
                {"role": "assistant", "content": request.response},
            ]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return request.prompt + request.response

    def _forward(self, texts: list[str], tokenizer: Any = None, model: Any = None) -> list[float]:
        from alignzoo.human.reward_model import encode

        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        model = self.model if model is None else model
        # A chat template already wrote its special tokens into the text.
        special = self.params.template == "concat"
        encoded = encode(tokenizer, texts, self.params.max_length, special).to(self.device)
        with torch.inference_mode():
            logits = model(
                input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]
            ).logits
        return [float(x) for x in logits[:, 0].float().cpu()]


def members_mean(members: list[dict[str, Any]]) -> dict[str, Any]:
    """An ensemble's ``train_rm.json`` figures as one row: the members' means of the held-out
    metrics and the top-1 probe, their held-out and training pair counts, and how many."""

    def mean(values: list[Any]) -> float | None:
        found = [float(v) for v in values if isinstance(v, (int, float))]
        return sum(found) / len(found) if found else None

    return {
        "members": len(members),
        "heldout_accuracy": mean([m.get("heldout_accuracy") for m in members]),
        "heldout_ece": mean([m.get("heldout_ece") for m in members]),
        "heldout_pairs": members[0].get("heldout_pairs"),
        "train_pairs": members[0].get("train_pairs"),
        "synthetic_negatives": members[0].get("synthetic_negatives"),
        "probes": {
            "top1_accuracy": mean([(m.get("probes") or {}).get("top1_accuracy") for m in members])
        },
    }
