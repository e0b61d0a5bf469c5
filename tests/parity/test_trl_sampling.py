"""Per-token log-probs at a sampling temperature other than 1, against TRL 1.16's own
computation (``add_fused_lm_head``, the fused LM head GRPOTrainer puts on the policy and the
reference, which divides the logits by ``temperature``), on the same tiny Qwen2 and tokens.

TRL's trainer takes the temperature only; alignzoo's policy log-probs also renormalise over the
nucleus (top-p) the tokens were drawn from, so with top_p 0.9 they are TRL's minus the log of
the nucleus mass, the nucleus taken by transformers' own ``TopPLogitsWarper``; the reference is
TRL's in both cases (the KL term compares the tempered distributions)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl", reason="the bench extra (TRL) is not installed")

from transformers import TemperatureLogitsWarper, TopPLogitsWarper
from trl.trainer.utils import add_fused_lm_head

from alignzoo.batch import RolloutBatch
from alignzoo.kernels.forward import policy_forward
from alignzoo.ops import sampling_rows

from .test_trl_parity import tiny_model

VOCAB, PROMPT, RESPONSE, ROWS, T = 64, 5, 6, 4, 0.7


def _trl_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """TRL's per-token log-probs of the response tokens, as GRPOTrainer asks for them."""
    patched = copy.deepcopy(model)
    add_fused_lm_head(patched, temperature=T)
    labels = ids.clone()
    labels[:, :-RESPONSE] = -100
    with torch.no_grad():
        out = patched(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                      fused_lm_head=True)  # fmt: skip
    return out.log_probs[:, -RESPONSE:].float()


def test_tempered_log_probs_equal_trls_and_the_nucleus_renormalises_them() -> None:
    model = tiny_model(VOCAB).eval()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, VOCAB, (ROWS, PROMPT + RESPONSE), generator=gen)
    trl = _trl_logprobs(model, ids)

    def ours(top_p: float, truncate: bool = True) -> torch.Tensor:
        batch = RolloutBatch(
            prompt_ids=ids[:, :PROMPT],
            prompt_mask=torch.ones(ROWS, PROMPT, dtype=torch.long),
            response_ids=ids[:, PROMPT:],
            response_mask=torch.ones(ROWS, RESPONSE),
            group_ids=torch.zeros(ROWS, dtype=torch.long),
            sampling=sampling_rows(T, 0, top_p, ROWS),
        )
        with torch.no_grad():
            return policy_forward(model, batch, truncate=truncate)[0]

    torch.testing.assert_close(ours(1.0), trl, atol=1e-5, rtol=1e-5)  # the policy, no nucleus
    torch.testing.assert_close(ours(0.9, truncate=False), trl, atol=1e-5, rtol=1e-5)  # reference

    # top_p 0.9: TRL's log-prob minus log(nucleus mass); -inf outside the nucleus
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, PROMPT - 1 : -1].float()
    flat = logits.reshape(-1, VOCAB)
    tempered = TemperatureLogitsWarper(T)(None, flat.clone())
    kept = torch.isfinite(TopPLogitsWarper(0.9)(None, tempered.clone()))
    mass = (torch.softmax(tempered, -1) * kept).sum(-1).view(ROWS, RESPONSE)
    inside = kept.view(ROWS, RESPONSE, VOCAB).gather(-1, ids[:, PROMPT:, None]).squeeze(-1)
    nucleus = ours(0.9)
    assert bool(inside.any()) and bool((~inside).any()), "premise: tokens on both sides"
    assert bool(torch.isneginf(nucleus[~inside]).all())
    torch.testing.assert_close(nucleus[inside], (trl - mass.log())[inside], atol=1e-5, rtol=1e-5)
