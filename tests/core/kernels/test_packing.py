"""Sequence packing (alignzoo.kernels.packing): a packed forward gives the padded forward's
log-probs, entropy, values and gradients on every trained token, on the lean path and on
transformers' own forward (sdpa and eager); no sample sees another's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from alignzoo.batch import RolloutBatch
from alignzoo.kernels.forward import critic_forward, policy_forward
from alignzoo.kernels.lean import lean_reason
from alignzoo.kernels.packing import Packing, pack

VOCAB = 61
# (prompt tokens, response tokens) per sample: left-padded prompts to 7, responses to 6
LENGTHS = [(7, 6), (2, 1), (4, 6), (1, 3), (5, 0), (3, 2)]


def _batch(seed: int = 0, lengths: list[tuple[int, int]] = LENGTHS) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_w = max(p for p, _ in lengths)
    resp_w = max(r for _, r in lengths)
    rows = len(lengths)
    prompt_ids = torch.zeros(rows, prompt_w, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_w, dtype=torch.long)
    response_ids = torch.zeros(rows, resp_w, dtype=torch.long)
    response_mask = torch.zeros(rows, resp_w)
    for i, (p, r) in enumerate(lengths):
        prompt_ids[i, prompt_w - p :] = torch.randint(2, VOCAB, (p,), generator=g)
        prompt_mask[i, prompt_w - p :] = 1
        response_ids[i, :r] = torch.randint(2, VOCAB, (r,), generator=g)
        response_mask[i, :r] = 1
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        group_ids=torch.arange(rows),
    )


def _config(**extra) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,  # the same forward twice
                bos_token_id=1,
                eos_token_id=1,
            )
        )
    else:
        attention = "eager" if kind == "qwen2-eager" else "sdpa"
        model = Qwen2ForCausalLM(Qwen2Config(**_config(), attn_implementation=attention))
    expected_lean = kind == "qwen2-lean"
    assert (lean_reason(model) is None) == expected_lean, lean_reason(model)
    return model


def test_packing_lays_samples_end_to_end_with_their_own_positions() -> None:
    batch = _batch()
    packed = pack(batch, Packing())
    assert packed is not None
    total = sum(p + r for p, r in LENGTHS)
    rows, width = packed.input_ids.shape
    assert int(packed.real.sum()) == total  # every real token once, no padding token
    assert rows < batch.size and rows * width < batch.size * (7 + 6)  # premise: it packs
    assert width <= 13  # no row longer than the longest sample (best-fit into 13)
    for sample, (p, r) in enumerate(LENGTHS):
        where = packed.segments == sample + 1
        assert int(where.sum()) == p + r
        row = int(where.any(dim=1).nonzero()[0])
        assert packed.position_ids[row][where[row]].tolist() == list(range(p + r))
        expected = torch.cat([batch.prompt_ids[sample, 7 - p :], batch.response_ids[sample, :r]])
        assert torch.equal(packed.input_ids[row][where[row]], expected)
    one_row = pack(batch, Packing(length=1000))
    assert one_row is not None and one_row.input_ids.shape == (1, total)


def test_a_response_with_a_gap_in_its_attention_or_an_empty_prompt_is_not_packed() -> None:
    gap = _batch()
    gap.response_attention = (gap.response_mask > 0).long()
    gap.response_attention[0, 2] = 0  # attended tokens after a hole
    assert pack(gap, Packing()) is None
    empty = _batch(lengths=[(0, 2), (3, 2)])
    assert pack(empty, Packing()) is None


@pytest.mark.parametrize("kind", ["qwen2-lean", "qwen2-eager", "gpt2"])
@pytest.mark.parametrize("length", [None, 20])
def test_a_packed_forward_gives_the_padded_forwards_logprobs_entropy_and_gradients(
    kind: str, length: int | None
) -> None:
    model = _model(kind)
    batch = _batch(seed=3)
    batch.sampling = torch.tensor([[0.7, 0.0, 1.0]]).repeat(batch.size, 1)  # tempered
    mask = batch.response_mask
    results = []
    for packing in (None, Packing(length)):
        model.zero_grad()
        logprobs, entropy = policy_forward(model, batch, entropy=True, packing=packing)
        assert entropy is not None
        loss = -(logprobs * mask).sum() / mask.sum() - 0.1 * (entropy * mask).sum()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logprobs * mask, entropy * mask, loss.detach(), grads))
    (lp0, ent0, loss0, g0), (lp1, ent1, loss1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss1, loss0, atol=1e-6, rtol=0)
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2-lean", "qwen2-eager", "gpt2"])
def test_no_packed_sample_sees_another(kind: str) -> None:
    """Changing sample 0's tokens (the longest, first in the one row) leaves every other
    sample's packed log-probs as they were: a mask that ignored the segments would let the
    samples after it see it."""
    model = _model(kind).eval()
    batch = _batch(seed=5)
    other = _batch(seed=5)
    other.prompt_ids[0] = (other.prompt_ids[0] + 7) % VOCAB
    other.response_ids[0] = (other.response_ids[0] + 11) % VOCAB
    packed = pack(batch, Packing(length=1000))
    assert packed is not None and packed.input_ids.shape[0] == 1  # premise: all in one row
    assert int(packed.segments[0, 0]) == 1  # premise: sample 0 comes first, the rest see past it
    with torch.no_grad():
        first, _ = policy_forward(model, batch, packing=Packing(length=1000))
        second, _ = policy_forward(model, other, packing=Packing(length=1000))
    mask = batch.response_mask
    torch.testing.assert_close(second[1:] * mask[1:], first[1:] * mask[1:], atol=1e-6, rtol=0)
    assert not torch.allclose(second[0], first[0])  # premise: the edit reached the model


def test_a_packed_critic_gives_the_padded_critics_values() -> None:
    torch.manual_seed(0)
    critic = Qwen2ForTokenClassification(Qwen2Config(**_config(), num_labels=1)).eval()
    batch = _batch(seed=7)
    with torch.no_grad():
        padded = critic_forward(critic, batch)
        packed = critic_forward(critic, batch, packing=Packing())
    mask = batch.response_mask
    torch.testing.assert_close(packed * mask, padded * mask, atol=1e-5, rtol=0)


def test_a_model_whose_attention_takes_no_ready_mask_runs_padded() -> None:
    """flash-attention reads a 4-D mask as padding: such a model's batches are not packed
    (the padded forward's numbers, not a wrong attention)."""
    from alignzoo.kernels.forward import packed_rows

    model = _model("qwen2-eager")
    batch = _batch()
    assert packed_rows(batch, Packing(), model) is not None
    model.config._attn_implementation = "flash_attention_2"
    assert packed_rows(batch, Packing(), model) is None
