"""One alignzoo component of each kind, written the way a user of alignzoo would write them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import (
    Algorithm,
    AlgorithmRequirements,
    Backend,
    DeviceMapper,
    Labeler,
    LabelRequest,
    LossOutput,
    Modifier,
    SamplingParams,
    Score,
    hookimpl,
    lazy_import,
)

torch = lazy_import("torch")


class VanillaPGParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    baseline: bool = Field(True, description="Subtract the batch-mean reward.")


class VanillaPG(Algorithm):
    """REINFORCE with a batch-mean baseline (Williams 1992)."""

    Params = VanillaPGParams
    requirements = AlgorithmRequirements(reference=False, critic=False, data="online")

    @hookimpl
    def compute_advantages(self, batch):
        scores = batch.scores
        centred = scores - scores.mean() if self.params.baseline else scores
        batch.advantages = centred[:, None] * batch.response_mask
        return batch

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        from alignzoo.ops import aggregate_loss

        per_token = -batch.advantages * outputs.logprobs
        loss = aggregate_loss(per_token, batch.response_mask, "token-mean", context=context)
        return LossOutput(loss, {"pg/advantage_mean": float(batch.advantages.mean())})


class KeywordParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keyword: str


class KeywordLabeler(Labeler):
    """Scores 1.0 when the response contains a keyword."""

    Params = KeywordParams

    def score(self, request: LabelRequest) -> Score:
        return Score(1.0 if self.params.keyword in request.response else 0.0)


class CannedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    responses: list[str] = Field(default_factory=lambda: ["42"])


class CannedBackend(Backend):
    """Answers every prompt with canned responses (for tests of the plumbing)."""

    Params = CannedParams

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.tokenizer: Any = None

    @hookimpl
    def on_run_start(self, run: Any) -> None:
        self.tokenizer = run.tokenizer

    @hookimpl
    def sync_weights(self, weights: Any) -> None:
        return None

    @hookimpl
    def generate(self, prompts: list[str], extras: list[dict], n: int, sampling: SamplingParams):
        from alignzoo.batch import RolloutBatch

        texts = [
            self.params.responses[i % len(self.params.responses)] for i in range(len(prompts) * n)
        ]
        encode = self.tokenizer
        prompt_enc = encode(
            [p for p in prompts for _ in range(n)], return_tensors="pt", padding=True
        )
        resp = [
            encode(t, add_special_tokens=False)["input_ids"] + [encode.eos_token_id] for t in texts
        ]
        width = max(len(r) for r in resp)
        ids = torch.full((len(resp), width), encode.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(resp), width)
        for i, r in enumerate(resp):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1.0
        return RolloutBatch(
            prompt_ids=prompt_enc["input_ids"],
            prompt_mask=prompt_enc["attention_mask"],
            response_ids=ids,
            response_mask=mask,
            group_ids=torch.arange(len(prompts)).repeat_interleave(n),
            prompts=[p for p in prompts for _ in range(n)],
            responses=texts,
            extras=[e for e in extras for _ in range(n)],
            old_logprobs=torch.zeros(len(resp), width),
        )


class AllCPU(DeviceMapper):
    """Places every role on the CPU, whatever else exists."""

    @hookimpl
    def place_roles(self, roles: Sequence[str], available: Sequence[str]) -> dict[str, str]:
        return {role: "cpu" for role in roles}


class LossScaleParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    factor: float = 2.0


class LossScale(Modifier):
    """Multiplies any algorithm's loss by a constant factor (a hook wrapper)."""

    Params = LossScaleParams

    @hookimpl(wrapper=True)
    def compute_loss(self, batch, outputs):
        result = yield
        result.loss = result.loss * self.params.factor
        result.metrics["loss_scale/factor"] = self.params.factor
        return result
