"""Conversational data (TRL's formats) through the chat template: GRPO online from jsonl, DPO
offline from parquet and with an implicit prompt, KTO offline from a saved DatasetDict whose
held-out split is named "test"; the labeler gets the rendered text and the messages."""

from __future__ import annotations

import json

import datasets
import pytest
from transformers import AutoTokenizer

from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import EmbeddedModelConfig
from alignzoo.engine.datasets import render, split_implicit_prompt
from alignzoo.engine.loop import run_one
from alignzoo.errors import UserError
from alignzoo.world.model import build_model
from alignzoo.world.tokenizer import build_tokenizer

from .conftest import read_jsonl, tiny_experiment

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
    """A small random policy whose tokenizer carries a ChatML template, saved as a folder."""
    folder = tmp_path_factory.mktemp("chat-policy")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML
    cfg = EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    build_model(cfg, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


PROMPTS = [(f"{a}+{b}=", str(a + b)) for a in range(4) for b in range(3)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def spec_for(policy, train, evaluation, arm, online=True, steps=2):
    return tiny_experiment(
        budget={"steps": steps},
        model={"policy": str(policy)},
        data={"train": str(train), "eval": str(evaluation), "online": online},
        training={"prompts_per_step": 2, "samples_per_prompt": 2},
        evaluation={"every": 100, "num_prompts": 4},
        arms={"grpo": None, "x": arm},
    )


def _arms(spec):
    spec["arms"].pop("grpo")
    return spec


def test_grpo_online_renders_prompts_and_a_trl_reward_function_gets_messages(
    write_experiment, tmp_path, chat_policy
):
    rows = [{"prompt": user(p), "answer": a} for p, a in PROMPTS]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    seen = tmp_path / "seen.jsonl"
    # A reward function as TRL documents it for conversational data: messages in, by keyword.
    (tmp_path / "rec.py").write_text(
        "import json\n"
        "def rec(prompts, completions, completion_ids, trainer_state, answer, **kwargs):\n"
        f"    with open({str(seen)!r}, 'a') as fh:\n"
        "        rows = zip(prompts, completions, completion_ids, kwargs['prompt_messages'])\n"
        "        for p, c, ids, m in rows:\n"
        "            row = {'prompt': p, 'completion': c, 'ids': ids,\n"
        "                   'step': trainer_state.global_step, 'messages': m}\n"
        "            fh.write(json.dumps(row) + '\\n')\n"
        "    return [float(c[0]['content'].strip() == a) for c, a in zip(completions, answer)]\n"
    )
    labeler = {"name": "python", "params": {"function": f"{tmp_path / 'rec.py'}:rec"}}
    spec = _arms(spec_for(chat_policy, train, train, {"algorithm": "grpo", "labeler": labeler}))
    summary = run_one(load_experiment(write_experiment(spec)), "x", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    calls = read_jsonl(seen)
    first = calls[0]
    assert first["prompt"] == user("0+0=") == first["messages"]
    assert [m["role"] for m in first["completion"]] == ["assistant"]
    tokenizer = AutoTokenizer.from_pretrained(chat_policy)
    for call in calls:  # the ids are the sampled tokens of the completion's text
        decoded = tokenizer.decode(call["ids"], skip_special_tokens=True)
        assert decoded.strip() == call["completion"][0]["content"].strip(), call
    # training steps 1 and 2; evaluation gets the step evaluated (0 before training, then 2)
    assert {c["step"] for c in calls} == {0, 1, 2}
    sample = read_jsonl(tmp_path / "run" / "samples.jsonl")[0]
    assert sample["prompt"].startswith("<|im_start|>user\n")


def test_dpo_offline_from_parquet_and_with_an_implicit_prompt(
    write_experiment, tmp_path, chat_policy
):
    rows = [{"prompt": user(p), "chosen": assistant(a), "rejected": assistant("9")}
            for p, a in PROMPTS]  # fmt: skip
    parquet = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    implicit = write_jsonl(
        tmp_path / "implicit.jsonl",
        [{"chosen": user(p) + assistant(a), "rejected": user(p) + assistant("9")}
         for p, a in PROMPTS],
    )  # fmt: skip
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": user(p), "answer": a}
                                                      for p, a in PROMPTS])  # fmt: skip
    for name, train in (("parquet", parquet), ("implicit", implicit)):
        spec = _arms(spec_for(chat_policy, train, evaluation, {"algorithm": "dpo"}, online=False))
        loaded = load_experiment(write_experiment(spec, name=f"{name}.yaml"))
        summary = run_one(loaded, "x", 0, tmp_path / name)
        assert summary.status == "finished", (name, summary.error)
        metrics = read_jsonl(tmp_path / name / "metrics.jsonl")
        assert len(metrics) == 2 and all("dpo/rewards/accuracy" in m for m in metrics)


def test_kto_offline_from_a_saved_datasetdict_with_a_test_split(
    write_experiment, tmp_path, chat_policy
):
    train = [{"prompt": user(p), "completion": assistant(a if i % 2 else "9"), "label": bool(i % 2),
              "answer": a} for i, (p, a) in enumerate(PROMPTS)]  # fmt: skip
    held_out = [{"prompt": user(p), "answer": a} for p, a in PROMPTS[:4]]
    folder = tmp_path / "kto_data"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(held_out)}
    ).save_to_disk(str(folder))
    spec = _arms(spec_for(chat_policy, folder, folder, {"algorithm": "kto"}, online=False))
    summary = run_one(load_experiment(write_experiment(spec)), "x", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert evals and evals[-1]["eval/labeled_frac"] == 1.0  # the 4 "test" prompts, labeled


# --------------------------------------------------------------------------- rendering rules


def chat_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer


def test_an_implicit_prompt_is_the_common_prefix():
    row = split_implicit_prompt(
        {"chosen": user("hi") + assistant("hello"), "rejected": user("hi") + assistant("go")}
    )
    assert row["prompt"] == user("hi") and row["chosen"] == assistant("hello")
    text = split_implicit_prompt({"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"})
    assert (text["prompt"], text["chosen"], text["rejected"]) == ("Q: 2+2? A: ", "4", "5")


def test_completions_are_what_the_template_adds_after_the_prompt():
    data = datasets.Dataset.from_list(
        [{"prompt": user("1+1="), "completion": assistant("2"), "label": True}]
    )
    [row] = render(data, chat_tokenizer(), "unpaired", "f.jsonl")
    assert row["prompt"] == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert row["completion"] == "2<|im_end|>\n"
    assert row["completion_messages"] == assistant("2") and row["prompt_messages"] == user("1+1=")
    online = datasets.Dataset.from_list([{"messages": user("1+1=") + assistant("2")}])
    assert render(online, chat_tokenizer(), "online", "f.jsonl")[0]["prompt"].endswith(
        "assistant\n"
    )


def test_messages_without_a_chat_template_is_a_clear_error():
    data = datasets.Dataset.from_list([{"prompt": user("1+1=")}])
    with pytest.raises(UserError, match=r"f\.jsonl: the data holds messages .* no chat template"):
        render(data, build_tokenizer(), "online", "f.jsonl")
