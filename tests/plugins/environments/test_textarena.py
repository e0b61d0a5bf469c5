"""The textarena environment against the real package: a scripted player wins GuessTheNumber
through the hooks, a two-player game is refused, the contract suite passes, and an arm trains
a few steps on the game."""

from __future__ import annotations

import re

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.errors import UserError
from alignzoo.rollout.episode import Turn
from alignzoo.testing.environments import check_environment

from ...core.engine.conftest import episode_experiment, read_jsonl
from ...core.engine.test_episodes_run import chat_policy  # noqa: F401 - a fixture

pytest.importorskip("textarena", reason="the textarena extra is not installed")

from alignzoo.plugins.environments.textarena import TextArenaEnvironment


def test_a_scripted_player_wins_guess_the_number_through_the_hooks():
    env = TextArenaEnvironment({"env_id": "GuessTheNumber-v0"})
    start = env.env_reset(row={"prompt": "Play."}, seed=3)
    assert start.messages[0]["content"].startswith("Play.")
    assert "Guess The Number" in start.messages[0]["content"]
    low, high = 1, 20
    for index in range(10):
        guess = (low + high) // 2
        result = env.env_step(state=start.state, turn=Turn(f"I guess [{guess}]", index=index))
        if result.done:
            break
        hint = result.messages[0]["content"]
        assert "[Player]" not in hint  # the model's own move is not echoed back
        if "higher" in hint:
            low = guess + 1
        else:
            assert "lower" in hint, hint
            high = guess - 1
    assert result.done and result.reward == 1.0 and "Congratulations" in result.info["reason"]
    env.env_close(state=start.state)  # closing a finished game is a no-op


def test_a_game_for_two_players_or_an_unknown_id_is_refused_when_the_arm_is_built():
    with pytest.raises(UserError, match="not a single-player game"):
        TextArenaEnvironment({"env_id": "TicTacToe-v0"})
    with pytest.raises(UserError, match="cannot make 'NoSuchGame-v0'"):
        TextArenaEnvironment({"env_id": "NoSuchGame-v0"})


def test_textarena_passes_the_environment_contract():
    results = check_environment("textarena", {"env_id": "GuessTheNumber-v0"}, max_examples=10)
    assert all(r.passed for r in results), [r for r in results if not r.passed]


def test_an_arm_trains_a_few_steps_on_the_game(tmp_path, chat_policy):  # noqa: F811
    game = {"name": "textarena", "params": {"env_id": "GuessTheNumber-v0"}}
    spec = episode_experiment(chat_policy, "game", game, max_tokens=512)
    path = tmp_path / "game.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_experiment(path)
    summary = run_one(loaded, "game", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(r["env/turns"] >= 1 for r in rows)
    sample = read_jsonl(tmp_path / "run" / "samples.jsonl")[0]
    assert re.search(r"Guess The Number", sample["messages"][0]["content"])
