"""Labeler "reward_model": scores with any local ``AutoModelForSequenceClassification`` (one output).

The model is loaded in ``on_run_start`` on the device the mapper placed for the ``labeler`` role,
put in eval mode with every parameter frozen, and run in batches under ``torch.inference_mode``.
Each (prompt, response) pair is written as ``prompt + response`` (or through the tokenizer's chat
template), right-padded so that positions match an unpadded forward, and truncated from the
left so that the end of the response, where the score is read, is always kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

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
        (out_dir / "reward_model.json").write_text(json.dumps(row, indent=2), encoding="utf-8")

    def load(self, device: str = "cpu") -> None:
        """Load tokenizer and model from ``params.path`` onto ``device``, frozen and in eval mode."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder = Path(self.params.path).expanduser()
        if not folder.is_dir():
            raise UserError(
                f"labeler.params.path: reward model folder '{self.params.path}' does not exist "
                "(expected a local folder written by save_pretrained)"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForSequenceClassification.from_pretrained(
                folder, dtype=getattr(torch, self.params.dtype)
            )
        except (OSError, ValueError) as exc:
            raise UserError(
                f"labeler.params.path: cannot load a sequence-classification model and "
                f"tokenizer from '{folder}': {exc}"
            ) from exc
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
        self.model.eval()
        self.model.requires_grad_(False)

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
        if self.model.training or any(p.requires_grad for p in self.model.parameters()):
            self._freeze()
        texts = [self._text(r) for r in requests]
        raw: list[float] = []
        size = self.params.batch_size
        for start in range(0, len(texts), size):
            raw += self._forward(texts[start : start + size])
        values = raw
        if self.params.normalize:
            mean = sum(raw) / len(raw)
            std = (sum((x - mean) ** 2 for x in raw) / len(raw)) ** 0.5
            values = [(x - mean) / (std + 1e-8) for x in raw]
        return [Score(value=v, info={"raw": r}) for v, r in zip(values, raw, strict=True)]

    def _text(self, request: LabelRequest) -> str:
        if self.params.template == "chat":
            messages = [
                {"role": "user", "content": request.prompt},
                {"role": "assistant", "content": request.response},
            ]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return request.prompt + request.response

    def _forward(self, texts: list[str]) -> list[float]:
        from alignzoo.human.reward_model import encode

        # A chat template already wrote its special tokens into the text.
        special = self.params.template == "concat"
        encoded = encode(self.tokenizer, texts, self.params.max_length, special).to(self.device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]
            ).logits
        return [float(x) for x in logits[:, 0].float().cpu()]
