"""Multi-turn episodes, token in and token out.

For each prompt row an arm with an ``environment`` runs ``n`` episodes: ``env_reset`` gives the
starting messages and tools, rendered once through the tokenizer's chat template; then, turn
after turn, the backend samples the model's turn from the token ids so far (``generate_ids``),
the codec reads its tool calls, ``env_step`` answers, and the answer is rendered as the text the
template puts between the model's turn and the next one, tokenised once and appended. Nothing
already generated is re-tokenised: the ids trained on are exactly the ids sampled, with the
environment's ids between them.

Rewards come from the arm's labeler, as for single-turn arms: it sees the last assistant
message as the response and the whole transcript in ``extra["messages"]``; the environment's
own rewards (summed over the episode) are in ``extra["episode"]["reward"]``, which the
``episode_reward`` labeler returns, alone or in a ``combine`` with others; each step's reward
is kept with the response index of the model's last token before it in
``extra["episode"]["step_rewards"]`` (``[index, reward]`` pairs: token rewards for an algorithm
that credits turns).

The batch an episode becomes: ``prompt_ids`` the rendered start, ``response_ids`` every later
token, ``response_mask`` 1 on the model's sampled tokens only (every loss, KL, entropy and
length metric then counts only those), ``response_attention`` 1 on every real token (the
environment's are context), ``rollout_logprobs`` the sampler's log-probs (0 elsewhere).

Limits (``episodes``): ``max_turns``, ``max_tokens`` (then the episode is *truncated*), and
timeouts per environment call and per episode. An environment that raises or times out gives
the episode the ``error`` / ``timeout`` outcome and ``episodes.on_failure`` decides (drop the
sample, drop its group, or keep it as it stands); it never stops the run, and every opened
episode is closed (``env_close``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from alignzoo.errors import UserError
from alignzoo.rollout import partial
from alignzoo.rollout.codecs import BracketCodec, Codec, codec_for
from alignzoo.rollout.episode import EpisodeStart, Message, StepResult, Turn

if TYPE_CHECKING:
    from alignzoo.batch import RolloutBatch
    from alignzoo.config.schema import EpisodeConfig
    from alignzoo.types import SamplingParams

OUTCOMES = ("done", "truncated", "error", "timeout")
"""How an episode ended: the environment said done, a limit cut it, the environment raised,
an environment call (or the episode) ran past its timeout."""
_PROBE = "\x00probe\x00"


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (an episode's from its row's seed and sample index)."""
    sequence = np.random.SeedSequence([abs(int(p)) for p in parts])
    return int(sequence.generate_state(1, np.uint64)[0] >> 1)


def episode_slots(
    prompts: list[str], extras: list[dict[str, Any]], n: int, seeds: list[int] | None
) -> list[tuple[dict[str, Any], int, int]]:
    """``(row, seed, group)`` of each of the ``n`` episodes per prompt: the row with its
    prompt, the episode's seed (from its prompt's seed and its index), the prompt's index."""
    return [
        ({**extra, "prompt": prompt}, derive_seed(seeds[i] if seeds is not None else i, j), i)
        for i, (prompt, extra) in enumerate(zip(prompts, extras, strict=True))
        for j in range(n)
    ]


@dataclass
class Episode:
    """One episode in flight: its token ids, masks, transcript and outcome."""

    row: dict[str, Any]
    seed: int
    group: int
    state: Any = None
    opened: bool = False
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    ids: list[int] = field(default_factory=list)  # the response part: model and environment
    trained: list[int] = field(default_factory=list)  # 1 on the model's sampled tokens
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version per token (-1: not sampled)
    turn_start: int = 0  # where the model's latest turn begins in ``ids``
    turn: Turn | None = None  # the model's latest turn, as env_step receives it
    turns: int = 0
    reward: float | None = None
    step_rewards: list[tuple[int, float]] = field(default_factory=list)  # (response index, reward)
    outcome: str = ""
    reason: str = ""
    started: float = field(default_factory=time.monotonic)
    metrics: dict[str, float] = field(default_factory=dict)
    annotations: dict[str, Any] = field(default_factory=dict)  # more of the sample's extra

    @property
    def active(self) -> bool:
        return not self.outcome

    def end(self, outcome: str, reason: str = "") -> None:
        if not self.outcome:
            self.outcome, self.reason = outcome, reason


class ChatRenderer:
    """Renders episodes through the tokenizer's chat template: the start, and the text between
    the model's turn and the next one (checked to be append-only)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "a tool-call codec that follows a chat template needs a tokenizer with one (its "
                "tokenizer_config.json 'chat_template'); for plain text without a template, "
                "as the embedded tokenizer writes it, set episodes.codec: brackets"
            )
        self.tokenizer = tokenizer

    def render(self, messages: list[Message], tools: Any, generation: bool) -> str:
        """The template's text of ``messages`` (with the next generation prompt if asked)."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=False
        )
        return str(text)

    def start(self, messages: list[Message], tools: Any) -> str:
        return self.render(messages, tools, generation=True)

    def between(self, turn_text: str, answer: list[Message], tools: Any) -> str:
        """The text after the model's turn (as it was sampled, special tokens included) up to
        the next assistant turn: what closes the model's message that it did not write, then
        the environment's messages and the next generation prompt."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
        before = self.render(probe, tools, generation=False)
        after = self.render([*probe, *answer], tools, generation=True)
        if not after.startswith(before):
            raise UserError(
                "the chat template is not append-only: rendering more messages changes the "
                "text of earlier ones, so multi-turn token ids cannot be kept as sampled"
            )
        closing = before[before.rindex(_PROBE) + len(_PROBE) :]
        written = next(
            (k for k in range(len(closing), 0, -1) if turn_text.endswith(closing[:k])), 0
        )
        return closing[written:] + after[len(before) :]

    def stop_ids(self) -> list[int]:
        """The token that closes an assistant message (``<|im_end|>``) when it is one special
        token: sampling a turn stops there."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
        before = self.render(probe, None, generation=False)
        closing = before[before.rindex(_PROBE) + len(_PROBE) :]
        ids = self.tokenizer(closing, add_special_tokens=False)["input_ids"]
        special = set(self.tokenizer.all_special_ids) | set(
            getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        )
        return [ids[0]] if ids and ids[0] in special else []


class PlainRenderer:
    """Renders episodes as plain text, for a tokenizer without a chat template: the start is
    the messages' contents (one per line), and the codec writes the environment's answers
    (``=408`` and a newline after ``[12*34]`` in the embedded world)."""

    def __init__(self, tokenizer: Any, codec: BracketCodec) -> None:
        self.tokenizer, self.codec = tokenizer, codec

    def start(self, messages: list[Message], tools: Any) -> str:
        return "\n".join(str(m.get("content", "")) for m in messages)

    def between(self, turn_text: str, answer: list[Message], tools: Any) -> str:
        return self.codec.plain_text(answer)

    def stop_ids(self) -> list[int]:
        """The codec's stop text (``]``) when it is one token: a turn that calls ends there."""
        ids = self.tokenizer(self.codec.stop_text(), add_special_tokens=False)["input_ids"]
        return list(ids) if len(ids) == 1 else []


@dataclass
class Episodes:
    """An arm's episode runner: its config, the policy's tokenizer, the codec and renderer."""

    cfg: EpisodeConfig
    tokenizer: Any
    codec: Codec = field(init=False)
    renderer: ChatRenderer | PlainRenderer = field(init=False)
    stop_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.codec = codec_for(self.tokenizer, self.cfg.codec)
        if isinstance(self.codec, BracketCodec):
            self.renderer = PlainRenderer(self.tokenizer, self.codec)
        else:
            self.renderer = ChatRenderer(self.tokenizer)
        self.stop_ids = self.renderer.stop_ids()  # rendered once, not per turn

    def run(
        self,
        pm: Any,
        prompts: list[str],
        extras: list[dict[str, Any]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int] | None,
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """``n`` episodes per prompt; the batch (grouped by prompt, failed episodes left out
        as ``on_failure`` says) and the step's ``env/*`` metrics."""
        episodes = [
            Episode(row=row, seed=seed, group=group)
            for row, seed, group in episode_slots(prompts, extras, n, seeds)
        ]
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._reset(pm, episodes))
            for turn in range(self.cfg.max_turns):
                live = [e for e in episodes if e.active]
                if not live:
                    break
                self._sample(pm, live, sampling, turn, seeds is None)
                loop.run_until_complete(self._step(pm, live, turn))
            for episode in episodes:
                episode.end("truncated", f"{self.cfg.max_turns} turns")
        finally:
            loop.run_until_complete(self._close(pm, episodes))
            # What an environment left running on the loop (a client's keep-alive, a call past
            # its timeout) is cancelled and awaited: nothing of this step outlives it.
            loop.run_until_complete(cancel_the_rest())
            loop.close()
        kept = self._kept(episodes)
        return self._batch(episodes, kept), self._metrics(episodes, kept)

    # ------------------------------------------------------------------ environment calls
    async def _call(self, episode: Episode, hook: Any, **kwargs: Any) -> Any:
        """One environment call with the step's timeout (and what is left of the episode's);
        a synchronous implementation runs in a worker thread so the others go on."""
        timeout = self.cfg.step_timeout_s
        if self.cfg.episode_timeout_s is not None:
            left = self.cfg.episode_timeout_s - (time.monotonic() - episode.started)
            timeout = min(timeout, max(left, 0.0))

        async def call() -> Any:
            implementations = hook.get_hookimpls()
            if implementations and all(
                inspect.iscoroutinefunction(impl.function) for impl in implementations
            ):
                result = hook(**kwargs)  # only creates the coroutines: nothing blocks here
            else:
                result = await asyncio.to_thread(hook, **kwargs)
            return await _settled(result)

        return await asyncio.wait_for(call(), timeout)

    async def _guarded(self, episode: Episode, hook: Any, what: str, **kwargs: Any) -> Any:
        try:
            return await self._call(episode, hook, **kwargs)
        except (asyncio.TimeoutError, TimeoutError):
            episode.end("timeout", f"{what} ran past its timeout")
        except Exception as exc:  # the environment's failure is the episode's outcome
            episode.end("error", f"{what} raised {type(exc).__name__}: {exc}")
        return None

    async def _reset(self, pm: Any, episodes: list[Episode]) -> None:
        async def one(episode: Episode) -> None:
            start = await self._guarded(
                episode, pm.hook.env_reset, "env_reset", row=episode.row, seed=episode.seed
            )
            if start is None:
                return
            if not isinstance(start, EpisodeStart):
                episode.end("error", f"env_reset returned {type(start).__name__}, not EpisodeStart")
                return
            episode.state, episode.opened = start.state, True
            episode.messages, episode.tools = list(start.messages), start.tools
            episode.prompt_text = self.renderer.start(episode.messages, episode.tools)
            episode.prompt_ids = self._encode(episode.prompt_text)

        await asyncio.gather(*(one(e) for e in episodes))

    async def _step(self, pm: Any, live: list[Episode], index: int) -> None:
        async def one(episode: Episode) -> None:
            if not episode.active or episode.turn is None:  # a limit ended it while sampling
                return
            turn = episode.turn
            result = await self._guarded(
                episode, pm.hook.env_step, "env_step", state=episode.state, turn=turn
            )
            if result is None:
                return
            if not isinstance(result, StepResult):
                episode.end("error", f"env_step returned {type(result).__name__}, not StepResult")
                return
            self._take(episode, result)

        await asyncio.gather(*(one(e) for e in live))

    async def _close(self, pm: Any, episodes: list[Episode]) -> None:
        async def one(episode: Episode) -> None:
            if episode.opened:
                try:
                    await self._call(episode, pm.hook.env_close, state=episode.state)
                except Exception:  # closing is best effort: counted, never raised
                    episode.metrics["close_failed"] = 1.0  # reported as env/close_failed

        await asyncio.gather(*(one(e) for e in episodes))

    # ------------------------------------------------------------------ tokens
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _sample(
        self,
        pm: Any,
        live: list[Episode],
        sampling: SamplingParams,
        turn: int,
        unseeded: bool,
    ) -> None:
        """Sample every live episode's next turn from its ids, in one backend call."""
        budget = [self.cfg.max_tokens - len(e.ids) for e in live]
        width = min(sampling.max_new_tokens, max(budget))
        turn_sampling = sampling.model_copy(update={"max_new_tokens": max(width, 1)})
        contexts = [e.prompt_ids + e.ids for e in live]
        seeds = None if unseeded else [derive_seed(e.seed, turn, 7) for e in live]
        # A partial rollout takes the trainer's newer weights between turns (None: no feed).
        version = partial.refresh()
        outputs = pm.hook.generate_ids(
            contexts=contexts,
            sampling=turn_sampling,
            seeds=seeds,
            stop_token_ids=self.stop_ids,
        )
        for episode, room, (ids, logprobs) in zip(live, budget, outputs, strict=True):
            ids, logprobs = list(ids[:room]), list(logprobs[:room])
            episode.ids += ids
            episode.trained += [1] * len(ids)
            episode.logprobs += logprobs
            episode.versions += [-1 if version is None else version] * len(ids)
            episode.turn_start = len(episode.ids) - len(ids)
            # The turn joins the transcript as sampled, also when the token limit cuts it (its
            # tokens are trained on, so its text is what the labeler sees).
            text = self._turn_text(episode)
            parsed = self.codec.parse(text)
            episode.turn = Turn(text, parsed.calls, parsed.errors, turn)
            episode.messages.append(self.codec.assistant_message(text, parsed.calls))
            episode.turns += 1
            if len(episode.ids) >= self.cfg.max_tokens:
                episode.end("truncated", f"{self.cfg.max_tokens} tokens")

    def _turn_text(self, episode: Episode) -> str:
        start = episode.turn_start
        return str(self.tokenizer.decode(episode.ids[start:], skip_special_tokens=True))

    def _take(self, episode: Episode, result: StepResult) -> None:
        """The environment's answer: reward, transcript and the ids between turns."""
        if result.reward is not None:
            episode.reward = (episode.reward or 0.0) + float(result.reward)
            # Where it was earned: after the model's last token so far (a token reward there).
            episode.step_rewards.append((len(episode.ids) - 1, float(result.reward)))
        for key, value in (result.info.get("metrics") or {}).items():
            if isinstance(value, (int, float)):
                episode.metrics[key] = episode.metrics.get(key, 0.0) + float(value)
        episode.messages += [dict(m) for m in result.messages]
        if result.done:
            episode.end("done")
            return
        start = episode.turn_start
        sampled = self.tokenizer.decode(episode.ids[start:], skip_special_tokens=False)
        between = self._encode(self.renderer.between(sampled, result.messages, episode.tools))
        room = self.cfg.max_tokens - len(episode.ids)
        episode.ids += between[:room]
        episode.trained += [0] * len(between[:room])
        episode.logprobs += [0.0] * len(between[:room])
        episode.versions += [-1] * len(between[:room])
        if len(between) >= room:
            episode.end("truncated", f"{self.cfg.max_tokens} tokens")

    # ------------------------------------------------------------------ the batch
    def _kept(self, episodes: list[Episode]) -> list[int]:
        failed = {e.outcome for e in episodes} & {"error", "timeout"}
        if not failed or self.cfg.on_failure == "keep":
            return [i for i, e in enumerate(episodes) if e.opened]
        if self.cfg.on_failure == "drop_group":
            bad = {e.group for e in episodes if e.outcome in ("error", "timeout")}
            return [i for i, e in enumerate(episodes) if e.group not in bad and e.opened]
        return [
            i for i, e in enumerate(episodes) if e.outcome not in ("error", "timeout") and e.opened
        ]

    def _batch(self, episodes: list[Episode], kept: list[int]) -> RolloutBatch:
        import torch

        from alignzoo.batch import RolloutBatch

        chosen = [episodes[i] for i in kept]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        prompt_width = max((len(e.prompt_ids) for e in chosen), default=0)
        width = max((len(e.ids) for e in chosen), default=0)
        rows = len(chosen)
        prompt_ids = torch.full((rows, prompt_width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
        response_ids = torch.full((rows, width), pad, dtype=torch.long)
        trained = torch.zeros((rows, width), dtype=torch.float32)
        attention = torch.zeros((rows, width), dtype=torch.long)
        logprobs = torch.zeros((rows, width), dtype=torch.float32)
        versions = torch.full((rows, width), -1, dtype=torch.long)
        for r, e in enumerate(chosen):
            p, k = len(e.prompt_ids), len(e.ids)
            if p:
                prompt_ids[r, prompt_width - p :] = torch.tensor(e.prompt_ids)
                prompt_mask[r, prompt_width - p :] = 1
            if k:
                response_ids[r, :k] = torch.tensor(e.ids)
                trained[r, :k] = torch.tensor(e.trained, dtype=torch.float32)
                attention[r, :k] = 1
                logprobs[r, :k] = torch.tensor(e.logprobs)
                versions[r, :k] = torch.tensor(e.versions, dtype=torch.long)
        groups = sorted({e.group for e in chosen})
        renumber = {g: i for i, g in enumerate(groups)}
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=trained,
            group_ids=torch.tensor([renumber[e.group] for e in chosen], dtype=torch.long),
            prompts=[e.prompt_text for e in chosen],
            responses=[_last_assistant(e.messages) for e in chosen],
            extras=[_extra(e) for e in chosen],
            rollout_logprobs=logprobs,
            response_attention=attention,
            # each turn's version when a partial rollout recorded them (else the engine's)
            token_versions=versions if partial.active() else None,
        )

    def _metrics(self, episodes: list[Episode], kept: list[int]) -> dict[str, float]:
        total = max(len(episodes), 1)
        m: dict[str, float] = {
            "env/episodes": float(len(episodes)),
            "env/turns": sum(e.turns for e in episodes) / total,
            "env/kept_frac": len(kept) / total,
        }
        for outcome in OUTCOMES:
            m[f"env/{outcome}_frac"] = sum(e.outcome == outcome for e in episodes) / total
        tokens = sum(len(e.ids) for e in episodes)
        if tokens:
            m["env/trained_token_frac"] = sum(sum(e.trained) for e in episodes) / tokens
        rewards = [e.reward for e in episodes if e.reward is not None]
        if rewards:
            m["env/reward_mean"] = float(np.mean(rewards))
        # The environment's own numbers (StepResult.info["metrics"], summed over an episode's
        # steps): their mean per episode, e.g. env/tool_calls, env/tool/add/errors.
        keys = sorted({k for e in episodes for k in e.metrics})
        for key in keys:
            m[f"env/{key}"] = float(np.mean([e.metrics.get(key, 0.0) for e in episodes]))
        return m


async def cancel_the_rest() -> None:
    """Cancel and await every other task of the running loop."""
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def _last_assistant(messages: list[Message]) -> str:
    """The content of the last assistant message (what the labeler scores as the response)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


def _extra(episode: Episode) -> dict[str, Any]:
    extra = {k: v for k, v in episode.row.items() if k != "prompt"}
    extra["messages"] = episode.messages
    extra["episode"] = {
        "outcome": episode.outcome,
        "reason": episode.reason,
        "turns": episode.turns,
        "reward": episode.reward,
        "step_rewards": [list(pair) for pair in episode.step_rewards],
    }
    extra.update(episode.annotations)
    return extra


async def _settled(result: Any) -> Any:
    """What a hook call gave, awaited: a ``firstresult`` hook gives one value, which an
    ``async def`` implementation makes a coroutine; any other hook gives a list of them."""
    if isinstance(result, list):
        return [await _settled(item) for item in result]
    return await result if inspect.isawaitable(result) else result
