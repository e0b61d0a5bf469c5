"""Environment "agent": a program of your own per episode, calling the policy through an
OpenAI-compatible gateway (:mod:`alignzoo.rollout.agents`).

``command: ["python", "my_agent.py"]`` (``python`` is the interpreter running alignzoo) or
``function: "my_agent.py:solve"`` (``solve(task, base_url, api_key)``, sync or ``async def``,
run in this process: no process start, but a sync one past its time limit cannot be stopped).
Each episode's program gets, added to the environment it inherits (and ``env``):

- ``OPENAI_BASE_URL``: ``http://127.0.0.1:<port>/v1``, the gateway of this step;
- ``OPENAI_API_KEY``: a key of this episode alone (another episode's calls cannot reach its
  record; a key is refused once its episode ends);
- ``ALIGNZOO_TASK``: the row as JSON (``prompt``, ``answer`` and every other column), also on
  its stdin.

The episode ends when the program exits, or at ``time_limit_s`` (its process group is
killed). More than ``max_calls`` calls (a flood) ends it too, as does a crash; what becomes of
a failed episode's samples is ``episodes.on_failure``. The arm's labeler scores the final
transcript; an agent may also post its own reward to ``$OPENAI_BASE_URL/reward``, which the
``episode_reward`` labeler returns.

The gateway samples with the arm's ``training.sampling`` (the behaviour policy the trainer
corrects for), reads tool calls with ``episodes.codec`` and answers them in OpenAI's
``tool_calls`` shape; ``episodes.max_tokens`` bounds each trajectory's tokens.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignzoo.config.callables import load_callable
from alignzoo.plugin import Environment


class AgentEnvironment(Environment):
    """An agent program per episode, calling the policy through an OpenAI-compatible gateway."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        command: list[str] | None = Field(
            None,
            min_length=1,
            description="The agent's command line, run per episode ('python' is the "
            "interpreter running alignzoo); or set function.",
        )
        function: str | None = Field(
            None,
            description="'path/to/file.py:fn' or 'module:fn', called per episode in this "
            "process as fn(task, base_url, api_key); or set command.",
        )
        env: dict[str, str] = Field(
            default_factory=dict, description="More environment variables for the agent."
        )
        cwd: str | None = Field(None, description="The agent's working directory.")
        time_limit_s: float = Field(
            60.0, gt=0, description="Longest episode; past it the agent's process group is killed."
        )
        max_calls: int = Field(
            32, ge=1, description="Calls per episode at most; one more ends it (calls_limit)."
        )
        max_sampled_tokens: int | None = Field(
            None, ge=1, description="Tokens the policy samples per episode at most (all calls)."
        )
        concurrency: int = Field(
            16, ge=1, description="Agents running at once (the step's others wait their turn)."
        )
        batch_wait_s: float = Field(
            0.02,
            ge=0,
            le=5,
            description="How long a call waits for other agents' calls to sample with it.",
        )

        @model_validator(mode="after")
        def _one_program(self) -> AgentEnvironment.Params:
            if (self.command is None) == (self.function is None):
                raise ValueError("set exactly one of command (a program) or function")
            if self.cwd is not None and not Path(self.cwd).is_dir():
                raise ValueError(f"cwd: {self.cwd!r} is not a directory")
            if self.command is not None:
                _check_command(self.command, self.cwd)
            return self

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.function = None
        if self.params.function is not None:
            self.function = load_callable(self.params.function, "agent environment")

    def agent_settings(self) -> Any:
        """The runner's settings (:class:`alignzoo.rollout.agents.AgentSettings`)."""
        from alignzoo.rollout.agents import AgentSettings

        p = self.params
        return AgentSettings(
            command=p.command,
            function=self.function,
            env=dict(p.env),
            cwd=p.cwd,
            time_limit_s=p.time_limit_s,
            max_calls=p.max_calls,
            max_sampled_tokens=p.max_sampled_tokens,
            concurrency=p.concurrency,
            batch_wait_s=p.batch_wait_s,
        )


def _check_command(command: list[str], cwd: str | None) -> None:
    """The program exists and may run; a Python script given to ``python`` exists."""
    program = command[0]
    base = Path(cwd) if cwd else Path.cwd()
    if program in ("python", "python3"):
        if len(command) > 1 and command[1].endswith(".py"):
            script = base / command[1]
            if not script.is_file():
                raise ValueError(f"command: the script {command[1]!r} does not exist")
        return
    if "/" in program:
        path = base / program
        if not path.is_file():
            raise ValueError(f"command: {program!r} does not exist")
        if not os.access(path, os.X_OK):
            raise ValueError(f"command: {program!r} is not executable (chmod +x)")
        return
    if shutil.which(program) is None:
        raise ValueError(f"command: {program!r} is not on PATH")
