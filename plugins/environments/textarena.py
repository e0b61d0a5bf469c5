"""Environment "textarena": a single-player TextArena game as episodes (the ``textarena`` extra).

``env_id`` names the game (``GuessTheNumber-v0``, ``Sudoku-v0``, ...); each episode makes its
own game (``textarena.make``), seeded from the episode's seed. The game's first observation is
the user message the model answers; each model turn is the player's move (the game reads the
action it wants, e.g. a number in square brackets); the game's answer to it (what it appends
to its observation, without the echo of the move) is the next user message. When the game is
done, player 0's reward is the step's reward, which the ``episode_reward`` labeler returns.

Refused with a clear message when the arm is assembled: a game for more than one player (only
single-player games are environments here), and a game that needs data TextArena downloads
(some word games fetch NLTK corpora on first use, which an offline machine cannot).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.errors import UserError
from alignzoo.integrations import require
from alignzoo.plugin import Environment, hookimpl
from alignzoo.rollout.episode import EpisodeStart, StepResult, Turn


def _textarena() -> Any:
    return require("textarena", "textarena", "textarena environment")


class TextArenaEnvironment(Environment):
    """A single-player TextArena game (textarena.make(env_id)) as multi-turn episodes."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        env_id: str = Field(description="The game's TextArena id, e.g. GuessTheNumber-v0.")

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self._make(0)  # refuse an unknown, multi-player or downloading game now, not mid-run

    def _make(self, seed: int) -> Any:
        ta = _textarena()
        env_id = self.params.env_id
        try:
            game = ta.make(env_id)
        except LookupError as exc:  # NLTK data missing: TextArena would download it
            raise UserError(
                f"textarena environment: {env_id} needs data TextArena downloads ({exc}); "
                "not available offline"
            ) from None
        except Exception as exc:
            known = getattr(getattr(ta, "envs", None), "registration", None)
            raise UserError(
                f"textarena environment: cannot make {env_id!r} ({type(exc).__name__}: {exc})"
                + ("" if known is None else "; see textarena.envs.registration for the ids")
            ) from None
        try:
            game.reset(num_players=1, seed=seed)
        except AssertionError as exc:
            raise UserError(
                f"textarena environment: {env_id} is not a single-player game ({exc})"
            ) from None
        except LookupError as exc:
            raise UserError(
                f"textarena environment: {env_id} needs data TextArena downloads ({exc}); "
                "not available offline"
            ) from None
        return game

    @hookimpl
    def env_reset(self, row: dict[str, Any], seed: int) -> EpisodeStart:
        game = self._make(seed % 2**32)
        _, observation = game.get_observation()
        text = str(observation).strip()
        prompt = str(row.get("prompt", "")).strip()
        content = f"{prompt}\n\n{text}" if prompt else text
        state = {"game": game, "seen": str(observation), "closed": False}
        return EpisodeStart(state=state, messages=[{"role": "user", "content": content}])

    @hookimpl
    def env_step(self, state: Any, turn: Turn) -> StepResult:
        game = state["game"]
        done, info = game.step(turn.text)
        if done:
            rewards, game_info = game.close()
            state["closed"] = True
            reward = float((rewards or {}).get(0, 0.0))
            reason = (game_info or {}).get(0, {}).get("reason", "")
            return StepResult(reward=reward, done=True, info={"reason": str(reason)})
        _, observation = game.get_observation()
        observation = str(observation)
        seen = state["seen"]
        new = observation[len(seen) :] if observation.startswith(seen) else observation
        state["seen"] = observation
        # The game echoes the move ("[Player] ..."): the model wrote it, so it is not repeated.
        lines = [line for line in new.splitlines() if not line.startswith("[Player]")]
        answer = "\n".join(lines).strip() or "(no answer from the game)"
        return StepResult([{"role": "user", "content": answer}], info=dict(info or {}))

    @hookimpl
    def env_close(self, state: Any) -> None:
        if not state["closed"]:
            state["closed"] = True
            state["game"].close()
