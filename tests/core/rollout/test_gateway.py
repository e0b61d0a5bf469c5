"""The agent gateway (alignzoo.rollout.gateway, alignzoo.rollout.agents) driven by the real
openai SDK: what an agent's calls become in the batch, token for token, and how the gateway
answers (tool calls, streaming, log-probs, n, stop, bad requests).

Two backends: the hf backend on a Qwen2-style BPE chat policy (random weights, a tokenizer that
drifts when text is re-tokenised), whose every output a Recorder keeps; and a scripted backend
that writes chosen text (tool calls, malformed ones) so that the gateway's answers to them are
known in advance."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignzoo.config.schema import EpisodeConfig
from alignzoo.plugin import hookimpl
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.registry import build_plugin_manager
from alignzoo.rollout.agents import AgentEpisodes, AgentSettings
from alignzoo.types import SamplingParams

from .bpe_chat import CALCULATOR, Recorder, check_token_in_token_out, save_bpe_chat_policy


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
    folder = save_bpe_chat_policy(tmp_path_factory.mktemp("bpe") / "policy")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def hf_recorded(chat_policy):
    model, tokenizer = chat_policy
    backend = HFBackend()
    backend.on_run_start(
        run=SimpleNamespace(device=lambda role: "cpu", actor=model, tokenizer=tokenizer)
    )
    recorder = Recorder(backend)
    return build_plugin_manager([recorder]), recorder


class Scripted:
    """A backend that writes ``reply(context_text)`` and ``<|im_end|>``, each token at log-prob
    -0.5 (what the gateway makes of known text)."""

    kind = "backend"

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply = tokenizer, reply
        self.contexts: list[list[int]] = []
        self.outputs: dict[tuple[int, ...], list[list[int]]] = {}  # context -> replies from it

    @hookimpl
    def generate_ids(self, contexts, sampling, seeds, stop_token_ids):
        out = []
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        for context in contexts:
            self.contexts.append(list(context))
            text = self.reply(self.tokenizer.decode(context))
            ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], end]
            ids = ids[: sampling.max_new_tokens]
            self.outputs.setdefault(tuple(context), []).append(ids)
            out.append((ids, [-0.5] * len(ids)))
        return out


def assert_each_trained_run_was_sampled_there(batch, backend):
    """Every run of trained tokens is (the start of) a reply the backend sampled from exactly
    the ids before it in its sample; returns the number of trained tokens."""
    trained = 0
    for row in range(batch.size):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        length = int(batch.response_attention[row].sum())
        ids = batch.response_ids[row, :length].tolist()
        mask = batch.response_mask[row, :length].tolist()
        position = 0
        while position < length:
            end = position
            while end < length and mask[end] == mask[position]:
                end += 1
            if mask[position]:
                run = ids[position:end]
                replies = backend.outputs.get(tuple(prompt + ids[:position]), [])
                assert any(r[: len(run)] == run for r in replies), f"row {row} [{position}:{end}]"
                trained += len(run)
            position = end
    return trained


def run(tokenizer, pm, agent, rows, n=1, seeds=(3, 4), cfg=None, limit=None, width=10, **settings):
    runner = AgentEpisodes(
        cfg or EpisodeConfig(max_tokens=400),
        tokenizer,
        AgentSettings(function=agent, **settings),
        limit,
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=width)
    prompts = [r["prompt"] for r in rows]
    seeds = list(seeds)[: len(rows)] if seeds is not None else None
    return runner.run(pm, prompts, rows, n, sampling, seeds)


def client(base_url, key):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


ROWS = [{"prompt": "What is 12*34?", "tool": "408"}, {"prompt": "Weather in Paris?", "tool": "sun"}]


def three_calls(task, base_url, key):
    """Ask, answer the reply with a tool message, then with a user message: two continuations."""
    api = client(base_url, key)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": task["prompt"]},
    ]
    for follow in ({"role": "tool", "tool_call_id": "c1", "content": task["tool"]},
                   {"role": "user", "content": "and then?"}, None):  # fmt: skip
        reply = api.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if follow is not None:
            messages.append(follow)
    return messages[-1].get("content")


def test_an_agents_continued_calls_are_one_sample_of_exactly_the_sampled_ids(chat_policy):
    model, tokenizer = chat_policy
    pm, recorder = hf_recorded(chat_policy)
    batch, metrics = run(tokenizer, pm, three_calls, ROWS, n=2)
    assert metrics["env/done_frac"] == 1.0 and metrics["env/agent/calls"] == 3.0
    assert metrics["env/agent/branches"] == 0.0 and batch.size == 4  # one sample per episode
    assert [e["episode"]["turns"] for e in batch.extras] == [3, 3, 3, 3]
    drifted = check_token_in_token_out(batch, recorder, tokenizer, model)
    # the premise: re-tokenising the transcript's text would have changed some rows' ids
    assert drifted > 0, "premise: no row of this batch would drift when re-tokenised"
    # the labeler sees the final transcript: the last reply is the response
    assert all(e["messages"][-1]["role"] == "assistant" for e in batch.extras)
    assert batch.responses[0] == batch.extras[0]["messages"][-1]["content"]


def test_streamed_text_and_logprobs_are_the_recorded_ones(chat_policy):
    _, tokenizer = chat_policy
    pm, recorder = hf_recorded(chat_policy)
    got = {}

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": task["prompt"]}]
        plain = api.chat.completions.create(model="policy", messages=messages, logprobs=True)
        stream = api.chat.completions.create(
            model="policy", messages=[*messages, plain.choices[0].message.model_dump(
                exclude_none=True), {"role": "user", "content": "more"}],
            stream=True, logprobs=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        got[task["prompt"]] = (plain, chunks)

    batch, _ = run(tokenizer, pm, agent, ROWS[:1])
    plain, chunks = got[ROWS[0]["prompt"]]
    (first_ids, first_lps), (second_ids, second_lps) = [c[1][0] for c in recorder.calls]
    assert [t.logprob for t in plain.choices[0].logprobs.content] == pytest.approx(first_lps)
    assert plain.choices[0].message.content == tokenizer.decode(first_ids, skip_special_tokens=True)
    assert plain.usage.completion_tokens == len(first_ids)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokenizer.decode(second_ids, skip_special_tokens=False).replace("<|im_end|>", "")
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]  # fmt: skip
    assert streamed == pytest.approx(second_lps)
    assert chunks[-1].usage.completion_tokens == len(second_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    # both calls in the one sample, trained exactly on the sampled ids
    trained = batch.response_ids[0][batch.response_mask[0].bool()].tolist()
    assert trained == first_ids + second_ids


def test_n_choices_are_samples_and_the_continued_choice_grows(chat_policy):
    _, tokenizer = chat_policy
    pm, recorder = hf_recorded(chat_policy)

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": task["prompt"]}]
        reply = api.chat.completions.create(model="policy", messages=messages, n=3)
        assert len(reply.choices) == 3
        picked = reply.choices[1].message.model_dump(exclude_none=True)
        api.chat.completions.create(
            model="policy", messages=[*messages, picked, {"role": "user", "content": "ok"}]
        )

    batch, metrics = run(tokenizer, pm, agent, ROWS[:1])
    assert batch.size == 3 and metrics["env/agent/branches"] == 2.0
    sampled = sum(len(ids) for _, outs in recorder.calls for ids, _ in outs)
    assert int(batch.response_mask.sum()) == sampled  # every sampled token trained once
    turns = sorted(e["agent"]["branch"] for e in batch.extras)
    assert turns == [0, 1, 2]
    (_, first), (_, second) = recorder.calls
    grown = [r for r in range(3) if int(batch.response_mask[r].sum()) > len(first[0][0])]
    assert len(grown) == 1  # the picked choice's sample holds the second call too
    row = grown[0]
    ids = batch.response_ids[row][batch.response_mask[row].bool()].tolist()
    assert ids == first[1][0] + second[0][0]


def test_an_edited_history_starts_a_branch_with_earlier_replies_as_context(chat_policy):
    _, tokenizer = chat_policy
    pm, recorder = hf_recorded(chat_policy)

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": task["prompt"]}]
        reply = api.chat.completions.create(model="policy", messages=messages)
        edited = [{"role": "user", "content": task["prompt"] + " Be brief."},
                  reply.choices[0].message.model_dump(exclude_none=True),
                  {"role": "user", "content": "again"}]  # fmt: skip
        api.chat.completions.create(model="policy", messages=edited)

    batch, metrics = run(tokenizer, pm, agent, ROWS[:1])
    assert batch.size == 2 and metrics["env/agent/branches"] == 1.0
    _, (contexts, second) = recorder.calls
    rows = {int(batch.response_mask[r].sum()): r for r in range(2)}
    branch = rows[len(second[0][0])]
    prompt = batch.prompt_ids[branch][batch.prompt_mask[branch].bool()].tolist()
    assert prompt == contexts[0]  # the branch samples from its rendered messages...
    assert "Be brief." in tokenizer.decode(prompt)
    ids = batch.response_ids[branch][batch.response_mask[branch].bool()].tolist()
    assert ids == second[0][0]  # ...and trains only what it sampled


def tool_call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def scripted_pm(tokenizer, replies):
    backend = Scripted(tokenizer, replies)
    return build_plugin_manager([backend]), backend


def last_user(text):
    """The content of the last user message of a rendered ChatML context."""
    return text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def test_tool_calls_are_answered_in_openais_shape_and_malformed_ones_as_text(chat_policy):
    _, tokenizer = chat_policy
    script = {
        "call": tool_call("calculator", {"expression": "2*3"}),
        "bad": '<tool_call>\n{"name": "calculator", "arguments": {\n</tool_call>',
        "unknown": tool_call("search", {"q": "x"}),
        "unclosed": '<tool_call>\n{"name": "calculator"',
    }
    pm, _ = scripted_pm(tokenizer, lambda text: script[last_user(text)])
    seen = {}

    def agent(task, base_url, key):
        api = client(base_url, key)
        for kind in script:
            messages = [{"role": "user", "content": kind}]
            seen[kind] = api.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR]
            )
            chunks = api.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR], stream=True
            )
            seen[kind + "/stream"] = list(chunks)

    _, metrics = run(tokenizer, pm, agent, ROWS[:1], seeds=None, width=64)
    assert metrics["env/done_frac"] == 1.0 and metrics["env/agent/refused"] == 0.0
    call = seen["call"].choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None
    (made,) = call.message.tool_calls
    assert made.function.name == "calculator" and made.id.startswith("call_")
    assert json.loads(made.function.arguments) == {"expression": "2*3"}
    streamed = [d for c in seen["call/stream"] for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in streamed] == ["calculator"]
    for kind in ("bad", "unknown", "unclosed"):  # the model's text, for the agent to read
        choice = seen[kind].choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        assert choice.message.content == script[kind]


def test_tool_choice_none_and_stop_strings(chat_policy):
    _, tokenizer = chat_policy
    pm, _ = scripted_pm(tokenizer, lambda text: tool_call("calculator", {"expression": "1"}))
    seen = {}

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": "x"}]
        seen["none"] = api.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], tool_choice="none"
        )
        seen["stop"] = api.chat.completions.create(
            model="policy", messages=messages, stop=["calculator"], logprobs=True
        )

    run(tokenizer, pm, agent, ROWS[:1], seeds=None, width=64)
    none = seen["none"].choices[0]
    assert none.message.tool_calls is None and "<tool_call>" in none.message.content
    stop = seen["stop"].choices[0]
    assert stop.finish_reason == "stop" and "calculator" not in stop.message.content
    assert stop.message.content.endswith('"name": "')
    # the tokens up to the one that completed the stop string were sampled, and are trained
    kept = len(stop.logprobs.content)
    full = len(tokenizer(tool_call("calculator", {"expression": "1"}))["input_ids"]) + 1
    assert 0 < kept < full


def test_wrong_requests_get_4xx_json_errors_never_5xx(chat_policy):
    _, tokenizer = chat_policy
    pm, _ = scripted_pm(tokenizer, lambda text: "fine")
    statuses = {}

    def agent(task, base_url, key):
        with httpx.Client(base_url=base_url) as http:
            auth = {"Authorization": f"Bearer {key}"}
            wrong = {"Authorization": "Bearer az-not-a-key"}
            ok = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
            cases = {
                "models": ("GET", "/models", None, auth),
                "no key": ("POST", "/chat/completions", json.dumps(ok), {}),
                "wrong key": ("POST", "/chat/completions", json.dumps(ok), wrong),
                "truncated": ("POST", "/chat/completions", json.dumps(ok)[:-7], auth),
                "nested": ("POST", "/chat/completions", "[" * 100_000 + "]" * 100_000, auth),
                "not an object": ("POST", "/chat/completions", "[1, 2]", auth),
                "no messages": ("POST", "/chat/completions", json.dumps({"messages": []}), auth),
                "bad role": (
                    "POST",
                    "/chat/completions",
                    json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
                    auth,
                ),
                "bad n": ("POST", "/chat/completions", json.dumps({**ok, "n": "two"}), auth),
                "too hot": (
                    "POST",
                    "/chat/completions",
                    json.dumps({**ok, "temperature": 9}),
                    auth,
                ),
                "too long": (
                    "POST",
                    "/chat/completions",
                    json.dumps({"messages": [{"role": "user", "content": "word " * 600}]}),
                    auth,
                ),
                "five stops": (
                    "POST",
                    "/chat/completions",
                    json.dumps({**ok, "stop": list("abcde")}),
                    auth,
                ),
                "bad reward": ("POST", "/reward", json.dumps({"reward": "high"}), auth),
                "nan reward": ("POST", "/reward", '{"reward": NaN}', auth),
                "no route": ("POST", "/embeddings", json.dumps(ok), auth),
                "wrong method": ("GET", "/chat/completions", None, auth),
                "huge": ("POST", "/chat/completions", "x" * (5 * 1024 * 1024), auth),
                "fine": ("POST", "/chat/completions", json.dumps(ok), auth),
            }
            for name, (method, path, body, headers) in cases.items():
                response = http.request(method, path, content=body, headers=headers)
                statuses[name] = (response.status_code, response.json())

    _, metrics = run(tokenizer, pm, agent, ROWS[:1], seeds=None, limit=256)
    codes = {name: status for name, (status, _) in statuses.items()}
    assert codes == {
        "models": 200, "no key": 401, "wrong key": 401, "truncated": 400, "nested": 400,
        "not an object": 400, "no messages": 400, "bad role": 400, "bad n": 400,
        "too hot": 400, "too long": 400, "five stops": 400, "bad reward": 400,
        "nan reward": 400, "no route": 404, "wrong method": 405, "huge": 413, "fine": 200,
    }  # fmt: skip
    assert statuses["models"][1]["data"][0]["id"] == "policy"
    for name, (status, body) in statuses.items():
        if status >= 400:
            assert body["error"]["message"] and body["error"]["code"], name
    assert statuses["too long"][1]["error"]["code"] == "context_length_exceeded"
    assert statuses["bad n"][1]["error"]["param"] == "n"
    assert metrics["env/agent/unknown_key_requests"] == 2.0
    assert metrics["env/done_frac"] == 1.0  # the episode went on after every refusal


def test_a_key_opens_its_own_episode_only_and_closes_with_it(chat_policy):
    _, tokenizer = chat_policy
    pm, _ = scripted_pm(tokenizer, lambda text: "fine")
    keys, statuses = [], []

    def agent(task, base_url, key):
        api = client(base_url, key)
        api.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a"}])
        keys.append((base_url, key))
        if len(keys) == 2:  # the second episode tries the first's key, once that one is over
            first_url, first_key = keys[0]
            response = httpx.get(f"{first_url}/models",
                                 headers={"Authorization": f"Bearer {first_key}"})  # fmt: skip
            statuses.append(response.status_code)

    _, metrics = run(tokenizer, pm, agent, ROWS, concurrency=1, seeds=None)
    assert len({k for _, k in keys}) == 2  # a key per episode
    assert statuses == [401]
    assert metrics["env/agent/unknown_key_requests"] == 1.0


def test_a_reward_the_agent_posts_is_the_episodes(chat_policy):
    _, tokenizer = chat_policy
    pm, _ = scripted_pm(tokenizer, lambda text: "fine")

    def agent(task, base_url, key):
        api = client(base_url, key)
        api.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a"}])
        for value in (0.1, len(task["prompt"]) / 100):  # the last one counts
            httpx.post(f"{base_url}/reward", json={"reward": value},
                       headers={"Authorization": f"Bearer {key}"}).raise_for_status()  # fmt: skip

    batch, metrics = run(tokenizer, pm, agent, ROWS, seeds=None)
    rewards = [e["episode"]["reward"] for e in batch.extras]
    assert rewards == [len(r["prompt"]) / 100 for r in ROWS]
    assert metrics["env/reward_mean"] == pytest.approx(sum(rewards) / 2)


def test_an_openai_agents_sdk_agent_trains_unchanged_but_for_its_base_url(chat_policy):
    """The OpenAI Agents SDK (its chat-completions model, a function tool, the Runner's loop):
    its two calls of an episode are one sample, the tool's answer between them as context."""
    pytest.importorskip("agents", reason="the agents extra (openai-agents)")
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    _, tokenizer = chat_policy

    def reply(text):  # call the tool first; answer with its result once it is there
        last = text.rsplit("<|im_start|>", 2)[1]
        if "<tool_response>" in last:
            return "It is " + last.split("<tool_response>\n", 1)[1].split("\n", 1)[0] + "."
        return tool_call("calculator", {"expression": "6*7"})

    pm, _ = scripted_pm(tokenizer, reply)
    answers = {}

    def agent(task, base_url, key):
        set_tracing_disabled(True)  # nothing leaves the machine

        @function_tool
        def calculator(expression: str) -> str:
            """Evaluate an integer expression.

            Args:
                expression: For example 12*34.
            """
            a, b = expression.split("*")
            return str(int(a) * int(b))

        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
        model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
        solver = Agent(name="solver", instructions="Use the calculator.", tools=[calculator],
                       model=model)  # fmt: skip
        answers[task["prompt"]] = Runner.run_sync(solver, task["prompt"], max_turns=4).final_output

    batch, metrics = run(tokenizer, pm, agent, ROWS, seeds=None, width=64)
    assert answers == {r["prompt"]: "It is 42." for r in ROWS}
    assert metrics["env/done_frac"] == 1.0 and metrics["env/agent/calls"] == 2.0
    assert metrics["env/agent/branches"] == 0.0 and batch.size == 2  # one sample per episode
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row in range(2):
        ids = batch.response_ids[row][batch.response_mask[row].bool()].tolist()
        first = tokenizer(tool_call("calculator", {"expression": "6*7"}))["input_ids"]
        second = tokenizer("It is 42.")["input_ids"]
        assert ids == [*first, end, *second, end]  # the two replies as sampled, trained
        context = batch.response_ids[row][~batch.response_mask[row].bool()]
        assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(context)
        assert batch.responses[row] == "It is 42."


def test_the_schemas_codec_names_are_the_codecs():
    from typing import get_args

    from alignzoo.config.schema import EpisodeConfig
    from alignzoo.rollout.codecs import CODECS

    names = get_args(EpisodeConfig.model_fields["codec"].annotation)
    assert set(names) == {"auto", *CODECS}


def qwen3_style(tokenizer):
    """The tokenizer with the template changed as Qwen3's is: an assistant message before the
    last user message loses its ``<think>...</think>`` block (not append-only)."""
    import copy

    from .bpe_chat import TOOL_TEMPLATE

    changed = copy.deepcopy(tokenizer)
    last_user = (
        "{%- set ns = namespace(last_user=0) %}{%- for m in messages %}"
        "{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
        "{%- endfor %}"
    )
    plain = "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    assert plain in TOOL_TEMPLATE
    thinking = (
        "{%- set content = m.content %}"
        "{%- if m.role == 'assistant' and loop.index0 < ns.last_user %}"
        "{%- set content = m.content.split('</think>')[-1] %}{%- endif %}"
        "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    )
    changed.chat_template = last_user + TOOL_TEMPLATE.replace(plain, thinking)
    return changed


@pytest.mark.parametrize("template", ["append-only", "qwen3-style"])
def test_a_template_that_rewrites_earlier_turns_starts_a_branch(chat_policy, template):
    _, tokenizer = chat_policy
    if template == "qwen3-style":
        tokenizer = qwen3_style(tokenizer)
    pm, _ = scripted_pm(tokenizer, lambda text: "<think>hmm</think>ok")

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": "hi"}]
        reply = api.chat.completions.create(model="policy", messages=messages)
        assert reply.choices[0].message.content == "<think>hmm</think>ok"
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "more"}]  # fmt: skip
        api.chat.completions.create(model="policy", messages=messages)

    batch, metrics = run(tokenizer, pm, agent, ROWS[:1], seeds=None, width=32)
    if template == "append-only":  # the premise: the same calls continue one sample
        assert batch.size == 1 and metrics["env/agent/branches"] == 0.0
        return
    assert batch.size == 2 and metrics["env/agent/branches"] == 1.0
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>hmm</think>ok"},
         {"role": "user", "content": "more"}], add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert "hmm" not in rendered  # the second call sampled from the history the template wrote
    prompts = [tokenizer.decode(batch.prompt_ids[r][batch.prompt_mask[r].bool()]) for r in (0, 1)]
    assert rendered in prompts


def test_two_calls_in_flight_on_one_sample_become_two_samples_each_sampled_in_place(chat_policy):
    """The same continuation sent twice at once (a client retry after its own timeout, two
    sub-calls): each reply is trained in the context it was sampled from."""
    import threading
    import time

    _, tokenizer = chat_policy

    def slow(text):  # a call arriving meanwhile is placed before this one is recorded
        time.sleep(0.3)
        return f"reply {len(backend.contexts)}"

    pm, backend = scripted_pm(tokenizer, slow)

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": "hi"}]
        reply = api.chat.completions.create(model="policy", messages=messages)
        follow = [*messages, reply.choices[0].message.model_dump(exclude_none=True),
                  {"role": "user", "content": "more"}]  # fmt: skip
        calls = [threading.Thread(target=api.chat.completions.create,
                                  kwargs={"model": "policy", "messages": follow})
                 for _ in range(2)]  # fmt: skip
        for call in calls:
            call.start()
        for call in calls:
            call.join()

    batch, metrics = run(tokenizer, pm, agent, ROWS[:1], seeds=None, width=16)
    assert metrics["env/agent/calls"] == 3.0 and batch.size == 2
    trained = assert_each_trained_run_was_sampled_there(batch, backend)
    assert trained == sum(len(r) for rs in backend.outputs.values() for r in rs)  # each once


def test_a_streamed_reply_is_the_answers_text_and_continues_its_sample(chat_policy):
    _, tokenizer = chat_policy
    pm, backend = scripted_pm(tokenizer, lambda text: "héllo wörld. Bye 字")
    got = {}

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": "hi"}]
        plain = api.chat.completions.create(model="policy", messages=messages)
        chunks = list(api.chat.completions.create(model="policy", messages=messages,
                                                  stream=True, logprobs=True))  # fmt: skip
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got["texts"] = (plain.choices[0].message.content, streamed)
        got["logprobs"] = sum(len(c.choices[0].logprobs.content) for c in chunks
                              if c.choices and c.choices[0].logprobs)  # fmt: skip
        api.chat.completions.create(model="policy", messages=[
            *messages, {"role": "assistant", "content": streamed}, {"role": "user", "content": "x"}
        ])  # fmt: skip

    batch, metrics = run(tokenizer, pm, agent, ROWS[:1], seeds=None, width=64)
    assert got["texts"] == ("héllo wörld. Bye 字", "héllo wörld. Bye 字")
    first = next(iter(backend.outputs.values()))[0]
    assert got["logprobs"] == len(first)  # one log-prob per sampled token, <|im_end|> too
    # the streamed text, sent back, continued the (second, repeated-request) sample
    assert batch.size == 2 and metrics["env/agent/branches"] == 1.0
    assert assert_each_trained_run_was_sampled_there(batch, backend) == 3 * len(first)


def test_a_call_offering_other_tools_is_a_branch(chat_policy):
    _, tokenizer = chat_policy
    pm, backend = scripted_pm(tokenizer, lambda text: "ok")
    search = {"type": "function", "function": {"name": "search", "parameters": {}}}

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": "hi"}]
        reply = api.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        follow = [*messages, reply.choices[0].message.model_dump(exclude_none=True),
                  {"role": "user", "content": "more"}]  # fmt: skip
        api.chat.completions.create(model="policy", messages=follow, tools=[CALCULATOR, search])

    batch, metrics = run(tokenizer, pm, agent, ROWS[:1], seeds=None, width=16)
    assert batch.size == 2 and metrics["env/agent/branches"] == 1.0
    prompts = [tokenizer.decode(batch.prompt_ids[r][batch.prompt_mask[r].bool()]) for r in (0, 1)]
    assert sum('"search"' in p for p in prompts) == 1  # the branch's prompt lists the new tool
    assert_each_trained_run_was_sampled_there(batch, backend)


def test_a_refused_call_leaves_nothing_and_n_choices_share_the_token_budget(chat_policy):
    _, tokenizer = chat_policy
    pm, _ = scripted_pm(tokenizer, lambda text: "a long reply of many many words " * 3)
    statuses = []

    def agent(task, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": "hi"}]
        api.chat.completions.create(model="policy", messages=messages, n=3)
        try:
            api.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as exc:
            statuses.append((exc.status_code, exc.code))

    batch, metrics = run(tokenizer, pm, agent, ROWS[:1], seeds=None, width=64,
                         max_sampled_tokens=9)  # fmt: skip
    assert statuses == [(400, "context_length_exceeded")]
    assert metrics["env/agent/sampled_tokens"] == 9 and batch.size == 3  # 3 tokens a choice
    assert all(int(batch.response_mask[r].sum()) == 3 for r in range(3))  # none empty
    assert metrics["env/truncated_frac"] == 1.0


def test_requests_that_break_the_models_or_the_template_get_400(chat_policy):
    import copy

    from .bpe_chat import TOOL_TEMPLATE

    _, tokenizer = chat_policy
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{%- for m in messages %}{%- if loop.index0 > 0 and m.role == 'user' and "
        "messages[loop.index0 - 1].role == 'user' %}"
        "{{- raise_exception('roles must alternate') }}{%- endif %}{%- endfor %}" + TOOL_TEMPLATE
    )
    pm, _ = scripted_pm(strict, lambda text: "ok")
    codes = {}

    def agent(task, base_url, key):
        auth = {"Authorization": f"Bearer {key}"}
        user = {"role": "user", "content": "hi"}
        bodies = {
            "call without a function object": {"messages": [user, {"role": "assistant",
                "tool_calls": [{"function": "x"}]}, user]},
            "tool without a function object": {"messages": [user], "tools": [{"function": "x"}]},
            "number past the digit limit": '{"messages": [], "n": ' + "1" * 5000 + "}",
            "roles the template refuses": {"messages": [user, user]},
            "nested arguments": {"messages": [user, {"role": "assistant", "tool_calls": [
                {"function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
                {"role": "tool", "content": "1"}]},
        }  # fmt: skip
        with httpx.Client(base_url=base_url, headers=auth) as http:
            for name, body in bodies.items():
                text = body if isinstance(body, str) else json.dumps(body)
                response = http.post("/chat/completions", content=text)
                codes[name] = (response.status_code, response.json()["error"]["code"]
                               if response.status_code >= 400 else None)  # fmt: skip

    run(strict, pm, agent, ROWS[:1], seeds=None)
    assert codes == {
        "call without a function object": (400, "invalid_request"),
        "tool without a function object": (400, "invalid_request"),
        "number past the digit limit": (400, "invalid_json"),
        "roles the template refuses": (400, "invalid_messages"),
        "nested arguments": (200, None),  # arguments it cannot read are kept as written
    }


def test_a_failing_backend_fails_the_step_without_stalling_it(chat_policy):
    _, tokenizer = chat_policy

    class Broken:
        kind = "backend"

        @hookimpl
        def generate_ids(self, contexts, sampling, seeds, stop_token_ids):
            raise MemoryError("out of memory in the engine")

    def agent(task, base_url, key):
        client(base_url, key).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )

    with pytest.raises(MemoryError, match="out of memory"):
        run(tokenizer, build_plugin_manager([Broken()]), agent, ROWS, seeds=None)


def test_a_function_agent_that_never_returns_times_out_in_a_daemon_thread(chat_policy):
    import threading
    import time

    _, tokenizer = chat_policy
    pm, _ = scripted_pm(tokenizer, lambda text: "ok")
    release = threading.Event()

    def agent(task, base_url, key):
        client(base_url, key).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
        release.wait(600)  # hangs past the time limit

    started = time.monotonic()
    batch, metrics = run(tokenizer, pm, agent, ROWS[:1], seeds=None, time_limit_s=1.0)
    assert metrics["env/timeout_frac"] == 1.0 and batch.size == 0
    assert time.monotonic() - started < 30
    hung = [t for t in threading.enumerate() if t.name == "alignzoo-agent"]
    assert hung and all(t.daemon for t in hung)  # never holds up the interpreter's exit
    release.set()
