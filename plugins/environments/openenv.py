"""Environment "openenv": an OpenEnv environment (the ``openenv`` extra), served or in process.

OpenEnv (``openenv-core``, used by TRL) defines environments as ``reset`` / ``step`` over
pydantic actions and observations that carry ``done`` and ``reward``, served over WebSocket by
``create_app``. This plugin plays one episode per OpenEnv session:

- ``url``: a running server (``http://127.0.0.1:8000``); each episode opens its own session
  (``GenericEnvClient``), so the server must allow concurrent sessions for a step's episodes
  (``max_concurrent_envs``);
- ``environment``: ``"module:Class"`` or ``"file.py:Class"`` of an ``Environment`` subclass, one
  instance per episode, in this process (no server).

The model's turn becomes the action: its text in ``action_field`` (``action_from: text``), or
the arguments of its first tool call (``action_from: tool_call``, for actions with several
fields; a turn without a call ends the episode). An observation becomes the next user message:
its ``observation_field``, or all its fields but ``done``, ``reward`` and ``metadata`` as JSON.
``reward`` is the step's reward, ``done`` ends the episode. A server that dies mid-episode, or
refuses an action, fails that episode (an ``error`` outcome, ``episodes.on_failure`` decides);
the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignzoo.config.callables import load_callable
from alignzoo.errors import UserError
from alignzoo.integrations import require
from alignzoo.plugin import Environment, hookimpl
from alignzoo.rollout.episode import EpisodeStart, StepResult, Turn

_HIDDEN = ("done", "reward", "metadata")


def _openenv() -> Any:
    return require("openenv.core", "openenv", "openenv environment")


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment: a server by URL or an Environment class in process."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        url: str | None = Field(None, description="A running OpenEnv server (or environment).")
        environment: str | None = Field(
            None, description="'module:Class' or 'file.py:Class' of an OpenEnv Environment."
        )
        action_from: Literal["text", "tool_call"] = Field(
            "text", description="The action: the turn's text, or its first tool call's arguments."
        )
        action_field: str = Field(
            "message", description="With action_from: text, the action field it fills."
        )
        observation_field: str | None = Field(
            None, description="The observation field shown to the model (default: all, as JSON)."
        )
        connect_timeout_s: float = Field(10.0, gt=0, description="Connecting to the server.")
        message_timeout_s: float = Field(60.0, gt=0, description="One reset or step on it.")

        @model_validator(mode="after")
        def _one_source(self) -> OpenEnvEnvironment.Params:
            if (self.url is None) == (self.environment is None):
                raise ValueError("give exactly one of url or environment")
            return self

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.core = _openenv()
        self.factory: Any = None
        if self.params.environment is not None:
            self.factory = load_callable(self.params.environment, "openenv environment")
            if not (
                inspect.isclass(self.factory) and issubclass(self.factory, self.core.Environment)
            ):
                raise UserError(
                    f"openenv environment: {self.params.environment} is not an OpenEnv "
                    "Environment subclass"
                )

    # ------------------------------------------------------------------ hooks
    @hookimpl
    async def env_reset(self, row: dict[str, Any], seed: int) -> EpisodeStart:
        seed = seed % 2**31
        state: dict[str, Any] = {"local": None, "client": None, "done": False}
        try:
            if self.factory is not None:
                # In a worker thread: a slow or hung environment holds its episode (and its
                # timeout applies), never the event loop the step's other episodes run on.
                state["local"] = local = self.factory()
                observation = await asyncio.to_thread(local.reset, seed=seed)
                fields, done = _fields(observation), observation.done
            else:
                state["client"] = client = self.core.GenericEnvClient(
                    base_url=self.params.url,
                    connect_timeout_s=self.params.connect_timeout_s,
                    message_timeout_s=self.params.message_timeout_s,
                )
                await client.connect()
                result = await client.reset(seed=seed)
                fields, done = dict(result.observation), result.done
            shown = self._show(fields)
        except BaseException:  # a session opened for a reset that failed is closed here
            await self.env_close(state)
            raise
        state["done"] = bool(done)
        prompt = str(row.get("prompt", "")).strip()
        content = f"{prompt}\n\n{shown}" if prompt else shown
        return EpisodeStart(state=state, messages=[{"role": "user", "content": content}])

    @hookimpl
    async def env_step(self, state: Any, turn: Turn) -> StepResult:
        action = self._action(turn)
        if action is None:  # action_from: tool_call and the turn made none: the episode's end
            return StepResult(done=True)
        if state["local"] is not None:
            env = state["local"]
            observation = await asyncio.to_thread(env.step, env_action(env, action))
            fields, done, reward = _fields(observation), observation.done, observation.reward
        else:
            result = await state["client"].step(action)
            fields, done, reward = dict(result.observation), result.done, result.reward
        state["done"] = bool(done)
        value = None if reward is None else float(reward)
        if done:
            return StepResult(reward=value, done=True)
        return StepResult([{"role": "user", "content": self._show(fields)}], reward=value)

    @hookimpl
    async def env_close(self, state: Any) -> None:
        if state["client"] is not None:
            await state["client"].close()
        elif state["local"] is not None and hasattr(state["local"], "close"):
            await asyncio.to_thread(state["local"].close)

    # ------------------------------------------------------------------ mapping
    def _action(self, turn: Turn) -> dict[str, Any] | None:
        if self.params.action_from == "text":
            return {self.params.action_field: turn.text}
        return dict(turn.tool_calls[0].arguments) if turn.tool_calls else None

    def _show(self, fields: dict[str, Any]) -> str:
        if self.params.observation_field is not None:
            if self.params.observation_field not in fields:
                raise UserError(
                    f"openenv environment: observation_field {self.params.observation_field!r} "
                    f"is not in the observation (fields: {', '.join(sorted(fields))})"
                )
            return str(fields[self.params.observation_field])
        shown = {k: v for k, v in fields.items() if k not in _HIDDEN}
        if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
            return str(next(iter(shown.values())))
        return json.dumps(shown, default=str, sort_keys=True)


def _fields(observation: Any) -> dict[str, Any]:
    return (
        dict(observation.model_dump()) if hasattr(observation, "model_dump") else dict(observation)
    )


def env_action(env: Any, action: dict[str, Any]) -> Any:
    """The in-process environment's own action type, built from ``action`` (validated by it)."""
    for base in getattr(type(env), "__orig_bases__", ()):
        args = getattr(base, "__args__", ())
        if args and inspect.isclass(args[0]):
            return args[0](**action)
    step = inspect.signature(env.step).parameters.get("action")
    annotation = getattr(step, "annotation", None)
    if inspect.isclass(annotation):
        return annotation(**action)
    raise UserError(
        f"openenv environment: cannot tell {type(env).__name__}'s action type (declare it as "
        "Environment[Action, Observation, State] or annotate step(action: ...))"
    )
