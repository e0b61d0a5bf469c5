"""A real OpenEnv environment for the tests: "say something", twice; the reward is how close
the message's length is to 5. Run as a script it serves it with create_app on 127.0.0.1:
``python openenv_says.py PORT DIE_AFTER`` (the process exits at its DIE_AFTER-th step, as a
server that dies mid-episode)."""

from __future__ import annotations

import os
import sys

from openenv.core import Action, Environment, Observation, State, create_app


class SayAction(Action):
    message: str


class SayObservation(Observation):
    text: str = ""


STEPS = {"count": 0, "die_after": 0}


class Says(Environment[SayAction, SayObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.turns = 0
        return SayObservation(text=f"Say something (round {seed % 7 if seed else 0}).")

    def step(self, action, timeout_s=None, **kwargs):
        STEPS["count"] += 1
        if STEPS["die_after"] and STEPS["count"] >= STEPS["die_after"]:
            os._exit(1)
        self.turns += 1
        reward = 1.0 / (1 + abs(len(action.message) - 5))
        return SayObservation(text=f"heard {len(action.message)} characters", reward=reward,
                              done=self.turns >= 2)  # fmt: skip

    @property
    def state(self):
        return State(episode_id="says", step_count=self.turns)


class SlowSays(Says):
    """Says, taking a second per step (a slow environment in process)."""

    def step(self, action, timeout_s=None, **kwargs):
        import time

        time.sleep(1.0)
        return super().step(action, timeout_s, **kwargs)


if __name__ == "__main__":
    import uvicorn

    STEPS["die_after"] = int(sys.argv[2])
    app = create_app(Says, SayAction, SayObservation, env_name="says", max_concurrent_envs=64)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
