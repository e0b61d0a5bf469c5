"""The environment contract suite (``alignzoo check environment NAME``).

An environment (kind ``environment``, :mod:`alignzoo.hookspecs`: ``env_reset``, ``env_step``,
``env_close``) is driven here as the engine drives it, on rows of the data it will see and on
turns drawn by hypothesis (any text, well-formed and malformed tool calls), and must:

- ``reset``: return an :class:`~alignzoo.rollout.episode.EpisodeStart` whose messages are
  ``{"role", "content"}`` dicts and whose tools, if any, are function schemas; the same row and
  seed give the same start (unless the class says ``deterministic = False``).
- ``step``: answer any turn with a :class:`~alignzoo.rollout.episode.StepResult` (messages of
  the same shape, a finite reward or None) and never raise, also for malformed tool calls; an
  episode that is not done has something to say back.
- ``episodes_independent``: two episodes run interleaved give what each gives alone (no state
  shared between episodes through the component).
- ``close``: ``env_close`` after any of this does not raise.

An ``agent`` environment (a program per episode behind the gateway, no hooks of its own) is
checked as the engine runs it instead, against a tiny untrained embedded policy on the hf
backend (its text is noise: an agent must survive any reply):

- ``agent_runs``: each of two episodes per row starts the program, which calls the gateway and
  ends within its time limit (done, or truncated by the token budget);
- ``agent_recorded``: every run of trained tokens in the batch is (the start of) a reply the
  backend sampled, and no more tokens are trained than were sampled.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from alignzoo.plugin import hookimpl
from alignzoo.registry import build_plugin_manager
from alignzoo.rollout.episode import EpisodeStart, StepResult, ToolCall, Turn
from alignzoo.testing.contract import (
    CheckResult,
    ContractViolation,
    build_for_check,
    component_factory,
    run_property,
)

CHECKS = ("instantiate", "reset", "step", "episodes_independent", "close")
DEFAULT_ROW: dict[str, Any] = {"prompt": "What is 17 + 25?", "answer": "42"}


def _run(value: Any) -> Any:
    """The value of a hook call, awaited when the implementation is ``async def``."""
    if inspect.isawaitable(value):

        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list):
        raise ContractViolation(f"{where}: messages must be a list, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ContractViolation(
                f"{where}: message {i} must be a dict with 'role' and 'content', got {m!r:.80}"
            )


def _turns() -> st.SearchStrategy[Turn]:
    """Turns as a model might write them: text, tool calls (known or not), malformed calls."""
    names = st.sampled_from(["add", "search", "calculator", "x", ""])
    arguments = st.dictionaries(
        st.text(min_size=1, max_size=5), st.one_of(st.integers(), st.text(max_size=8)), max_size=3
    )
    calls = st.lists(st.builds(ToolCall, names, arguments), max_size=3).map(tuple)
    errors = st.lists(st.sampled_from(["tool call is not valid JSON", "no 'name'"]), max_size=2)
    return st.builds(Turn, st.text(max_size=60), calls, errors.map(tuple), st.integers(0, 3))


def check_environment(
    environment: Any,
    params: Any = None,
    max_examples: int = 25,
    shrink_seconds: float = 10.0,
    rows: list[dict[str, Any]] | None = None,
) -> list[CheckResult]:
    """The environment contract suite (see the module docstring) on ``rows`` (default: one
    arithmetic row)."""
    label, factory = component_factory("environment", environment, params)
    instance = build_for_check(label, factory, "environment")
    if isinstance(instance, CheckResult):
        return [instance, *[CheckResult(n, False, "not run: did not build") for n in CHECKS[1:]]]
    if hasattr(instance, "agent_settings"):
        return [CheckResult("instantiate", True, label), *check_agent(instance, rows)]
    hook = build_plugin_manager([instance]).hook
    samples = rows or [DEFAULT_ROW]
    deterministic = getattr(type(instance), "deterministic", True)
    results = [CheckResult("instantiate", True, label)]

    def reset(row: dict[str, Any], seed: int) -> EpisodeStart:
        start = _run(hook.env_reset(row=copy.deepcopy(row), seed=seed))
        if not isinstance(start, EpisodeStart):
            raise ContractViolation(f"env_reset returned {type(start).__name__}, not EpisodeStart")
        _check_messages(start.messages, "env_reset")
        for tool in start.tools or []:
            if not isinstance(tool, dict) or "function" not in tool:
                raise ContractViolation(
                    f"env_reset: a tool schema must have 'function': {tool!r:.80}"
                )
        return start

    def step(state: Any, turn: Turn) -> StepResult:
        try:
            result = _run(hook.env_step(state=state, turn=turn))
        except Exception as exc:
            raise ContractViolation(
                f"env_step raised {type(exc).__name__}: {exc} (answer a bad turn, do not raise)"
            ) from None
        if not isinstance(result, StepResult):
            raise ContractViolation(f"env_step returned {type(result).__name__}, not StepResult")
        _check_messages(result.messages, "env_step")
        if result.reward is not None and not math.isfinite(float(result.reward)):
            raise ContractViolation(f"env_step returned a non-finite reward {result.reward!r}")
        if not result.done and not result.messages:
            raise ContractViolation("env_step: an episode that is not done must answer the turn")
        return result

    def close(state: Any) -> None:
        try:
            _run(hook.env_close(state=state))
        except Exception as exc:
            raise ContractViolation(f"env_close raised {type(exc).__name__}: {exc}") from None

    def prop_reset(seed: int) -> None:
        for row in samples:
            first = reset(row, seed)
            if deterministic:
                again = reset(row, seed)
                if (first.messages, first.tools) != (again.messages, again.tools):
                    raise ContractViolation(
                        "the same row and seed gave two different starts (declare "
                        "deterministic = False if that is intended)"
                    )
                close(again.state)
            close(first.state)

    def prop_step(example: tuple[int, list[Turn]]) -> None:
        seed, turns = example
        for row in samples:
            start = reset(row, seed)
            try:
                for turn in turns:
                    if step(start.state, turn).done:
                        break
            finally:
                close(start.state)

    def transcript(row: dict[str, Any], seed: int, turns: list[Turn]) -> list[Any]:
        start = reset(row, seed)
        out: list[Any] = [start.messages]
        for turn in turns:
            result = step(start.state, turn)
            out.append((result.messages, result.reward, result.done))
            if result.done:
                break
        close(start.state)
        return out

    def prop_independent(example: tuple[int, list[Turn]]) -> None:
        if not deterministic:
            return
        seed, turns = example
        row = samples[0]
        alone = transcript(row, seed, turns)
        a, b = reset(row, seed), reset(row, seed + 1)
        together: list[Any] = [a.messages]
        for turn in turns:
            first = step(a.state, turn)
            together.append((first.messages, first.reward, first.done))
            step(b.state, turn)  # the other episode moves in between
            if first.done:
                break
        close(a.state)
        close(b.state)
        if together != alone:
            raise ContractViolation(
                "an episode run beside another gave other answers than alone: state is shared "
                "between episodes (keep it in the state env_reset returns)"
            )

    seeds = st.integers(0, 2**31 - 1)
    episodes = st.tuples(seeds, st.lists(_turns(), min_size=1, max_size=4))
    legend = "example = (seed, the model's turns)"
    checks: list[tuple[str, Any, Callable[[Any], None], str]] = [
        ("reset", seeds, prop_reset, "example = the episode's seed"),
        ("step", episodes, prop_step, legend),
        ("episodes_independent", episodes, prop_independent, legend),
    ]
    for name, strategy, prop, what in checks:
        results.append(run_property(name, strategy, prop, max_examples, shrink_seconds, what))
    closing = all(r.passed for r in results)
    results.append(
        CheckResult("close", closing, "env_close called after every episode above")
        if closing
        else CheckResult("close", False, "not judged: an earlier check failed")
    )
    return results


def check_agent(environment: Any, rows: list[dict[str, Any]] | None = None) -> list[CheckResult]:
    """The agent checks (see the module docstring) of an ``agent`` environment instance."""
    from types import SimpleNamespace

    from alignzoo.config.schema import EmbeddedModelConfig, EpisodeConfig
    from alignzoo.rollout.agents import FAILURES, AgentEpisodes
    from alignzoo.types import SamplingParams
    from alignzoo.world.model import build_model
    from alignzoo.world.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tiny = EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model = build_model(tiny, tokenizer)
    _, make_backend = component_factory("backend", "hf")  # the registered hf backend
    backend = make_backend()
    backend.on_run_start(SimpleNamespace(tokenizer=tokenizer, device=lambda r: "cpu", actor=model))
    sampled: list[list[int]] = []

    class Counting:
        kind = "backend"

        @hookimpl
        def generate_ids(self, contexts, sampling, seeds, stop_token_ids):  # type: ignore[no-untyped-def]
            out = backend.generate_ids(contexts, sampling, seeds, stop_token_ids)
            sampled.extend(list(ids) for ids, _ in out)
            return out

    samples = rows or [DEFAULT_ROW]
    runner = AgentEpisodes(
        EpisodeConfig(codec="brackets", max_tokens=256, on_failure="keep"),
        tokenizer,
        environment.agent_settings(),
        None,
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    prompts = [str(r.get("prompt", "")) for r in samples]
    try:
        batch, metrics = runner.run(
            build_plugin_manager([Counting()]), prompts, samples, 2, sampling, [0] * len(samples)
        )
    except Exception as exc:
        why = f"the episodes raised {type(exc).__name__}: {exc}"
        return [CheckResult("agent_runs", False, why), CheckResult("agent_recorded", False, why)]
    ends = runner.last_outcomes
    failed = [(outcome, reason) for outcome, reason in ends if outcome in FAILURES]
    if failed:
        outcome, reason = failed[0]
        detail = f"{len(failed)} of {len(ends)} episodes failed; the first {outcome}: {reason}"
        runs = CheckResult("agent_runs", False, detail)
    else:
        calls = metrics["env/agent/calls"]
        runs = CheckResult("agent_runs", True, f"{len(ends)} episodes, {calls:g} calls each")
    trained, foreign = 0, 0
    for row in range(batch.size):
        mask = batch.response_mask[row].tolist()
        ids = batch.response_ids[row].tolist()
        run: list[int] = []
        for token, flag in [*zip(ids, mask, strict=True), (None, 0.0)]:
            if flag:
                run.append(token)
                continue
            if run:
                trained += len(run)
                if not any(reply[: len(run)] == run for reply in sampled):
                    foreign += 1
                run = []
    total = sum(len(reply) for reply in sampled)
    if foreign or trained > total:
        recorded = CheckResult(
            "agent_recorded",
            False,
            f"{foreign} trained runs the backend did not sample; {trained} trained tokens "
            f"for {total} sampled",
        )
    else:
        recorded = CheckResult(
            "agent_recorded", True, f"{trained} trained tokens, each sampled by the backend"
        )
    return [runs, recorded]
