"""FrozenLake: map determinism, the rules, the format penalty, truncation and the BFS reference path."""

from __future__ import annotations

import pytest
from gymnasium.utils.env_checker import check_env

from rollstream.shared.envs.frozen_lake import ACTIONS, FrozenLakeEnv, moved, optimal_actions
from rollstream.shared.envs.text import format_reply


def _play(env: FrozenLakeEnv, actions: list[str]) -> list[tuple[str, float, bool, bool, dict]]:
    """Step through `actions`, stopping early if the episode ends."""
    steps = []
    for action in actions:
        steps.append(env.step(format_reply(action)))
        if steps[-1][2] or steps[-1][3]:
            break
    return steps


def test_same_seed_same_map_and_observation() -> None:
    a, b = FrozenLakeEnv(), FrozenLakeEnv()
    assert a.reset(seed=11)[0] == b.reset(seed=11)[0]
    assert a.desc == b.desc
    maps = {tuple(a.reset(seed=s)[0]) for s in range(20)}
    assert len(maps) > 10, "different seeds should give different maps"


def test_env_is_reusable_across_seeds() -> None:
    env = FrozenLakeEnv()
    first = env.reset(seed=5)[0]
    for seed in range(10):
        env.reset(seed=seed)
        _play(env, ["Right", "Down"])
    assert env.reset(seed=5)[0] == first


def test_observation_symbols() -> None:
    env = FrozenLakeEnv(size=4)
    obs, info = env.reset(seed=3)
    rows = obs.split("\n")
    assert len(rows) == 4 and all(len(r) == 4 for r in rows)
    assert rows[0][0] == "P" and rows[-1][-1] == "G"
    assert set(obs) <= set("P_OG\n")
    assert info == {"success": False, "actions_left": 10}
    assert env.observation_space.contains(obs)


@pytest.mark.parametrize("seed", range(40))
def test_bfs_path_reaches_goal(seed: int) -> None:
    env = FrozenLakeEnv(size=6, max_actions_per_traj=50)
    env.reset(seed=seed)
    path = optimal_actions(env.desc)
    steps = _play(env, path)
    obs, reward, terminated, truncated, info = steps[-1]
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert obs.split("\n")[-1][-1] == "√"
    assert all(s[1] == 0.0 and not s[2] for s in steps[:-1])


def test_hole_ends_the_episode() -> None:
    env = FrozenLakeEnv()
    for seed in range(200):
        env.reset(seed=seed)
        into_hole = "Right" if env.desc[0][1] == "H" else "Down" if env.desc[1][0] == "H" else None
        if into_hole:
            break
    assert into_hole, "no map with a hole next to the start in 200 seeds"
    obs, reward, terminated, truncated, info = env.step(format_reply(into_hole))
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert "X" in obs and "P" not in obs
    with pytest.raises(RuntimeError, match="reset"):
        env.step(format_reply("Up"))


def test_edge_move_is_valid_and_stays() -> None:
    env = FrozenLakeEnv()
    obs, _ = env.reset(seed=1)
    after, reward, terminated, truncated, info = env.step("<answer>Left</answer>")
    assert after == obs and reward == 0.0 and info["action"] == "Left" and info["action_is_valid"]
    assert not info["action_is_effective"]


def test_no_effect_penalty_charges_a_move_that_stays_and_only_that() -> None:
    env = FrozenLakeEnv(no_effect_penalty=-0.5)
    env.reset(seed=1)
    _, reward, _, _, info = env.step("<answer>Left</answer>")  # from the top-left corner
    assert reward == -0.5 and not info["action_is_effective"]
    _, reward, _, _, info = env.step("<answer>Jump</answer>")  # invalid: the format penalty alone
    assert reward == -0.1 and not info["action_is_effective"]


def test_invalid_reply_costs_penalty_and_changes_nothing() -> None:
    env = FrozenLakeEnv(format_penalty=-0.5, max_actions_per_traj=3)
    obs, _ = env.reset(seed=2)
    for turn, reply in enumerate(["go left", "<answer>Jump</answer>", "<answer>Left"], start=1):
        after, reward, terminated, truncated, info = env.step(reply)
        assert after == obs and reward == -0.5 and not terminated
        assert info == {"action": None, "action_is_valid": False, "action_is_effective": False, "success": False,
                        "actions_left": 3 - turn}
        assert truncated == (turn == 3)


def test_terminal_last_action_is_not_truncated() -> None:
    env = FrozenLakeEnv(max_actions_per_traj=100)
    env.reset(seed=0)
    path = optimal_actions(env.desc)
    env = FrozenLakeEnv(max_actions_per_traj=len(path))
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = _play(env, path)[-1]
    assert (reward, terminated, truncated) == (1.0, True, False)


def _observations(seed: int, is_slippery: bool, actions: list[str]) -> list[str]:
    env = FrozenLakeEnv(is_slippery=is_slippery, max_actions_per_traj=len(actions))
    observations = [env.reset(seed=seed)[0]]
    for action in actions:
        obs, _, terminated, _, _ = env.step(format_reply(action))
        observations.append(obs)
        if terminated:
            break
    return observations


def test_slippery_is_deterministic_under_a_seed() -> None:
    actions = ["Right", "Down"] * 6
    slippery = {seed: _observations(seed, True, actions) for seed in range(30)}
    assert all(_observations(seed, True, actions) == obs for seed, obs in slippery.items())
    # The ice really is slippery: some runs differ from the same moves on the same map without slipping.
    assert any(obs != _observations(seed, False, actions) for seed, obs in slippery.items())


def test_optimal_actions_on_a_fixed_map() -> None:
    desc = ["SFFF", "HHHF", "FFFF", "FHHG"]
    assert optimal_actions(desc) == ["Right", "Right", "Right", "Down", "Down", "Down"]
    assert optimal_actions(desc, start=(2, 0)) == ["Right", "Right", "Right", "Down"]
    with pytest.raises(ValueError, match="no path"):
        optimal_actions(["SH", "HG"])


def test_system_prompt_lists_rules_symbols_actions_and_format() -> None:
    prompt = FrozenLakeEnv(is_slippery=True).system_prompt()
    assert "slippery" in prompt and "<answer>" in prompt
    assert all(a in prompt for a in ACTIONS)
    assert all(f"{s} " in prompt for s in "P_OGX√")


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"size": 1}, "size"), ({"size": "4"}, "size"), ({"p": 0}, "p"), ({"p": 1.5}, "p"),
     ({"is_slippery": "yes"}, "is_slippery"), ({"format_penalty": "x"}, "format_penalty"),
     ({"no_effect_penalty": True}, "no_effect_penalty"),
     ({"max_actions_per_traj": 0}, "max_actions_per_traj")],
)
def test_bad_config_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        FrozenLakeEnv(**kwargs)


def test_passes_gymnasium_env_checker() -> None:
    # skip_render_check: the checker's render test wants an env built by gymnasium.make (it warns otherwise).
    check_env(FrozenLakeEnv(is_slippery=True), skip_render_check=True)


def test_a_move_into_the_maps_edge_leaves_the_player_where_it_was() -> None:
    desc = ["SF", "FG"]
    assert moved(desc, (0, 0), "Right") == (0, 1) and moved(desc, (0, 0), "Down") == (1, 0)
    assert moved(desc, (0, 0), "Left") == (0, 0) and moved(desc, (1, 1), "Down") == (1, 1)
