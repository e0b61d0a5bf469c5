"""Labeler "process_reward_model": a local process reward model (PRM) scores every step of a response.

A PRM judges each step of a solution in the context of the steps before it (Lightman et al.
2023, "Let's Verify Step by Step"; Wang et al. 2024, "Math-Shepherd"). Here:

- **Steps.** The response is split at ``separator`` (a newline by default): a step runs up to
  and including its separator (a run of separators stays with the step before it), the last
  step to the response's end; a blank piece (only whitespace) joins the step before it (the
  first step, when it leads). So the steps tile the response, and each is a character span
  ``[start, end)`` of it.
- **Scores.** Step k is scored by a local ``AutoModelForSequenceClassification`` on the prefix
  ``prompt + response[:end_k]`` (the text up to the end of the step, as the reward model of the
  ``reward_model`` labeler reads a pair: right-padded, truncated from the left so the step's
  end is kept), in batches of ``batch_size`` prefixes, in eval mode with every parameter
  frozen, under ``torch.inference_mode``. With ``output: probability`` (the default) a step's
  score is the model's probability that the step is right: the sigmoid of a one-label head's
  logit, or the softmax probability of label 1 of a two-label head; ``output: logit`` keeps the
  logit (of a two-label head: logit 1 - logit 0).
- **What the labeler returns.** ``Score.steps``: one :class:`~alignzoo.types.StepScore` per
  step, its span and score; the engine places each on the last token of its span
  (``batch.dense_rewards``, :mod:`alignzoo.labeling.dense`) for the algorithms that read
  dense rewards (``ppo``, ``reinforce_pp``). ``Score.value``: the step scores made one by
  ``aggregate``: ``min`` (the default: a solution is as good as its weakest step, as both
  papers rank solutions), ``last``, ``mean`` or ``prod``; so the labeler also serves
  sequence-level algorithms. ``Score.info["step_scores"]``: the step scores. A response
  without a step (empty or blank) is scored once, on ``prompt + response``: a value, no steps.

With ``dense: false`` it gives the value only (no steps), for an algorithm that ignores dense
rewards (``grpo``, ``rloo``, ...); with ``dense: true`` (the default) ``alignzoo validate``
refuses such an algorithm, since the steps would train nothing. Note that a dense-reward
algorithm also puts ``Score.value`` on the response's last token: with ``aggregate: last``
the last step counts twice; ``min`` adds the weakest step's score as an outcome term.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.plugin import Labeler, hookimpl
from alignzoo.types import LabelRequest, Score, StepScore

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


def split_steps(text: str, separator: str) -> list[tuple[int, int]]:
    """The steps of ``text`` as character spans ``[start, end)`` that tile it: each step up to
    and including its run of ``separator``, the last to the end; a blank piece joins the step
    before it (the one after it when it leads). No step for a blank ``text``."""
    spans: list[tuple[int, int]] = []
    start = position = 0
    while (found := text.find(separator, position)) >= 0:
        end = found + len(separator)
        while text.startswith(separator, end):  # a run of separators ends one step
            end += len(separator)
        if text[start:found].strip():
            spans.append((start, end))
            start = end
        elif spans:  # a blank piece: the step before it takes it
            spans[-1] = (spans[-1][0], end)
            start = end
        position = end  # a leading blank piece stays with the next step (start unchanged)
    if text[start:].strip():
        spans.append((start, len(text)))
    elif spans and start < len(text):
        spans[-1] = (spans[-1][0], len(text))
    return spans


def aggregate_steps(scores: list[float], how: str) -> float:
    """One value of a response's step scores: their ``min``, the ``last``, ``mean`` or ``prod``."""
    if how == "min":
        return min(scores)
    if how == "last":
        return scores[-1]
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "prod":
        return math.prod(scores)
    raise ValueError(f"unknown aggregate {how!r}: min, last, mean or prod")


class ProcessRewardModelLabeler(Labeler):
    """A local process reward model: every step of a response scored on its prefix, batched,
    eval mode, no gradients; per-step scores (``Score.steps``) and their aggregate."""

    marks_correct = False

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        path: str = Field(
            description="Local folder of an AutoModelForSequenceClassification with one label "
            "(a logit: the step is right) or two (label 1: the step is right), and its "
            "tokenizer, as written by save_pretrained."
        )
        separator: str = Field(
            "\n",
            min_length=1,
            description="What ends a step in the response text (a run of it ends one step).",
        )
        aggregate: Literal["min", "last", "mean", "prod"] = Field(
            "min",
            description="Score.value from the step scores: 'min' (the weakest step), 'last', "
            "'mean' or 'prod' (of probabilities).",
        )
        output: Literal["probability", "logit"] = Field(
            "probability",
            description="A step's score: 'probability' (sigmoid of a one-label head, softmax "
            "of label 1 of a two-label head) or 'logit' (a two-label head: logit 1 - logit 0).",
        )
        dense: bool = Field(
            True,
            description="Give the step scores (Score.steps: dense rewards for ppo and "
            "reinforce_pp); false: the sequence value only, for algorithms that ignore steps.",
        )
        batch_size: int = Field(16, ge=1, description="Prefixes per forward pass.")
        max_length: int = Field(
            512, ge=1, description="Tokens per prefix; longer prefixes lose their beginning."
        )
        dtype: Literal["float32", "bfloat16", "float16"] = Field(
            "float32", description="Weights dtype of the model."
        )

    params: Params

    def __init__(self, params: BaseModel | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: str = "cpu"

    @property
    def gives_steps(self) -> bool:
        """True unless ``dense: false``."""
        return bool(self.params.dense)

    # ------------------------------------------------------------------ lifecycle
    @hookimpl
    def on_run_start(self, run: Any) -> None:
        self.load(run.device("labeler"))

    def load(self, device: str = "cpu") -> None:
        """Load tokenizer and model from ``params.path`` onto ``device``, frozen, in eval mode."""
        from alignzoo.human.reward_model import load_classifier, prepare

        folder = Path(self.params.path).expanduser()
        if not folder.is_dir():
            raise UserError(
                f"labeler.params.path: process reward model folder '{self.params.path}' does "
                "not exist (expected a local folder written by save_pretrained)"
            )
        tokenizer, model = load_classifier(folder, self.params.dtype)
        if model.config.num_labels not in (1, 2):
            raise UserError(
                f"labeler.params.path: '{folder}' has num_labels={model.config.num_labels}; a "
                "process reward model has one label (a logit) or two (label 1: the step is right)"
            )
        # Right padding, truncation from the left (the step's end is kept), the pad id the
        # score is read before: as the reward_model labeler reads a pair.
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
            raise RuntimeError("ProcessRewardModelLabeler used before on_run_start loaded it")
        if not requests:
            return []
        if self.model.training or any(p.requires_grad for p in self.model.parameters()):
            self._freeze()  # enforced, not assumed: a caller may have flipped the module
        spans = [split_steps(r.response, self.params.separator) for r in requests]
        texts: list[str] = []  # every prefix of every request, in order
        for request, steps in zip(requests, spans, strict=True):
            ends = [end for _, end in steps] or [len(request.response)]
            texts += [request.prompt + request.response[:end] for end in ends]
        size = self.params.batch_size
        flat: list[float] = []
        for start in range(0, len(texts), size):
            flat += self._forward(texts[start : start + size])
        out: list[Score] = []
        at = 0
        for steps in spans:
            count = max(1, len(steps))
            mine, at = flat[at : at + count], at + count
            value = aggregate_steps(mine, self.params.aggregate)
            # a response without a step was scored once, on its whole text: no StepScore
            given = [StepScore(a, b, s) for (a, b), s in zip(steps, mine, strict=False)]
            out.append(
                Score(
                    value=value,
                    info={"step_scores": mine if steps else []},
                    steps=given if self.params.dense else [],
                )
            )
        return out

    def _forward(self, texts: list[str]) -> list[float]:
        """Each prefix's step score (see ``output``)."""
        from alignzoo.human.reward_model import encode

        encoded = encode(self.tokenizer, texts, self.params.max_length).to(self.device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]
            ).logits.float()
        if logits.shape[-1] == 1:
            logit = logits[:, 0]
            scores = torch.sigmoid(logit) if self.params.output == "probability" else logit
        elif self.params.output == "probability":
            scores = torch.softmax(logits, dim=-1)[:, 1]
        else:
            scores = logits[:, 1] - logits[:, 0]
        return [float(x) for x in scores.cpu()]
