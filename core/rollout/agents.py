"""Agents outside the process as episodes: a program per episode, calling the policy through
an OpenAI-compatible gateway, every call recorded token for token.

An arm whose environment is ``agent`` (:mod:`alignzoo.plugins.environments.agent`) runs each
episode as a program of its own (a command, or a Python function): it gets the row as its
task (``ALIGNZOO_TASK`` and stdin), an ``OPENAI_BASE_URL`` on 127.0.0.1 and an
``OPENAI_API_KEY`` that is this episode's alone, and talks to the policy as it would to the
OpenAI API (:mod:`alignzoo.rollout.gateway`). The episode ends when the program exits or at its
time limit.

Every call is recorded as it was sampled: the rendered prompt's token ids, the sampled ids and
their log-probs, and the policy version. The calls of an episode become *trajectories* (one
sample each in the batch):

- A call that continues an earlier one (its messages are that call's messages, the reply the
  gateway gave, then new messages: tool results, a user turn) is appended to the same
  trajectory. The ids between are the text the chat template puts after the reply (rendered as
  for in-process episodes, checked to be append-only), tokenised once: the reply's own ids are
  kept as sampled, never re-tokenised from the text the agent sent back.
- A call whose rendered prompt extends a trajectory's ids token for token is appended too.
- Any other call starts a new *branch* (the template rewrote history, the agent edited or
  dropped messages, a sub-agent's conversation): a trajectory of its own, whose prompt is the
  call's rendered messages; earlier replies in it are context, not trained tokens. A call that
  repeats an earlier request (a retry, another sample) forks that trajectory there, its copied
  tokens context too. Every sampled token is trained once.

Each trajectory's tokens the model sampled are trained (``response_mask`` 1), the rest is
context, as for in-process episodes. The labeler scores each sample of an episode on the
episode's final transcript (the last call's messages and the reply): ``responses`` is the last
assistant message, ``extra["messages"]`` the transcript, ``extra["episode"]["reward"]`` the
reward the agent posted to ``/v1/reward`` (the ``episode_reward`` labeler's), and
``extra["agent"]`` its exit code, calls, branch and the tail of its output.

Outcomes: ``done`` (the program exited 0 after at least one call), ``truncated`` (the
trajectory's token budget, ``episodes.max_tokens``, or the episode's ``max_sampled_tokens``
ran out), ``error`` (it exited non-zero, or crashed), ``timeout`` (its time limit: the process
group is killed), ``calls_limit`` (more calls than ``max_calls``: killed), ``no_calls`` (it
exited without calling). The last four are failures, which ``episodes.on_failure`` decides
about; none of them stalls the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from jinja2 import TemplateError

from alignzoo.errors import UserError
from alignzoo.rollout import partial
from alignzoo.rollout.gateway import ChatRequest, Choice, Completion, Refused, gateway_server
from alignzoo.rollout.multiturn import (
    ChatRenderer,
    Episode,
    Episodes,
    cancel_the_rest,
    derive_seed,
    episode_slots,
)

if TYPE_CHECKING:
    from alignzoo.batch import RolloutBatch
    from alignzoo.config.schema import EpisodeConfig
    from alignzoo.types import SamplingParams

AGENT_OUTCOMES = ("done", "truncated", "error", "timeout", "calls_limit", "no_calls")
"""How an agent episode ended (see the module docstring)."""
FAILURES = frozenset({"error", "timeout", "calls_limit", "no_calls"})
_TAIL = 2000  # characters of an agent's stdout / stderr kept with its samples


@dataclass(frozen=True)
class AgentSettings:
    """How episodes' agents run: a command or a function, their limits and concurrency."""

    command: list[str] | None = None
    function: Any = None  # fn(task, base_url, api_key), sync or async
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    time_limit_s: float = 60.0
    max_calls: int = 32
    max_sampled_tokens: int | None = None
    concurrency: int = 16
    batch_wait_s: float = 0.02


@dataclass
class _Point:
    """A call recorded in a trajectory: its request's messages (normalised), the messages an
    agent continuing it sends (request + reply), and where its reply sits in the ids."""

    request: list[Any]
    expect: list[Any]
    before: int  # len(ids) when the reply began
    after: int  # len(ids) after the reply
    sampled: str  # the reply as sampled, special tokens included (for the text after it)
    tools: str  # the tools the call offered (canonical JSON): a call offering others differs


@dataclass
class _Trajectory:
    sample: Episode
    points: list[_Point] = field(default_factory=list)
    tools: Any = None


@dataclass
class _Plan:
    """Where a call goes: onto ``trajectory`` (a fork of its first ``fork_at`` response ids
    when set; a trajectory not yet recorded when ``new``), sampling from ``context``;
    ``placed``: the trajectory's length when the call was placed."""

    trajectory: _Trajectory
    context: list[int]
    fork_at: int | None = None
    new: bool = False
    placed: int = 0


@dataclass
class _Reply:
    """A sampled reply as read: ids and log-probs (cut at a stop string), text, what each
    token adds to the text (for streaming), tool calls, finish reason."""

    ids: list[int]
    logprobs: list[float]
    text: str
    deltas: list[str]
    calls: tuple[Any, ...]
    finish: str


@dataclass
class AgentEpisode:
    """One agent's episode: its key, trajectories, calls and outcome."""

    row: dict[str, Any]
    seed: int
    group: int
    key: str = field(default_factory=lambda: f"az-{secrets.token_urlsafe(24)}")
    trajectories: list[_Trajectory] = field(default_factory=list)
    calls: int = 0
    sampled_tokens: int = 0
    refused: int = 0
    reward: float | None = None
    outcome: str = ""
    reason: str = ""
    started: float = 0.0
    wall_s: float = 0.0
    exit_code: int | None = None
    output: str = ""
    closed: bool = False
    final: list[dict[str, Any]] = field(default_factory=list)  # the last call's transcript
    process: subprocess.Popen[bytes] | None = None

    def end(self, outcome: str, reason: str = "") -> None:
        if not self.outcome:
            self.outcome, self.reason = outcome, reason


def _text(content: Any) -> str:
    """A message's content as text (a list of parts: their text joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content if isinstance(p, dict)]
    return "".join(str(p) for p in parts)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):  # not JSON (or too deep to read): as written
            return value
    return value


def _calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        calls.append((str(function.get("name", "")), _arguments(function.get("arguments", {}))))
    return calls


def normalised(message: dict[str, Any]) -> str:
    """What two messages must share to be the same message: role, text and tool calls (ids and
    other fields aside), as a canonical string."""
    role = message.get("role")
    role = "system" if role == "developer" else role
    text = _text(message.get("content")).strip()
    return json.dumps([role, text, _calls_of(message)], sort_keys=True, default=str)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages as Hugging Face chat templates take them: text content, tool-call
    arguments as objects, ``developer`` as ``system``."""
    out = []
    for message in messages:
        role = message.get("role")
        item: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text(message.get("content")),
        }
        calls = _calls_of(message)
        if calls:
            item["tool_calls"] = [
                {"type": "function", "function": {"name": name, "arguments": args}}
                for name, args in calls
            ]
        if message.get("name"):
            item["name"] = message["name"]
        out.append(item)
    return out


@dataclass
class _Pending:
    episode: AgentEpisode
    contexts: list[list[int]]
    width: int
    seeds: list[int] | None
    done: asyncio.Future[tuple[list[tuple[list[int], list[float]]], int | None]]


class AgentEpisodes(Episodes):
    """The episode runner of an arm whose environment is an agent program (see the module
    docstring); the same ``run`` as in-process episodes."""

    def __init__(
        self, cfg: EpisodeConfig, tokenizer: Any, agent: AgentSettings, context_limit: int | None
    ) -> None:
        super().__init__(cfg, tokenizer)
        self.agent, self.context_limit = agent, context_limit
        self.last_outcomes: list[tuple[str, str]] = []  # the last run's (outcome, reason)s

    def run(
        self,
        pm: Any,
        prompts: list[str],
        extras: list[dict[str, Any]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int] | None,
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """``n`` agent episodes per prompt; the batch (every kept trajectory, grouped by
        prompt) and the step's ``env/*`` metrics."""
        episodes = [
            AgentEpisode(row=row, seed=seed, group=group)
            for row, seed, group in episode_slots(prompts, extras, n, seeds)
        ]
        step = _Step(self, pm, sampling, seeds is None, episodes)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(step.serve())
        finally:
            step.kill_all()
            loop.run_until_complete(cancel_the_rest())
            loop.close()
        if step.engine_error is not None:  # as an in-process episode's generate_ids would
            raise step.engine_error
        self.last_outcomes = [(e.outcome, e.reason) for e in episodes]
        samples, kept = self._samples(episodes)
        return self._batch(samples, kept), self._agent_metrics(episodes, samples, kept, step)

    def _samples(self, episodes: list[AgentEpisode]) -> tuple[list[Episode], list[int]]:
        """Every trajectory as a sample, and the indices of those kept (``on_failure``)."""
        samples: list[Episode] = []
        failed_groups = {e.group for e in episodes if e.outcome in FAILURES}
        kept: list[int] = []
        for episode in episodes:
            for branch, trajectory in enumerate(episode.trajectories):
                sample = trajectory.sample
                sample.outcome, sample.reason = episode.outcome, episode.reason
                sample.reward, sample.turns = episode.reward, len(trajectory.points)
                sample.messages = episode.final or sample.messages
                sample.annotations["agent"] = {
                    "exit_code": episode.exit_code,
                    "calls": episode.calls,
                    "branch": branch,
                    "branches": len(episode.trajectories),
                    "wall_s": round(episode.wall_s, 3),
                    "output": episode.output,
                }
                failed = episode.outcome in FAILURES
                policy = self.cfg.on_failure
                keep = (
                    policy == "keep"
                    or (policy == "drop_sample" and not failed)
                    or (policy == "drop_group" and episode.group not in failed_groups)
                )
                if keep and any(sample.trained):  # a sample holds a sampled token at least
                    kept.append(len(samples))
                samples.append(sample)
        return samples, kept

    def _agent_metrics(
        self, episodes: list[AgentEpisode], samples: list[Episode], kept: list[int], step: _Step
    ) -> dict[str, float]:
        total = max(len(episodes), 1)
        m: dict[str, float] = {
            "env/episodes": float(len(episodes)),
            "env/samples": float(len(samples)),
            "env/kept_frac": len(kept) / max(len(samples), 1),
            "env/agent/calls": sum(e.calls for e in episodes) / total,
            "env/agent/branches": sum(max(len(e.trajectories) - 1, 0) for e in episodes) / total,
            "env/agent/wall_s": sum(e.wall_s for e in episodes) / total,
            "env/agent/sampled_tokens": sum(e.sampled_tokens for e in episodes) / total,
            "env/agent/refused": sum(e.refused for e in episodes) / total,
            "env/agent/unknown_key_requests": float(step.unknown_keys),
        }
        for outcome in AGENT_OUTCOMES:
            m[f"env/{outcome}_frac"] = sum(e.outcome == outcome for e in episodes) / total
        tokens = sum(len(s.ids) for s in samples)
        if tokens:
            m["env/trained_token_frac"] = sum(sum(s.trained) for s in samples) / tokens
        rewards = [e.reward for e in episodes if e.reward is not None]
        if rewards:
            m["env/reward_mean"] = float(np.mean(rewards))
        return m


class _Step:
    """One ``run``: the gateway, the agents and the batched sampling of their calls."""

    def __init__(
        self,
        runner: AgentEpisodes,
        pm: Any,
        sampling: SamplingParams,
        unseeded: bool,
        episodes: list[AgentEpisode],
    ) -> None:
        self.runner, self.pm, self.sampling, self.unseeded = runner, pm, sampling, unseeded
        self.episodes = episodes
        self.by_key = {e.key: e for e in episodes}
        self.pending: list[_Pending] = []
        self.wake: asyncio.Event | None = None
        self.live = 0  # agents running now
        self.unknown_keys = 0
        self.base_url = ""
        self.engine_error: Exception | None = None  # the backend's failure, raised after the step
        # Sampling gets a thread of its own: agents blocked on their calls must never hold the
        # thread the sampling that answers them needs.
        self.engine = ThreadPoolExecutor(1, thread_name_prefix="alignzoo-gateway-sampling")

    # ------------------------------------------------------------------ the hub's side
    def episode_for(self, key: str) -> AgentEpisode | None:
        episode = self.by_key.get(key)
        return None if episode is None or episode.closed or not episode.started else episode

    def refused(self, episode: AgentEpisode | None, status: int, code: str) -> None:
        if episode is None:
            self.unknown_keys += 1
        else:
            episode.refused += 1

    def reward(self, episode: AgentEpisode, value: float) -> None:
        episode.reward = value

    async def complete(self, episode: AgentEpisode, request: ChatRequest) -> Completion:
        agent, cfg = self.runner.agent, self.runner.cfg
        if episode.outcome:
            raise Refused(409, "episode_over", f"the episode is over ({episode.outcome})")
        episode.calls += 1
        if episode.calls > agent.max_calls:
            episode.end("calls_limit", f"more than {agent.max_calls} calls")
            raise Refused(429, "calls_limit", f"this episode may make {agent.max_calls} calls")
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
        try:
            plan = self._place(episode, messages, tools)
        except (TemplateError, TypeError, ValueError) as exc:  # what the template refuses
            raise Refused(
                400, "invalid_messages", f"the chat template cannot render them: {exc}", "messages"
            ) from None
        context = plan.context
        room = cfg.max_tokens - (len(context) - len(plan.trajectory.sample.prompt_ids))
        width = min(self.sampling.max_new_tokens, request.token_cap() or 1 << 30, room)
        if agent.max_sampled_tokens is not None:  # shared by the request's n choices
            width = min(width, (agent.max_sampled_tokens - episode.sampled_tokens) // request.n)
        if self.runner.context_limit is not None:
            if len(context) >= self.runner.context_limit:
                raise Refused(
                    400,
                    "context_length_exceeded",
                    f"the prompt is {len(context)} tokens; the model's context is "
                    f"{self.runner.context_limit}",
                    "messages",
                )
            width = min(width, self.runner.context_limit - len(context))
        if width <= 0:
            episode.end("truncated", "the episode's token budget is spent")
            raise Refused(
                400, "context_length_exceeded", "the episode's token budget is spent", "messages"
            )
        seeds = None
        if not self.unseeded:
            seeds = [derive_seed(episode.seed, episode.calls, k, 11) for k in range(request.n)]
        loop = asyncio.get_running_loop()
        pending = _Pending(episode, [context] * request.n, width, seeds, loop.create_future())
        self.pending.append(pending)
        assert self.wake is not None
        self.wake.set()
        outputs, version = await pending.done
        if episode.closed or episode.outcome in FAILURES:
            raise Refused(409, "episode_over", f"the episode is over ({episode.outcome})")
        # Only now does the call change the record: a refused call leaves nothing behind.
        trajectory = self._settle(episode, plan)
        self._extend(trajectory, context)
        at = len(trajectory.sample.ids)
        choices = []
        for k, (ids, logprobs) in enumerate(outputs):
            # the first choice continues the trajectory, each other one is a fork of it
            target = trajectory if k == 0 else self._fork(episode, trajectory, at)
            reply = self._reply(request, ids[:width], logprobs)
            choices.append(self._record(episode, target, messages, tools, reply, version))
        if len(trajectory.sample.ids) >= cfg.max_tokens:
            episode.end("truncated", f"{cfg.max_tokens} tokens")
        return Completion(choices, prompt_tokens=len(context))

    # ------------------------------------------------------------------ placing a call
    def _place(self, episode: AgentEpisode, messages: list[dict[str, Any]], tools: Any) -> _Plan:
        """Where a call goes (the trajectory it continues, from which point, or a new one) and
        the token ids it samples from; nothing is changed until the call is answered."""
        runner = self.runner
        keys = [normalised(m) for m in messages]
        offered = _tools_key(tools)
        for trajectory in reversed(episode.trajectories):
            sample = trajectory.sample
            for point in reversed(trajectory.points):
                if point.tools != offered:  # other tools: another prompt than the sample's
                    continue
                if keys[: len(point.expect)] == point.expect:
                    if not self._append_only(messages, len(point.expect), tools):
                        break  # the template rewrote the history: a new branch
                    tail = template_messages(messages[len(point.expect) :])
                    try:
                        between = runner.renderer.between(point.sampled, tail, tools)
                    except UserError:  # a template that is not append-only: a new branch
                        break
                    base = sample.prompt_ids + sample.ids[: point.after]
                    fork = point.after if point.after != len(sample.ids) else None
                    context = base + runner._encode(between)
                    return _Plan(trajectory, context, fork, placed=len(sample.ids))
                if keys == point.request:  # the same request again: another sample of it
                    context = sample.prompt_ids + sample.ids[: point.before]
                    return _Plan(trajectory, context, point.before, placed=len(sample.ids))
        rendered = runner.renderer.start(template_messages(messages), tools)
        ids = runner._encode(rendered)
        if isinstance(runner.renderer, ChatRenderer):
            for trajectory in reversed(episode.trajectories):
                sample = trajectory.sample
                so_far = sample.prompt_ids + sample.ids
                same_tools = trajectory.points and trajectory.points[-1].tools == offered
                if same_tools and ids[: len(so_far)] == so_far:
                    return _Plan(trajectory, ids, placed=len(sample.ids))
        sample = Episode(row=episode.row, seed=episode.seed, group=episode.group)
        sample.prompt_ids, sample.prompt_text = ids, rendered
        return _Plan(_Trajectory(sample, tools=tools), list(ids), new=True)

    def _settle(self, episode: AgentEpisode, plan: _Plan) -> _Trajectory:
        """The trajectory an answered call is recorded on: the new one it starts, a fork at its
        point, or the one it continues (forked where it was placed if another call of the
        episode grew it in the meantime)."""
        if plan.new:
            episode.trajectories.append(plan.trajectory)
            return plan.trajectory
        if plan.fork_at is not None:
            return self._fork(episode, plan.trajectory, plan.fork_at)
        if len(plan.trajectory.sample.ids) != plan.placed:
            return self._fork(episode, plan.trajectory, plan.placed)
        return plan.trajectory

    def _append_only(self, messages: list[dict[str, Any]], kept: int, tools: Any) -> bool:
        """Whether the chat template renders the first ``kept`` messages (an earlier call and
        its reply) as the start of its text for all of ``messages``: false for a template
        that rewrites earlier turns once more follow (Qwen3's drops earlier ``<think>``
        blocks), whose later calls then sample from another history than the sample holds."""
        renderer = self.runner.renderer
        if not isinstance(renderer, ChatRenderer):
            return True  # plain text: each message's text stands as written
        before = renderer.render(template_messages(messages[:kept]), tools, generation=False)
        after = renderer.render(template_messages(messages), tools, generation=True)
        return after.startswith(before)

    def _fork(self, episode: AgentEpisode, trajectory: _Trajectory, at: int) -> _Trajectory:
        """A new trajectory with ``trajectory``'s first ``at`` response ids as context."""
        source = trajectory.sample
        sample = Episode(row=episode.row, seed=episode.seed, group=episode.group)
        sample.prompt_ids, sample.prompt_text = list(source.prompt_ids), source.prompt_text
        sample.ids = list(source.ids[:at])
        sample.trained = [0] * at
        sample.logprobs = [0.0] * at
        sample.versions = [-1] * at
        fork = _Trajectory(sample, tools=trajectory.tools)
        episode.trajectories.append(fork)
        return fork

    @staticmethod
    def _extend(trajectory: _Trajectory, context: list[int]) -> None:
        """Append the context ids a call adds after the trajectory's (the environment's)."""
        sample = trajectory.sample
        extra = context[len(sample.prompt_ids) + len(sample.ids) :]
        sample.ids += extra
        sample.trained += [0] * len(extra)
        sample.logprobs += [0.0] * len(extra)
        sample.versions += [-1] * len(extra)

    def _reply(self, request: ChatRequest, ids: list[int], logprobs: list[float]) -> _Reply:
        """A sampled reply read: cut after the token that completes a stop string, its text
        (and per token what it adds), its tool calls, its finish reason."""
        runner, tokenizer = self.runner, self.runner.tokenizer
        pieces = _increments(tokenizer, ids)
        text, stopped = "".join(pieces), False
        stops = request.stops()
        if stops:
            shown = ""
            for k, piece in enumerate(pieces):
                shown += piece
                found = [shown.find(stop) for stop in stops if stop in shown]
                if found:
                    ids, logprobs, pieces = ids[: k + 1], logprobs[: k + 1], pieces[: k + 1]
                    text, stopped = shown[: min(found)], True
                    break
        deltas, left = [], len(text)  # the pieces, clipped to the text (the stop string off)
        for piece in pieces:
            deltas.append(piece[: max(left, 0)])
            left -= len(piece)
        calls: tuple[Any, ...] = ()
        if request.tool_choice != "none":
            parsed = runner.codec.parse(text)
            offered = _tool_names([t.model_dump() for t in request.tools or []] or None)
            calls = tuple(c for c in parsed.calls if offered is None or c.name in offered)
            if len(calls) < len(parsed.calls) or (parsed.errors and not calls):
                calls = ()  # a call to no offered tool, or unreadable: the agent reads text
        eos = set(_eos_ids(tokenizer)) | set(runner.stop_ids)
        if calls:
            finish = "tool_calls"
        elif stopped or (ids and ids[-1] in eos):
            finish = "stop"
        else:
            finish = "length"
        return _Reply(list(ids), list(logprobs[: len(ids)]), text, deltas, calls, finish)

    def _record(
        self,
        episode: AgentEpisode,
        trajectory: _Trajectory,
        messages: list[dict[str, Any]],
        tools: Any,
        reply: _Reply,
        version: int | None,
    ) -> Choice:
        """Append a reply to its trajectory as sampled; the gateway's choice."""
        runner, tokenizer = self.runner, self.runner.tokenizer
        sample = trajectory.sample
        before = len(sample.ids)
        sample.ids += reply.ids
        sample.trained += [1] * len(reply.ids)
        sample.logprobs += reply.logprobs
        sample.versions += [-1 if version is None else version] * len(reply.ids)
        episode.sampled_tokens += len(reply.ids)
        calls = [
            {
                "id": f"call_{secrets.token_hex(8)}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in reply.calls
        ]
        content = runner.codec.prose(reply.text) if calls else reply.text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        keys = [normalised(m) for m in messages]
        sampled = str(tokenizer.decode(reply.ids, skip_special_tokens=False))
        trajectory.points.append(
            _Point(
                keys,
                [*keys, normalised(message)],
                before,
                len(sample.ids),
                sampled,
                _tools_key(tools),
            )
        )
        transcript = template_messages(messages)
        transcript.append(runner.codec.assistant_message(reply.text, reply.calls))
        sample.messages = transcript
        episode.final = transcript
        tokens = [str(tokenizer.decode([i], skip_special_tokens=False)) for i in reply.ids]
        return Choice(content, calls, reply.finish, tokens, reply.logprobs, reply.deltas)

    # ------------------------------------------------------------------ sampling
    async def _sampler(self) -> None:
        """Sample what the agents ask for, in batches: the calls that arrive within
        ``batch_wait_s`` of each other (or once every running agent waits) go together. When
        it stops, every call it has not answered is refused (none is left waiting)."""
        assert self.wake is not None
        wait = self.runner.agent.batch_wait_s
        batch: list[_Pending] = []
        try:
            while True:
                await self.wake.wait()
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline:
                    waiting = {id(p.episode) for p in self.pending}
                    if len(waiting) >= self.live:
                        break
                    await asyncio.sleep(0.002)
                self.wake.clear()
                batch, self.pending = self.pending, []
                if batch:
                    await self._sample(batch)
                batch = []
        finally:
            for item in [*batch, *self.pending]:
                _refuse(item, Refused(409, "episode_over", "the step is over"))

    async def _sample(self, batch: list[_Pending]) -> None:
        try:
            loop = asyncio.get_running_loop()
            outputs, version = await loop.run_in_executor(
                self.engine, contextvars.copy_context().run, self._generate, batch
            )
        except Exception as exc:  # the engine failed: its calls fail, and the run after the step
            self.engine_error = self.engine_error or exc
            for item in batch:
                item.episode.end("error", f"sampling raised {type(exc).__name__}: {exc}")
                _refuse(item, Refused(503, "engine_error", f"sampling failed: {exc}"))
            return
        start = 0
        for item in batch:
            part = outputs[start : start + len(item.contexts)]
            start += len(item.contexts)
            if not item.done.done():
                item.done.set_result((part, version))

    def _generate(
        self, batch: list[_Pending]
    ) -> tuple[list[tuple[list[int], list[float]]], int | None]:
        contexts = [c for item in batch for c in item.contexts]
        seeds = None
        if not self.unseeded:
            seeds = [s for item in batch for s in (item.seeds or [])]
        width = max(item.width for item in batch)
        sampling = self.sampling.model_copy(update={"max_new_tokens": max(width, 1)})
        version = partial.refresh()  # a partial rollout takes newer weights between calls
        outputs = self.pm.hook.generate_ids(
            contexts=contexts, sampling=sampling, seeds=seeds, stop_token_ids=self.runner.stop_ids
        )
        return list(outputs), version

    # ------------------------------------------------------------------ the agents
    async def serve(self) -> None:
        """Serve the gateway, run every episode's agent, and stop once they have all ended."""
        self.wake = asyncio.Event()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        server = gateway_server(self)
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        sampler = asyncio.create_task(self._sampler())
        try:
            while not server.started:
                if serving.done():
                    serving.result()
                    raise RuntimeError("the agent gateway did not start")
                await asyncio.sleep(0.005)
            slots = asyncio.Semaphore(self.runner.agent.concurrency)
            with tempfile.TemporaryDirectory(prefix="alignzoo-agents-") as scratch:
                await asyncio.gather(
                    *(
                        self._episode(e, slots, Path(scratch), i)
                        for i, e in enumerate(self.episodes)
                    )
                )
        finally:
            server.should_exit = True
            sampler.cancel()
            await asyncio.gather(serving, sampler, return_exceptions=True)
            listener.close()

    def _environment(self, episode: AgentEpisode, task: str) -> dict[str, str]:
        env = {**os.environ, **self.runner.agent.env}
        env.update(OPENAI_BASE_URL=self.base_url, OPENAI_API_KEY=episode.key, ALIGNZOO_TASK=task)
        return env

    async def _episode(
        self, episode: AgentEpisode, slots: asyncio.Semaphore, scratch: Path, index: int
    ) -> None:
        agent = self.runner.agent
        task = json.dumps(episode.row, default=str)
        async with slots:
            episode.started = time.monotonic()
            self.live += 1
            try:
                if agent.function is not None:
                    await self._call_function(episode, task)
                else:
                    await self._run_command(episode, task, scratch / f"{index}")
            finally:
                self.live -= 1
                episode.wall_s = time.monotonic() - episode.started
                episode.closed = True  # its key no longer opens the gateway
                for item in self.pending:
                    if item.episode is episode:
                        _refuse(item, Refused(409, "episode_over", "the episode is over"))

    async def _call_function(self, episode: AgentEpisode, task: str) -> None:
        agent = self.runner.agent
        fn = agent.function
        try:
            if inspect.iscoroutinefunction(fn):
                result = fn(json.loads(task), self.base_url, episode.key)
            else:  # a daemon thread of its own: one that never returns cannot hold the exit
                result = _in_daemon_thread(fn, json.loads(task), self.base_url, episode.key)
            output = await asyncio.wait_for(result, agent.time_limit_s)
            episode.output = "" if output is None else str(output)[-_TAIL:]
            episode.exit_code = 0
        except (asyncio.TimeoutError, TimeoutError):
            episode.end("timeout", f"the agent ran past {agent.time_limit_s:g}s")
        except Exception as exc:
            episode.exit_code = 1
            episode.end("error", f"the agent raised {type(exc).__name__}: {exc}"[:_TAIL])
        if episode.exit_code == 0:
            episode.end("done" if episode.calls else "no_calls")

    async def _run_command(self, episode: AgentEpisode, task: str, base: Path) -> None:
        agent = self.runner.agent
        command = list(agent.command or [])
        if command and command[0] in ("python", "python3"):
            command[0] = sys.executable  # the interpreter running alignzoo
        base.with_suffix(".task").write_text(task)
        with (
            open(base.with_suffix(".task"), "rb") as stdin,
            open(base.with_suffix(".out"), "wb+") as stdout,
        ):
            try:
                process = subprocess.Popen(
                    command,
                    stdin=stdin,
                    stdout=stdout,
                    stderr=subprocess.STDOUT,
                    env=self._environment(episode, task),
                    cwd=agent.cwd,
                    start_new_session=True,  # its own process group, killed whole at the end
                )
            except OSError as exc:
                episode.end("error", f"the agent did not start: {exc}")
                return
            episode.process = process
            deadline = episode.started + agent.time_limit_s
            while process.poll() is None:
                if time.monotonic() > deadline:
                    episode.end("timeout", f"the agent ran past {agent.time_limit_s:g}s")
                    break
                if episode.outcome in FAILURES:  # the gateway ended it (calls_limit)
                    break
                await asyncio.sleep(0.01)
            _kill_group(process)
            episode.exit_code = process.wait()
            stdout.seek(0, os.SEEK_END)
            size = stdout.tell()
            stdout.seek(max(size - _TAIL, 0))
            episode.output = stdout.read().decode(errors="replace")
        if episode.exit_code == 0:
            episode.end("done" if episode.calls else "no_calls")
        else:
            code = episode.exit_code
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            episode.end("error", f"the agent {how}: {episode.output[-300:]}")

    def kill_all(self) -> None:
        """Kill every agent still running (the run is ending, or failed) and wait for a
        generation in flight (a function agent's thread past its time limit runs on, a daemon
        that never holds up the exit)."""
        for episode in self.episodes:
            if episode.process is not None:
                _kill_group(episode.process)
        # a generation in flight finishes before the caller may touch the policy again
        self.engine.shutdown(wait=True, cancel_futures=True)


def _in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` in a daemon thread (with this context's variables); its result or error
    on the returned future of the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        result, error = None, None
        try:
            result = context.run(fn, *args)
        except Exception as exc:
            error = exc
        except BaseException as exc:  # SystemExit in an agent: its failure, not the run's
            error = RuntimeError(f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, daemon=True, name="alignzoo-agent").start()
    return future


def _refuse(item: _Pending, refusal: Refused) -> None:
    """Answer a waiting call with ``refusal`` (nothing when it is answered already)."""
    if not item.done.done():
        item.done.set_exception(refusal)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """Kill the process and everything it started (its process group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _tool_names(tools: Any) -> set[str] | None:
    """The names of the tools a request offers; None when it offers none (any name is read)."""
    if not tools:
        return None
    return {str(t.get("function", {}).get("name", "")) for t in tools if isinstance(t, dict)}


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def _increments(tokenizer: Any, ids: list[int]) -> list[str]:
    """Per sampled token, the text it adds to the reply: special tokens add none, and a token
    that ends inside a character adds nothing until the character is whole. Joined, they are
    the reply's text. Decoded in windows that restart after each newline (as transformers'
    streamers do), so a long reply costs about its length, not its square."""
    out: list[str] = []
    start, shown = 0, ""
    for end in range(1, len(ids) + 1):
        text = str(tokenizer.decode(ids[start:end], skip_special_tokens=True))
        if text.endswith("\ufffd") or not text.startswith(shown):
            out.append("")
            continue
        out.append(text[len(shown) :])
        shown = text
        if text.endswith("\n"):
            start, shown = end, ""
    return out


def _tools_key(tools: Any) -> str:
    """The tools a call offers, as canonical JSON (the same for the same tools)."""
    return json.dumps(tools or [], sort_keys=True, default=str)


def episode_runner(
    cfg: EpisodeConfig, environment: Any, tokenizer: Any, model_config: Any = None
) -> Episodes:
    """The episode runner of an arm with ``environment``: an agent program's (the gateway,
    :mod:`alignzoo.rollout.agents`) when the environment is one, else the in-process runner."""
    settings = getattr(environment, "agent_settings", None)
    if settings is None:
        return Episodes(cfg, tokenizer)
    limit = getattr(model_config, "max_position_embeddings", None)
    return AgentEpisodes(cfg, tokenizer, settings(), int(limit) if limit else None)
