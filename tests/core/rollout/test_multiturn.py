"""Multi-turn episodes, token in and token out: the ids trained on are exactly the ids the
backend sampled, with the environment's ids between them; the trained-token mask is 1 exactly
on sampled ids; the trainer's log-probs of them equal the sampler's; environment faults are
outcomes, never a crash, and every opened episode is closed."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from alignzoo.config.schema import EmbeddedModelConfig, EpisodeConfig
from alignzoo.kernels.forward import policy_forward
from alignzoo.plugin import Environment, hookimpl
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.registry import build_plugin_manager
from alignzoo.rollout.codecs import HermesCodec
from alignzoo.rollout.episode import EpisodeStart, StepResult
from alignzoo.rollout.multiturn import Episodes
from alignzoo.types import SamplingParams
from alignzoo.world.model import build_model
from alignzoo.world.tokenizer import build_tokenizer

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}Call one as <tool_call>{...}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TOOL_TEMPLATE
    cfg = EmbeddedModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = build_model(cfg, tokenizer)
    model.eval()
    return model, tokenizer


class Recording(HFBackend):
    """The hf backend, keeping what each generate_ids call was given and returned."""

    calls: list[tuple[list[list[int]], list[tuple[list[int], list[float]]]]]

    @hookimpl
    def generate_ids(self, contexts, sampling, seeds=None, stop_token_ids=None):
        out = super().generate_ids(contexts, sampling, seeds, stop_token_ids)
        self.calls.append(([list(c) for c in contexts], out))
        return out


class Echo(Environment):
    """Answers every turn with a tool message for ``turns`` turns, then ends; counts closes.
    ``fault`` makes the episode of row 'bad' raise, hang, or return nonsense."""

    closed: ClassVar[list[int]] = []
    fault: ClassVar[str] = ""

    @hookimpl
    def env_reset(self, row, seed):
        messages = [{"role": "user", "content": row["prompt"]}]
        return EpisodeStart(state={"seed": seed, "turn": 0, "row": row}, messages=messages)

    @hookimpl
    async def env_step(self, state, turn):
        state["turn"] += 1
        if state["row"]["prompt"] == "bad":
            if self.fault == "raise":
                raise ValueError("the environment broke")
            if self.fault == "hang":
                await asyncio.sleep(30)
            if self.fault == "nonsense":
                return {"not": "a StepResult"}
        if state["turn"] >= 3:
            return StepResult(reward=1.0, done=True)
        answer = {"role": "tool", "content": f"result {state['turn']} " + "x" * 5}
        return StepResult(messages=[answer], reward=0.5)

    @hookimpl
    def env_close(self, state):
        self.closed.append(state["seed"])


class AsyncEcho(Echo):
    """Echo with every hook ``async def``, closing as a client of a server would (awaiting)."""

    @hookimpl
    async def env_reset(self, row, seed):
        await asyncio.sleep(0)
        return super().env_reset(row, seed)

    @hookimpl
    async def env_close(self, state):
        await asyncio.sleep(0.01)
        self.closed.append(state["seed"])


def run(
    policy, prompts, fault="", n=2, env=Echo, **limits
) -> tuple[Any, dict[str, float], Recording]:
    model, tokenizer = policy
    backend = Recording()
    backend.calls = []
    run_ctx = SimpleNamespace(
        device=lambda role: "cpu", actor=model, tokenizer=tokenizer, models=None
    )
    backend.on_run_start(run=run_ctx)
    Echo.closed, Echo.fault = [], fault
    pm = build_plugin_manager([backend, env()])
    cfg = EpisodeConfig(codec="hermes", **{"max_turns": 4, "max_tokens": 96, **limits})
    episodes = Episodes(cfg, tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    batch, metrics = episodes.run(pm, prompts, [{} for _ in prompts], n, sampling, [11, 12, 13])
    return batch, metrics, backend


def segments(mask_row: list[float], ids: list[int], value: int) -> list[list[int]]:
    out, current = [], []
    for m, t in zip(mask_row, ids, strict=True):
        if int(m) == value:
            current.append(t)
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def test_trained_ids_are_the_sampled_ids_and_the_log_probs_agree(policy):
    model, tokenizer = policy
    batch, metrics, backend = run(policy, ["1+1=", "2+3="])
    assert batch.size == 4 and batch.response_attention is not None
    sampled = [out for _, outs in backend.calls for out in outs]
    for row in range(batch.size):
        length = int(batch.response_attention[row].sum())
        ids = batch.response_ids[row, :length].tolist()
        trained = batch.response_mask[row, :length].tolist()
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        # Every trained segment is one backend turn, as sampled, in order; between them the
        # environment's answer, never trained on.
        turns = [seg for seg in segments(trained, ids, 1)]
        mine = [o for o in sampled if any(o[0] == t for t in turns)]
        assert [o[0] for o in mine] == turns
        for context, outs in backend.calls:  # each turn was sampled from the ids so far
            for c, o in zip(context, outs, strict=True):
                if o[0] in turns and c[: len(prompt)] == prompt:
                    assert (prompt + ids)[: len(c) + len(o[0])] == c + o[0]
        between = segments(trained, ids, 0)
        assert len(between) >= 1 and all("result" in tokenizer.decode(s) for s in between)
        assert set(trained[: len(ids)]) <= {0.0, 1.0}
        assert batch.response_attention[row, length:].sum() == 0  # padding only after
    # The trainer's log-probs of the sampled tokens equal the sampler's: no drift.
    with torch.no_grad():
        logprobs, _ = policy_forward(model, batch)
    mask = batch.response_mask.bool()
    assert torch.allclose(logprobs[mask], batch.rollout_logprobs[mask], atol=1e-4)
    assert metrics["env/done_frac"] == 1.0 and metrics["env/turns"] == 3.0
    assert 0 < metrics["env/trained_token_frac"] < 1
    assert sorted(Echo.closed) == sorted(set(Echo.closed)) and len(Echo.closed) == 4
    messages = batch.extras[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"] * 1 + [
        "assistant",
        "tool",
        "assistant",
    ]
    assert batch.extras[0]["episode"]["reward"] == 2.0
    # Each step's reward sits after the model's last token of that step: 0.5, 0.5, then 1.0.
    for row, extra in enumerate(batch.extras):
        pairs = extra["episode"]["step_rewards"]
        assert [r for _, r in pairs] == [0.5, 0.5, 1.0]
        trained = batch.response_mask[row].tolist()
        ends = [
            i for i, m in enumerate(trained) if m and (i + 1 == len(trained) or not trained[i + 1])
        ]
        assert [i for i, _ in pairs] == ends


def test_limits_truncate_and_are_recorded(policy):
    batch, metrics, _ = run(policy, ["1+1="], max_turns=1)
    assert metrics["env/truncated_frac"] == 1.0
    assert all(e["episode"]["outcome"] == "truncated" for e in batch.extras)
    batch, metrics, _ = run(policy, ["1+1="], max_tokens=8)
    assert all(int(batch.response_attention[r].sum()) <= 8 for r in range(batch.size))
    assert metrics["env/truncated_frac"] == 1.0
    # A turn the limit cut is still a turn: in the transcript (what the labeler scores) and
    # counted, as its tokens are trained on (max_tokens 3 cuts the first turn of 6 tokens).
    cut, _, _ = run(policy, ["1+1="], max_tokens=3)
    for episodes in (batch, cut):
        for row, extra in enumerate(episodes.extras):
            trained = episodes.response_mask[row].tolist()
            ids = episodes.response_ids[row].tolist()
            assert extra["episode"]["turns"] == len(segments(trained, ids, 1)) >= 1
            turns = [m for m in extra["messages"] if m["role"] == "assistant"]
            assert len(turns) == extra["episode"]["turns"]
            assert episodes.responses[row] == turns[-1]["content"]


@pytest.mark.parametrize("fault", ["raise", "hang", "nonsense"])
@pytest.mark.parametrize("policy_name", ["drop_sample", "drop_group", "keep"])
def test_a_failing_environment_is_an_outcome_with_the_arms_policy(policy, fault, policy_name):
    started = time.monotonic()
    batch, metrics, _ = run(
        policy, ["ok", "bad"], fault=fault, step_timeout_s=0.5, on_failure=policy_name
    )
    assert time.monotonic() - started < 20  # a hang costs its timeout, not the step
    outcome = "timeout" if fault == "hang" else "error"
    assert metrics[f"env/{outcome}_frac"] == 0.5
    prompts = [e.get("messages")[0]["content"] for e in batch.extras]
    if policy_name == "keep":
        assert prompts.count("bad") == 2
        bad = [e["episode"] for e in batch.extras if e["messages"][0]["content"] == "bad"]
        assert all(b["outcome"] == outcome and b["reason"] for b in bad)
    else:  # drop_sample and drop_group agree here: both samples of 'bad' failed
        assert prompts == ["ok", "ok"] and batch.group_ids.tolist() == [0, 0]
    assert len(Echo.closed) == 4  # every opened episode closed


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a coroutine never awaited fails it
def test_async_hooks_are_awaited_the_close_of_every_episode_included(policy):
    batch, metrics, _ = run(policy, ["1+1=", "2+3="], env=AsyncEcho)
    assert batch.size == 4 and metrics["env/done_frac"] == 1.0
    assert len(Echo.closed) == 4 and "env/close_failed" not in metrics


def test_the_hermes_codec_reads_calls_and_reports_malformed_ones():
    codec = HermesCodec()
    parsed = codec.parse(
        'a <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "x", "arguments": "{\\"b\\": 2}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": 1}'
    )
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1}), ("x", {"b": 2})]
    assert len(parsed.errors) == 3
    assert "not valid JSON" in parsed.errors[0] and "JSON object" in parsed.errors[1]
    assert "without </tool_call>" in parsed.errors[2]
    deep = codec.parse("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert deep.calls == () and len(deep.errors) == 1  # a hostile call is an error, not a crash
