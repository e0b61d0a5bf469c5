"""An arm with an environment trains on multi-turn episodes end to end: the environment's reward
through the episode_reward labeler, env/* metrics in every step, transcripts in the samples,
evaluation by episodes too, and a run killed mid-way resumes to the uninterrupted run's numbers."""

from __future__ import annotations

from importlib import metadata

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import EmbeddedModelConfig
from alignzoo.engine.loop import run_one
from alignzoo.plugin import Environment, hookimpl
from alignzoo.registry import ENTRY_POINT_GROUP, Registry
from alignzoo.rollout.episode import EpisodeStart, StepResult
from alignzoo.world.model import build_model
from alignzoo.world.tokenizer import build_tokenizer

from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOLATILE = ("time_s", "timing/", "throughput/", "labeler/", "memory/")


class Countdown(Environment):
    """Two tool answers, then done; reward 1 when the model's last turn is short."""

    @hookimpl
    def env_reset(self, row, seed):
        return EpisodeStart({"left": 2}, [{"role": "user", "content": row["prompt"]}])

    @hookimpl
    def env_step(self, state, turn):
        if state["left"] == 0:
            return StepResult(reward=float(len(turn.text) < 4), done=True)
        state["left"] -= 1
        return StepResult([{"role": "tool", "content": f"{state['left']} left"}], reward=0.0)


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-policy")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML
    cfg = EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    build_model(cfg, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def test_an_arm_trains_on_episodes_and_resumes_exactly(write_experiment, tmp_path, chat_policy):
    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(Countdown, "countdown")
    spec = tiny_experiment(
        budget={"steps": 4},
        model={"policy": str(chat_policy)},
        training={
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "checkpoint_every": 2,
            "sampling": {"max_new_tokens": 4},
        },
        evaluation={"every": 2, "num_prompts": 4},
        arms={
            "grpo": {
                "algorithm": "grpo",
                "labeler": "episode_reward",
                "environment": "countdown",
                "episodes": {"codec": "hermes", "max_turns": 4, "max_tokens": 256},
            }
        },
    )
    loaded = load_experiment(write_experiment(spec), registry=registry)
    out = tmp_path / "run"
    summary = run_one(loaded, "grpo", 0, out)
    assert summary.status == "finished", summary.error
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 4
    for row in rows:
        assert row["env/turns"] == 3.0 and row["env/done_frac"] == 1.0, str(
            {k: v for k, v in row.items() if k.startswith("env")}
        )
        assert 0 < row["env/trained_token_frac"] < 1
        assert row["label/valued"] == 4.0  # every episode's reward reached training
    sample = read_jsonl(out / "samples.jsonl")[0]  # the transcript, with roles
    assert [m["role"] for m in sample["messages"]][:3] == ["user", "assistant", "tool"]
    assert sample["episode"]["outcome"] == "done"
    evals = read_jsonl(out / "eval.jsonl")
    assert evals and all("eval/score" in e for e in evals)  # evaluated by episodes too

    reference = _stable(rows)
    back_to_checkpoint(out, 2)
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    assert _stable(read_jsonl(out / "metrics.jsonl")) == reference
