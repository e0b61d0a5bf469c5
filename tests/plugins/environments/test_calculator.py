"""The calculator environment: calls answered with their value (or what was wrong), the no-tool
arm's twin answering every call with an error, the environment contract, and an episode in the
embedded world's plain syntax that keeps the sampled ids and trains only on them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from alignzoo.config.schema import EmbeddedModelConfig, EpisodeConfig
from alignzoo.kernels.forward import policy_forward
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.plugins.environments.calculator import CalculatorEnvironment
from alignzoo.registry import build_plugin_manager
from alignzoo.rollout.episode import ToolCall, Turn
from alignzoo.rollout.multiturn import Episodes
from alignzoo.testing.environments import check_environment
from alignzoo.types import SamplingParams
from alignzoo.world import calculator
from alignzoo.world.calculator import scripted_demonstrations
from alignzoo.world.model import build_model
from alignzoo.world.tokenizer import build_tokenizer
from alignzoo.world.warmstart import supervised_warm_start


def call(expression):
    return ToolCall("calculator", {"expression": expression})


def test_calls_are_answered_in_order_and_mistakes_are_answers_not_exceptions():
    env = CalculatorEnvironment()
    start = env.env_reset(row={"prompt": "12*34=", "answer": "408"}, seed=0)
    assert start.messages == [{"role": "user", "content": "12*34="}]
    assert start.tools and start.tools[0]["function"]["name"] == "calculator"
    turn = Turn(
        "…",
        (call("12*34"), call("2**8"), ToolCall("search", {"q": "x"}), ToolCall("calculator", {})),
        ("a call opened with '[' is not closed with ']'",),
    )
    result = env.env_step(state=start.state, turn=turn)
    contents = [m["content"] for m in result.messages]
    assert contents[0] == "408"
    assert contents[1].startswith("error: only integers")
    assert "no tool named 'search'" in contents[2]
    assert "'expression' must be a string" in contents[3]
    assert "not closed" in contents[4]
    assert not result.done
    assert result.info["metrics"]["tool_calls"] == 4 and result.info["metrics"]["tool_errors"] == 4
    assert result.info["metrics"]["tool/calculator/errors"] == 3
    assert env.env_step(state=start.state, turn=Turn("408")).done  # no call: the answer


def test_the_disabled_calculator_answers_every_call_with_an_error():
    env = CalculatorEnvironment({"enabled": False})
    start = env.env_reset(row={"prompt": "12*34="}, seed=0)
    assert start.tools is None
    result = env.env_step(state=start.state, turn=Turn("[12*34]", (call("12*34"),)))
    assert [m["content"] for m in result.messages] == ["error: no calculator"]
    assert not result.done and result.info["metrics"]["tool_errors"] == 1


@pytest.mark.parametrize("params", [{}, {"enabled": False}])
def test_the_calculator_passes_the_environment_contract(params):
    results = check_environment("calculator", params, max_examples=15)
    assert all(r.passed for r in results), [r for r in results if not r.passed]


@pytest.fixture(scope="module")
def caller():
    """A tiny policy warm-started on traces that always call the calculator."""
    tokenizer = build_tokenizer()
    cfg = EmbeddedModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
        sft_steps=300, sft_lr=1e-2, sft_batch_size=16, seed=0,
    )  # fmt: skip
    examples = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a in (3, 7) for b in (4, 6)]
    traces, calls = scripted_demonstrations(examples, 1.0, seed=0)
    assert calls == len(examples)
    model = build_model(cfg, tokenizer)
    supervised_warm_start(model, tokenizer, traces, cfg, log=lambda _: None)
    return model, tokenizer


def test_an_episode_in_plain_syntax_keeps_the_sampled_ids_and_trains_only_on_them(caller):
    model, tokenizer = caller
    backend = HFBackend()
    backend.on_run_start(
        run=SimpleNamespace(device=lambda role: "cpu", actor=model, tokenizer=tokenizer)
    )
    pm = build_plugin_manager([backend, CalculatorEnvironment()])
    episodes = Episodes(EpisodeConfig(codec="brackets", max_turns=3, max_tokens=32), tokenizer)
    assert episodes.codec.name == "brackets"
    assert tokenizer.decode(episodes.stop_ids) == "]"
    prompts = ["3*4=", "7*6="]
    extras = [{"answer": "12"}, {"answer": "42"}]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    batch, metrics = episodes.run(pm, prompts, extras, 1, greedy, [1, 2])
    # Premise: the warm start taught the policy to call (checked, not assumed).
    assert metrics.get("env/tool_calls") == 1.0, ("the warm start did not teach calling", metrics)
    # What follows holds whatever the policy wrote after its call (it is read from the
    # transcript, not assumed): the call, the calculator's answer, the final turn.
    for row in range(batch.size):
        length = int(batch.response_attention[row].sum())
        ids = batch.response_ids[row, :length].tolist()
        trained = batch.response_mask[row, :length].tolist()
        messages = batch.extras[row]["messages"]
        first, answer = messages[1], messages[2]
        assert first["role"] == "assistant" and first["tool_calls"], messages
        expression = first["tool_calls"][0]["function"]["arguments"]["expression"]
        assert first["content"] == f"[{expression}]"  # the turn stopped right after the call
        assert answer == {"role": "tool", "name": "calculator", "content": answer["content"]}
        env_part = tokenizer.decode([t for t, m in zip(ids, trained, strict=True) if not m])
        assert env_part == calculator.format_result(answer["content"])  # "=12\n", never trained
        assert answer["content"] == str(calculator.evaluate(expression))
        model_part = tokenizer.decode(
            [t for t, m in zip(ids, trained, strict=True) if m], skip_special_tokens=True
        )
        final = [m["content"] for m in messages[3:] if m["role"] == "assistant"]
        assert model_part == first["content"] + "".join(final)
        assert batch.responses[row] == (final[-1] if final else first["content"])
    with torch.no_grad():
        logprobs, _ = policy_forward(model, batch)
    mask = batch.response_mask.bool()
    assert torch.allclose(logprobs[mask], batch.rollout_logprobs[mask], atol=1e-4)
