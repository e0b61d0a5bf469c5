"""Dense rewards: a labeler's step scores placed on the response's tokens.

A labeler may score the steps of a response, not only the whole (``Score.steps``: character
spans ``[start, end)`` of the response text, each with a score; a process reward model's). In
a training pass :func:`fill` places them on tokens, in ``batch.dense_rewards`` ``[B, R]`` with
``batch.dense_mask`` ``[B, R]`` (1.0 where a step's score sits), so that an algorithm with
per-token rewards (PPO, REINFORCE++) credits the step that earned it.

**Where a step's reward sits.** On the last token of its span: the token whose decoding
completes the span's last character. That is where process reward models read a step's score
(Math-Shepherd, Wang et al. 2024, tags the end of each step; PRIME, Cui et al. 2025, puts each
step's process reward on its last token) and where the policy has committed to the whole step;
GAE or the return-to-go carry it back to the step's earlier tokens. Steps that end on one
token add up there.

**How spans map to tokens.** Only the sample's trained tokens (``response_mask`` 1) are
decoded, as the backends decode a response (``skip_special_tokens``). That text must contain
the response text the labeler saw: it equals it for a single-turn sample; a multi-turn
episode's labeler sees the last assistant turn, which ends its trained tokens, so the response
is taken where it last occurs. A token's end offset is the length of the decoded text of the
trained tokens up to it, less a trailing incomplete character (a multi-byte character split
over byte tokens belongs to the token of its last byte; bytes that never form a character
decode to U+FFFD and count where they are); the token of a span is the first whose
end offset reaches the span's end, found by bisection (a few prefix decodes per step, not one
per token).

**What happens otherwise.** A sample whose trained tokens' text does not contain its response
text (a codec or a template rewrote it; the labeler scored text the policy did not write) gets
no dense reward: its steps are counted, per sample in ``label_info[i]["steps_unplaced"]`` and
per step in ``reward/dense_unplaced``, and never placed on an environment's or a template's
tokens, which are not trained (they are never decoded here). Evaluation passes place nothing.

:func:`dense_metrics` gives the ``reward/dense_*`` metrics of a training batch, the same way for
every arm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from alignzoo import distributed
from alignzoo import metrics as canonical
from alignzoo.types import Outcome, Score, StepScore

if TYPE_CHECKING:
    from alignzoo.batch import RolloutBatch

UNPLACED = "steps_unplaced"
"""The ``label_info`` key of a sample's steps that could not be placed on its tokens."""
_INCOMPLETE = "\ufffd"  # what a decoder writes for the bytes of a character not yet complete


def response_offset(decoded: str, response: str) -> int | None:
    """Where ``response`` starts in ``decoded`` (the text of a sample's trained tokens): 0 when
    they are equal, where it ends ``decoded`` or else where it last occurs; None when it does
    not occur."""
    if decoded == response:
        return 0
    if decoded.endswith(response):
        return len(decoded) - len(response)
    at = decoded.rfind(response)
    return at if at >= 0 else None


def token_ends(tokenizer: Any, ids: Sequence[int], decoded: str) -> Callable[[int], int]:
    """``end(k)``: how many characters of ``decoded`` (the text of all ``ids``) the tokens
    ``ids[:k]`` complete: the length of their decoded text where it is a prefix of ``decoded``;
    else (a trailing character still incomplete, written as U+FFFD) the length they share with
    it. Memoised; ``end(0)`` is 0, ``end(len(ids))`` is ``len(decoded)``."""
    cache: dict[int, int] = {0: 0, len(ids): len(decoded)}

    def end(k: int) -> int:
        if k not in cache:
            text = tokenizer.decode(list(ids[:k]), skip_special_tokens=True)
            if not decoded.startswith(text):
                text = text.rstrip(_INCOMPLETE)
            if not decoded.startswith(text):  # a decoder that is not prefix-stable
                text = text[: _shared(text, decoded)]
            cache[k] = len(text)
        return cache[k]

    return end


def _shared(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def place(
    tokenizer: Any, ids: Sequence[int], response: str, steps: Sequence[StepScore]
) -> list[int | None]:
    """For each step, the index into ``ids`` (a sample's trained token ids, in order) of the
    token its score sits on: the first token whose decoded end offset reaches the step's span
    end (the module docstring says why). None for every step when the tokens' text does not
    contain ``response``, and for a step whose end lies past the tokens' text."""
    decoded = tokenizer.decode(list(ids), skip_special_tokens=True)
    offset = response_offset(decoded, response)
    if offset is None:
        return [None] * len(steps)
    end = token_ends(tokenizer, ids, decoded)
    out: list[int | None] = []
    for step in steps:
        target = offset + step.end
        lo, hi = 1, len(ids)
        if not ids or end(hi) < target:
            out.append(None)
            continue
        while lo < hi:  # the smallest k with end(k) >= target (end is non-decreasing in k)
            mid = (lo + hi) // 2
            if end(mid) >= target:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo - 1)
    return out


def fill(batch: RolloutBatch, scores: Sequence[Score], tokenizer: Any) -> None:
    """Set ``batch.dense_rewards`` and ``batch.dense_mask`` (in place) from the steps of the
    valued ``scores`` (one per sample): each step's score on its token (:func:`place`), the
    mask 1.0 there. Both stay None when no score has steps; a sample whose steps could not be
    placed gets ``label_info[i]["steps_unplaced"]``, their count."""
    import torch

    if not any(s.steps for s in scores if s.outcome == Outcome.VALUE):
        batch.dense_rewards = batch.dense_mask = None
        return
    shape, device = batch.response_mask.shape, batch.response_mask.device
    rewards = torch.zeros(shape, dtype=torch.float32)
    mask = torch.zeros(shape, dtype=torch.float32)
    trained = (batch.response_mask > 0).cpu()
    ids_rows = batch.response_ids.cpu()
    for i, score in enumerate(scores):
        if score.outcome != Outcome.VALUE or not score.steps:
            continue
        positions = trained[i].nonzero().flatten().tolist()
        ids = ids_rows[i, positions].tolist()
        unplaced = 0
        where = place(tokenizer, ids, batch.responses[i], score.steps)
        for step, k in zip(score.steps, where, strict=True):
            if k is None:
                unplaced += 1
                continue
            rewards[i, positions[k]] += float(step.score)
            mask[i, positions[k]] = 1.0
        if unplaced and i < len(batch.label_info):
            batch.label_info[i][UNPLACED] = unplaced
    batch.dense_rewards, batch.dense_mask = rewards.to(device), mask.to(device)


def dense_metrics(batch: RolloutBatch) -> dict[str, float]:
    """``reward/dense_steps`` (tokens carrying a step's reward, per sample), ``reward/dense_mean``
    (the mean reward on those tokens) and ``reward/dense_unplaced`` (steps that found no token,
    per sample) of a training batch, over every data-parallel rank; empty when no sample of the
    step had step scores."""
    import torch

    unplaced = sum(int(info.get(UNPLACED, 0)) for info in batch.label_info)
    has = batch.dense_mask is not None or unplaced > 0
    marked = torch.tensor(0.0, dtype=torch.float64)
    total = torch.tensor(0.0, dtype=torch.float64)
    if batch.dense_mask is not None and batch.dense_rewards is not None:
        marked = batch.dense_mask.double().sum().cpu()
        total = (batch.dense_rewards.double() * batch.dense_mask.double()).sum().cpu()
    local = torch.stack(
        [
            torch.tensor(float(batch.size), dtype=torch.float64),
            marked,
            total,
            torch.tensor(float(unplaced), dtype=torch.float64),
            torch.tensor(float(has), dtype=torch.float64),
        ]
    )
    if distributed.active():  # every rank takes part, with or without step scores
        local = distributed.all_sum(local)
    samples, marked_sum, total_sum, unplaced_sum, any_has = local.tolist()
    if not any_has or samples == 0:
        return {}
    return {
        canonical.REWARD_DENSE_STEPS: marked_sum / samples,
        canonical.REWARD_DENSE_MEAN: total_sum / marked_sum if marked_sum else 0.0,
        canonical.REWARD_DENSE_UNPLACED: unplaced_sum / samples,
    }
