"""The Hugging Face rollout backend: layout, masks, log-probs, greedy decoding, sampling controls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from alignzoo.errors import UserError
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.registry import build_plugin_manager
from alignzoo.types import SamplingParams
from alignzoo.weights import PolicyWeights

from ...core.tiny_world import build_world
from .conftest import load_policy

PROMPTS = ["12+7=", "3+45=", "1+1=", "100+250="]  # different lengths: left padding matters


def start(backend: HFBackend, model, tokenizer) -> None:
    """What a run does: on_run_start with the run's actor, then the first weight sync."""
    run = SimpleNamespace(tokenizer=tokenizer, device=lambda role: "cpu", actor=model)
    backend.on_run_start(run)
    backend.sync_weights(PolicyWeights(model, 0))


def make_backend(folder, **params) -> tuple[HFBackend, object, object]:
    model, tokenizer = load_policy(folder)
    backend = HFBackend(params)
    start(backend, model, tokenizer)
    return backend, model, tokenizer


def full_forward_logprobs(model, batch, sampling=None) -> torch.Tensor:
    """Log-probs of the response tokens from one forward pass over prompt + response (no cache),
    under the distribution ``sampling`` draws from: transformers' own warpers (temperature,
    top-k, top-p) applied to each position's logits (the raw logits' without ``sampling``)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask.long()], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = batch.prompt_ids.shape[1]
    logits = logits[:, width - 1 : -1].float()
    if sampling is not None and sampling.temperature > 0:
        warpers = [TemperatureLogitsWarper(sampling.temperature)]
        warpers += [TopKLogitsWarper(sampling.top_k)] if sampling.top_k > 0 else []
        warpers += [TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []
        flat = logits.reshape(-1, logits.shape[-1])
        for warper in warpers:
            flat = warper(None, flat)
        logits = flat.view(logits.shape)
    logp = torch.log_softmax(logits, dim=-1).gather(2, batch.response_ids.unsqueeze(2)).squeeze(2)
    return logp.masked_fill(batch.response_mask == 0, 0.0)


def greedy_by_hand(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """Argmax continuation of one unpadded prompt, one full forward pass per token."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(token)
            if token == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_layout_masks_and_padding_after_eos(policy_dirs):
    backend, _, tokenizer = make_backend(policy_dirs["stopping"], max_batch_size=3)
    n = 4
    extras = [{"answer": str(i)} for i in range(len(PROMPTS))]
    torch.manual_seed(0)
    batch = backend.generate(PROMPTS, extras, n, SamplingParams(max_new_tokens=10))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    B = len(PROMPTS) * n
    R = batch.response_ids.shape[1]
    assert batch.size == B and batch.prompt_ids.shape[0] == B
    assert batch.response_mask.shape == batch.rollout_logprobs.shape == (B, R)
    assert batch.response_mask.dtype == torch.float32 and batch.prompt_mask.dtype == torch.long
    lengths = batch.response_mask.sum(dim=1).long()
    # The fixture policy must give both stopped and unstopped samples, or this test tests little.
    stopped = [i for i in range(B) if eos in batch.response_ids[i].tolist()]
    assert 0 < len(stopped) < B and lengths.min() < lengths.max()
    for i in range(B):
        row, length = batch.response_ids[i].tolist(), int(lengths[i])
        mask = batch.response_mask[i]
        assert mask[:length].eq(1).all() and mask[length:].eq(0).all()  # contiguous
        if eos in row:
            first = row.index(eos)
            assert length == first + 1  # the EOS is included
            assert all(t == pad for t in row[first + 1 :])  # padded after it
        else:
            assert length == R == 10  # ran to max_new_tokens, which sets the width
        assert batch.rollout_logprobs[i, length:].eq(0).all()
        assert (batch.rollout_logprobs[i, :length] < 0).all()
        expected_text = tokenizer.decode(row[:length], skip_special_tokens=True)
        assert batch.responses[i] == expected_text and "<|endoftext|>" not in expected_text
    assert batch.prompts == [p for p in PROMPTS for _ in range(n)]
    assert batch.extras == [e for e in extras for _ in range(n)]
    batch.extras[0]["answer"] = "changed"  # one dict per sample, not shared
    assert batch.extras[1]["answer"] == "0" and extras[0]["answer"] == "0"


def test_group_layout_and_left_padded_prompts(policy_dirs):
    backend, _, tokenizer = make_backend(policy_dirs["plain"], max_batch_size=2)
    n = 3
    torch.manual_seed(1)
    batch = backend.generate(PROMPTS, [], n, SamplingParams(max_new_tokens=4))
    assert batch.group_ids.tolist() == [i // n for i in range(len(PROMPTS) * n)]
    width = batch.prompt_ids.shape[1]
    for i in range(batch.size):
        prompt = PROMPTS[i // n]
        tokens = tokenizer(prompt)["input_ids"]
        assert batch.prompt_ids[i, width - len(tokens) :].tolist() == tokens
        assert batch.prompt_ids[i, : width - len(tokens)].eq(tokenizer.pad_token_id).all()
        assert batch.prompt_mask[i].tolist() == [0] * (width - len(tokens)) + [1] * len(tokens)
        assert tokenizer.decode(tokens) == prompt
    # Samples of one group come from one prompt encoding but are sampled independently.
    group0 = batch.response_ids[:n]
    assert not (group0[0].equal(group0[1]) and group0[1].equal(group0[2]))


@pytest.mark.parametrize("policy", ["plain", "stopping"])
def test_sampling_logprobs_equal_full_forward(policy_dirs, policy):
    backend, model, _ = make_backend(policy_dirs[policy], max_batch_size=2)
    # The recorded log-probs are those of the distribution each token was drawn from: after
    # temperature, top-k and top-p (renormalised), not the raw logits'.
    sampling = SamplingParams(temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=8)
    torch.manual_seed(2)
    batch = backend.generate(PROMPTS, [], 3, sampling)
    expected = full_forward_logprobs(model, batch, sampling)
    torch.testing.assert_close(batch.rollout_logprobs, expected, atol=1e-4, rtol=0)
    raw = full_forward_logprobs(model, batch)
    assert float((raw - expected).abs().max()) > 0.05, "premise: the warping changes them"


def test_greedy_is_deterministic_and_is_the_argmax_continuation(policy_dirs):
    backend, model, tokenizer = make_backend(policy_dirs["plain"], max_batch_size=3)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    torch.manual_seed(0)
    first = backend.generate(PROMPTS, [], 2, greedy)
    torch.manual_seed(123)
    second = backend.generate(PROMPTS, [], 2, greedy)
    assert first.response_ids.equal(second.response_ids)
    assert first.response_ids[0].equal(first.response_ids[1])  # n greedy samples agree
    lengths = first.response_mask.sum(dim=1).long()
    for i, prompt in enumerate(PROMPTS):
        by_hand = greedy_by_hand(model, tokenizer, prompt, 6)
        assert first.response_ids[2 * i, : lengths[2 * i]].tolist() == by_hand
    # The continuations differ between prompts (the fixture model is not degenerate).
    assert len({tuple(r) for r in first.response_ids.tolist()}) > 1


def test_greedy_on_a_stopping_model_stops_at_eos(policy_dirs):
    backend, model, tokenizer = make_backend(policy_dirs["stopping"])
    batch = backend.generate(PROMPTS, [], 1, SamplingParams(temperature=0, max_new_tokens=5))
    for i, prompt in enumerate(PROMPTS):
        by_hand = greedy_by_hand(model, tokenizer, prompt, 5)
        length = int(batch.response_mask[i].sum())
        assert batch.response_ids[i, :length].tolist() == by_hand


def test_seeded_sampling_is_reproducible(policy_dirs):
    backend, _, _ = make_backend(policy_dirs["plain"])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    torch.manual_seed(7)
    a = backend.generate(PROMPTS, [], 2, sampling)
    torch.manual_seed(7)
    b = backend.generate(PROMPTS, [], 2, sampling)
    torch.manual_seed(8)
    c = backend.generate(PROMPTS, [], 2, sampling)
    assert a.response_ids.equal(b.response_ids) and a.rollout_logprobs.equal(b.rollout_logprobs)
    assert not a.response_ids.equal(c.response_ids)


def test_top_k_one_equals_greedy(policy_dirs):
    backend, _, _ = make_backend(policy_dirs["plain"])
    greedy = backend.generate(PROMPTS, [], 1, SamplingParams(temperature=0, max_new_tokens=6))
    torch.manual_seed(5)
    top1 = backend.generate(PROMPTS, [], 3, SamplingParams(top_k=1, max_new_tokens=6))
    assert top1.response_ids.equal(greedy.response_ids.repeat_interleave(3, dim=0))
    # top-1 draws from a point mass: every sampled token's log-prob is log 1 = 0
    assert (top1.rollout_logprobs[top1.response_mask > 0] == 0).all()


def test_chunking_does_not_change_greedy_results(policy_dirs):
    one, _, _ = make_backend(policy_dirs["plain"], max_batch_size=1)
    many, _, _ = make_backend(policy_dirs["plain"], max_batch_size=64)
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    a, b = one.generate(PROMPTS, [], 2, greedy), many.generate(PROMPTS, [], 2, greedy)
    assert a.prompt_ids.equal(b.prompt_ids) and a.prompt_mask.equal(b.prompt_mask)
    assert a.response_ids.equal(b.response_ids) and a.response_mask.equal(b.response_mask)
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5, rtol=0)


def test_training_modes_and_generation_config_are_restored(policy_dirs):
    backend, model, _ = make_backend(policy_dirs["plain"])
    model.train()
    frozen = model.model.layers[0].mlp
    frozen.eval()  # a submodule deliberately in eval mode stays so
    config = model.generation_config
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    backend.generate(PROMPTS[:1], [], 2, SamplingParams(max_new_tokens=3))
    assert seen and not any(seen)  # every forward of generate ran in eval mode
    assert model.training and model.model.training and not frozen.training
    assert model.generation_config is config
    model.eval()
    backend.generate(PROMPTS[:1], [], 1, SamplingParams(max_new_tokens=2))
    assert not model.training


def test_checkpoint_generation_defaults_do_not_leak(policy_dirs):
    backend, model, tokenizer = make_backend(policy_dirs["stopping"])
    # A checkpoint that suppresses EOS and penalises repetition: the experiment's sampling wins.
    model.generation_config.suppress_tokens = [tokenizer.eos_token_id]
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.top_k = 1
    batch = backend.generate(PROMPTS, [], 1, SamplingParams(temperature=0, max_new_tokens=5))
    for i, prompt in enumerate(PROMPTS):
        length = int(batch.response_mask[i].sum())
        assert batch.response_ids[i, :length].tolist() == greedy_by_hand(
            model, tokenizer, prompt, 5
        )
    assert model.generation_config.suppress_tokens == [tokenizer.eos_token_id]


def test_extra_eos_from_the_checkpoint_generation_config_stops(policy_dirs):
    backend, model, tokenizer = make_backend(policy_dirs["plain"])
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    before = backend.generate(PROMPTS[:1], [], 1, greedy)
    stop_token = int(before.response_ids[0, 2])
    assert stop_token not in before.response_ids[0, :2].tolist()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop_token]
    after = backend.generate(PROMPTS[:1], [], 1, greedy)
    assert after.response_ids[0, :3].equal(before.response_ids[0, :3])
    assert after.response_mask[0].sum() == 3 and after.response_ids.shape[1] == 3


@pytest.mark.parametrize("policy", ["plain", "stopping"])
def test_the_decode_loop_and_generate_agree_on_the_same_weights(policy_dirs, policy):
    loop, model, tokenizer = make_backend(policy_dirs[policy], decoder="loop")
    generate = HFBackend({"decoder": "generate"})
    start(generate, model, tokenizer)  # the very same module
    greedy = SamplingParams(temperature=0, max_new_tokens=7)
    a, b = loop.generate(PROMPTS, [], 3, greedy), generate.generate(PROMPTS, [], 3, greedy)
    assert a.prompt_ids.equal(b.prompt_ids) and a.prompt_mask.equal(b.prompt_mask)
    assert a.response_ids.equal(b.response_ids) and a.response_mask.equal(b.response_mask)
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5, rtol=0)
    # Sampled: both record the log-probs of the distribution they drew from.
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=7)
    for backend in (loop, generate):
        torch.manual_seed(3)
        batch = backend.generate(PROMPTS, [], 3, sampling)
        expected = full_forward_logprobs(model, batch, sampling)
        torch.testing.assert_close(batch.rollout_logprobs, expected, atol=1e-4, rtol=0)


def test_generates_through_the_hook_and_with_a_peft_model(policy_dirs):
    peft = pytest.importorskip("peft")
    backend, model, tokenizer = make_backend(policy_dirs["plain"])
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    start(backend, lora, tokenizer)
    config = lora.get_base_model().generation_config
    pm = build_plugin_manager([backend])
    batch = pm.hook.generate(
        prompts=PROMPTS[:2],
        extras=[{}, {}],
        n=2,
        sampling=SamplingParams(max_new_tokens=3),
        seeds=None,
    )
    assert batch.size == 4 and batch.group_ids.tolist() == [0, 0, 1, 1]
    assert lora.get_base_model().generation_config is config
    torch.testing.assert_close(
        batch.rollout_logprobs,
        full_forward_logprobs(lora, batch) * batch.response_mask,
        atol=1e-4,
        rtol=0,
    )


def test_bad_calls(policy_dirs):
    with pytest.raises(RuntimeError, match="before on_run_start"):
        HFBackend().generate(PROMPTS, [], 1, SamplingParams())
    backend, _, _ = make_backend(policy_dirs["plain"])
    with pytest.raises(UserError, match="prompt 1 encodes to no tokens"):
        backend.generate(["1+1=", ""], [], 1, SamplingParams())
    with pytest.raises(ValueError, match="2 prompts but 1 extras"):
        backend.generate(["1+1=", "2+2="], [{}], 1, SamplingParams())


def test_recorder_reads_each_token_once_and_survives_undone_steps():
    from alignzoo.plugins.backends.hf import _SamplingProcessor

    torch.manual_seed(0)
    steps = [torch.randn(2, 5) for _ in range(3)]
    # each row's sampled token: one of the two largest logits of its step (what top-2 keeps)
    tokens = torch.stack([s.topk(2).indices[:, t % 2] for t, s in enumerate(steps)], dim=1)
    expected = torch.stack(  # temperature 0.5 and top-2: the distribution drawn from
        [
            torch.log_softmax((s / 0.5).masked_fill(s < s.topk(2).values[:, 1:], float("-inf")), -1)
            .gather(1, tokens[:, t : t + 1])
            .squeeze(1)
            for t, s in enumerate(steps)
        ],
        dim=1,
    )
    assert bool(torch.isfinite(expected).all())

    def replay(calls: int) -> _SamplingProcessor:
        recorder = _SamplingProcessor(SamplingParams(temperature=0.5, top_k=2))
        prompt = torch.zeros(2, 2, dtype=torch.long)
        for t in range(calls):
            filtered = recorder(torch.cat([prompt, tokens[:, :t]], dim=1), steps[t].clone())
            assert torch.isinf(filtered).sum() == 2 * 3  # top-2 of 5 kept, after recording
        return recorder

    # generate ran exactly as many steps as it returned tokens
    torch.testing.assert_close(replay(3).finish(tokens), expected)
    # generate ran one more step and dropped it (deferred stop checks, as on mps)
    torch.testing.assert_close(replay(3).finish(tokens[:, :2]), expected[:, :2])


# --------------------------------------------------------------------------- weights: copy


def _agree(a, b) -> bool:
    return a.response_ids.equal(b.response_ids) and torch.allclose(
        a.rollout_logprobs, b.rollout_logprobs, atol=1e-5, rtol=0
    )


def test_a_backend_with_its_own_copy_follows_the_weight_stream(policy_dirs):
    shared, model, tokenizer = make_backend(policy_dirs["plain"])
    own = HFBackend({"weights": "copy"})
    start(own, model, tokenizer)
    assert own.model is not model and own.version == 0
    assert not any(
        p.data_ptr() == q.data_ptr() for p in own.model.parameters() for q in model.parameters()
    )
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    before = own.generate(PROMPTS, [], 2, greedy)
    assert _agree(shared.generate(PROMPTS, [], 2, greedy), before)
    with torch.no_grad():  # the trainer's update, in place
        for param in model.parameters():
            param.mul_(-1.5)
    assert not _agree(shared.generate(PROMPTS, [], 2, greedy), before), (
        "premise: the update changes greedy outputs"
    )
    assert _agree(own.generate(PROMPTS, [], 2, greedy), before)  # nothing synced yet: the old copy
    own.sync_weights(PolicyWeights(model, 1))
    assert own.version == 1
    assert _agree(shared.generate(PROMPTS, [], 2, greedy), own.generate(PROMPTS, [], 2, greedy))
    torch.manual_seed(5)
    a = shared.generate(PROMPTS, [], 3, SamplingParams(max_new_tokens=6))
    torch.manual_seed(5)
    assert _agree(a, own.generate(PROMPTS, [], 3, SamplingParams(max_new_tokens=6)))


def test_a_copy_of_a_lora_policy_samples_with_the_merged_weights(policy_dirs):
    peft = pytest.importorskip("peft")
    model, tokenizer = load_policy(policy_dirs["plain"])
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(std=2.0)
    shared, own = HFBackend(), HFBackend({"weights": "copy"})
    start(shared, lora, tokenizer)
    start(own, lora, tokenizer)
    assert not hasattr(own.model, "peft_config")  # a plain model
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    assert _agree(shared.generate(PROMPTS, [], 2, greedy), own.generate(PROMPTS, [], 2, greedy))


def test_a_stream_that_does_not_fit_the_copy_is_refused(policy_dirs):
    model, tokenizer = load_policy(policy_dirs["plain"])
    own = HFBackend({"weights": "copy"})
    start(own, model, tokenizer)

    class Missing(PolicyWeights):
        def named_tensors(self, dtype=None, device=None):
            yield from list(super().named_tensors(dtype, device))[1:]

    with pytest.raises(RuntimeError, match=r"version 3\) lacks 1 tensor"):
        own.sync_weights(Missing(model, 3))
    with pytest.raises(UserError, match=r"weights: copy"):  # shared mode needs rollout == actor
        HFBackend().on_run_start(
            SimpleNamespace(
                tokenizer=tokenizer,
                device=lambda r: "cuda:1" if r == "rollout" else "cpu",
                actor=model,
            )
        )


def test_seeded_samples_do_not_depend_on_the_rest_of_the_batch(policy_dirs):
    backend, _, _ = make_backend(policy_dirs["stopping"], max_batch_size=2)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7)
    whole = backend.generate(PROMPTS, [], 3, sampling, seeds=[11, 12, 13, 14])
    alone = backend.generate(PROMPTS[2:3], [], 3, sampling, seeds=[13])
    width = alone.response_ids.shape[1]
    assert whole.response_ids[6:9, :width].tolist() == alone.response_ids.tolist()
    assert whole.response_mask[6:9].sum().item() == alone.response_mask.sum().item()
    again = backend.generate(PROMPTS, [], 3, sampling, seeds=[11, 12, 13, 14])
    assert again.response_ids.tolist() == whole.response_ids.tolist()
    other = backend.generate(PROMPTS, [], 3, sampling, seeds=[21, 22, 23, 24])
    assert other.response_ids.tolist() != whole.response_ids.tolist(), "premise: seeds matter"


def test_a_sharded_actor_is_sampled_with_a_copy_of_its_own(policy_dirs, one_process_group):
    # training.parallel: fsdp2 shards the actor (a slice of each weight per rank, a collective
    # per forward): the default backend then samples with its own copy, from the stream.
    import copy

    from alignzoo.engine.learner import fully_shard_model
    from alignzoo.weights import is_sharded

    shared, model, tokenizer = make_backend(policy_dirs["plain"])
    actor = fully_shard_model(copy.deepcopy(model))
    backend = HFBackend()  # weights: shared, the default
    start(backend, actor, tokenizer)
    assert backend.own_copy and backend.model is not actor and not is_sharded(backend.model)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    before = shared.generate(PROMPTS, [], 2, greedy)
    assert _agree(backend.generate(PROMPTS, [], 2, greedy), before)
    with torch.no_grad():  # an update of the sharded weights reaches the copy with the sync
        for param in actor.parameters():
            param.mul_(-1.5)
        for param in model.parameters():
            param.mul_(-1.5)
    backend.sync_weights(PolicyWeights(actor, 1))
    after = shared.generate(PROMPTS, [], 2, greedy)
    assert not _agree(after, before), "premise: the update changes greedy outputs"
    assert _agree(backend.generate(PROMPTS, [], 2, greedy), after)


def test_seeded_draws_follow_each_rows_distribution_and_never_pick_a_zero() -> None:
    from scipy.stats import chisquare

    from alignzoo.plugins.backends.hf import _draw

    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    draws = 40_000
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = _draw(probs.expand(draws, -1), uniforms)
    counts = torch.bincount(tokens, minlength=6)
    assert counts[1] == 0 and counts[5] == 0
    positive = probs > 0
    result = chisquare(counts[positive].numpy(), (probs[positive] * draws).numpy())
    assert result.pvalue > 1e-4, (counts.tolist(), result.pvalue)
    # The extremes of [0, 1): the first and the last token of positive probability.
    edges = _draw(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert edges.tolist() == [0, 4]


def test_a_row_that_is_not_a_distribution_stops_seeded_sampling() -> None:
    from alignzoo.plugins.backends.hf import _draw

    uniforms = torch.full((2,), 0.5, dtype=torch.float64)
    for bad in (float("nan"), float("inf"), -0.1):
        probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, bad, 0.3]])
        with pytest.raises(RuntimeError, match="NaN, inf or negative"):
            _draw(probs, uniforms)
    with pytest.raises(RuntimeError, match="sums to 0"):
        _draw(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), uniforms)


@pytest.mark.parametrize("policy", ["plain", "stopping"])
def test_the_lean_decoder_samples_what_the_models_own_forward_samples(
    policy_dirs, policy, monkeypatch
):
    """The decode loop over alignzoo.kernels.lean and over the model's own forward with a
    DynamicCache: the same seeded tokens, log-probs within 1e-5."""
    from alignzoo.kernels import lean

    backend, model, _ = make_backend(policy_dirs[policy], max_batch_size=3)
    assert lean.can_run_lean(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7)
    seeds = [11, 12, 13, 14]
    ours = backend.generate(PROMPTS, [], 3, sampling, seeds=seeds)
    monkeypatch.setattr(lean, "can_run_lean", lambda model: False)
    theirs = backend.generate(PROMPTS, [], 3, sampling, seeds=seeds)
    assert ours.response_ids.equal(theirs.response_ids)
    assert ours.response_mask.equal(theirs.response_mask)
    assert ours.response_mask.sum() > len(PROMPTS) * 3  # more than one token each on average
    torch.testing.assert_close(ours.rollout_logprobs, theirs.rollout_logprobs, atol=1e-5, rtol=0)


def test_decoding_through_packed_weights_samples_what_the_weights_themselves_sample(
    policy_dirs, monkeypatch
):
    """pack_weights (the default) multiplies by MKL-packed copies of the weights from
    PACK_FROM_NEW_TOKENS new tokens on: the same seeded tokens as pack_weights false, log-probs
    within 1e-5; the copies are taken for long generations only."""
    from alignzoo.kernels import lean

    made: list[int] = []
    real = lean.PackedLinears

    def counted(model, rows):
        packed = real(model, rows)
        made.append(len(packed.packed))
        return packed

    monkeypatch.setattr(lean, "PackedLinears", counted)
    from alignzoo.plugins.backends import hf

    monkeypatch.setattr(hf, "PACK_FROM_NEW_TOKENS", 7)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7)
    seeds = [21, 22, 23, 24]
    packed_backend, _, _ = make_backend(policy_dirs["plain"])
    packed_backend.generate(PROMPTS, [], 3, SamplingParams(max_new_tokens=6), seeds=seeds)
    assert made == []  # shorter than PACK_FROM_NEW_TOKENS: not packed
    packed = packed_backend.generate(PROMPTS, [], 3, sampling, seeds=seeds)
    assert made and (made[0] > 0 or not torch.backends.mkl.is_available())
    plain_backend, _, _ = make_backend(policy_dirs["plain"], pack_weights=False)
    plain = plain_backend.generate(PROMPTS, [], 3, sampling, seeds=seeds)
    assert len(made) == 1  # pack_weights false packs nothing
    assert packed.response_ids.equal(plain.response_ids)
    assert packed.response_mask.sum() > len(PROMPTS) * 3
    torch.testing.assert_close(packed.rollout_logprobs, plain.rollout_logprobs, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def world() -> tuple[object, object]:
    return build_world()


def test_hf_backend_refuses_a_rollout_device_other_than_the_actors(world) -> None:
    model, tokenizer = world
    devices = {"actor": "cpu", "rollout": "cuda:1"}
    run = SimpleNamespace(tokenizer=tokenizer, device=devices.__getitem__, actor=model)
    with pytest.raises(UserError, match=r"rollout.*actor's device"):
        HFBackend().on_run_start(run)
