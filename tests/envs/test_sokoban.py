"""Sokoban: the rules and rewards, the generator's solvability, the solver, determinism and the vocabulary."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from rollstream.shared.envs.registry import PRESETS, XSB_VOCAB
from rollstream.shared.envs.sokoban import (
    ACTIONS,
    DEFAULT_VOCAB,
    Room,
    SokobanEnv,
    box_distance,
    generate_room,
    greedy_actions,
    move,
    play,
    solve,
)
from rollstream.shared.envs.text import format_reply

SIMPLE = PRESETS["SimpleSokoban"][1]
LARGER = PRESETS["LargerSokoban"][1]


def room(text: str) -> Room:
    return Room.from_text(text.strip())


# ---- rules ----


def test_walk_and_push_a_box_onto_the_target() -> None:
    start = room("######\n#PX_O#\n######")
    pushed, reward, solved = play(start, "Right")
    assert pushed.to_text() == "######\n#_PXO#\n######"
    assert reward == pytest.approx(-0.1) and not solved
    done, reward, solved = play(pushed, "Right")
    assert done.to_text() == "######\n#__P√#\n######"
    assert reward == pytest.approx(-0.1 + 1 + 10) and solved


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("#####\n#PXO#\n#####", "Up"),  # wall
        ("####\n#PX#\n####", "Right"),  # box into a wall
        ("######\n#PXX_#\n######", "Right"),  # box into a box
        ("#####\n#PX√#\n#####", "Right"),  # box into a box on a target
    ],
)
def test_blocked_moves_change_nothing_and_cost_a_step(text: str, action: str) -> None:
    start = room(text)
    after, reward, solved = play(start, action)
    assert after == start and reward == pytest.approx(-0.1) and not solved


def test_boxes_cannot_be_pulled() -> None:
    after = move(room("#####\n#XP_#\n#####"), "Right")
    assert after.to_text() == "#####\n#X_P#\n#####"


def test_box_off_target_costs_one() -> None:
    start = room("#######\n#P√__O#\n#X____#\n#######")
    after, reward, solved = play(start, "Right")
    assert after.to_text() == "#######\n#_SX_O#\n#X____#\n#######"
    assert reward == pytest.approx(-0.1 - 1) and not solved


def test_player_on_target_and_room_edges() -> None:
    after = move(room("####\n#PO#\n####"), "Right")
    assert after.to_text() == "####\n#_S#\n####"
    # Without a border wall, the grid's edge blocks like a wall.
    assert move(room("P_"), "Left") == room("P_")


def test_text_round_trip_with_another_vocab() -> None:
    text = "######\n#@$-.#\n#*-.-#\n######"
    parsed = Room.from_text(text, XSB_VOCAB)
    assert parsed.to_text(XSB_VOCAB) == text
    assert parsed.to_text() == "######\n#PX_O#\n#√_O_#\n######"


# ---- generator and solver ----


def _rooms(config: dict, seeds: range) -> list[Room]:
    dim_room, num_boxes, depth = tuple(config["dim_room"]), config["num_boxes"], config["search_depth"]
    return [generate_room(np.random.default_rng(seed), dim_room, num_boxes, depth) for seed in seeds]


@pytest.mark.parametrize(("config", "seeds"), [(SIMPLE, range(300)), (LARGER, range(150))], ids=["simple", "larger"])
def test_generated_rooms_are_solvable_and_unsolved(config: dict, seeds: range) -> None:
    for seed, generated in zip(seeds, _rooms(config, seeds)):
        assert generated.shape == tuple(config["dim_room"])
        assert len(generated.boxes) == len(generated.targets) == config["num_boxes"]
        assert not generated.boxes & generated.targets, f"seed {seed}: a box starts on a target"
        solution = solve(generated)
        assert solution is not None, f"seed {seed}: unsolvable\n{generated.to_text()}"
        # Reverse play of search_depth moves is itself a solution, so the shortest one is no longer.
        assert 0 < len(solution) <= config["search_depth"], f"seed {seed}"


def test_generated_rooms_have_a_border_and_connected_floor() -> None:
    for generated in _rooms(SIMPLE, range(50)):
        rows, cols = generated.shape
        border = {(r, c) for r in range(rows) for c in range(cols) if r in (0, rows - 1) or c in (0, cols - 1)}
        assert border <= generated.walls
        floor = {(r, c) for r in range(rows) for c in range(cols)} - generated.walls
        seen, stack = {generated.player}, [generated.player]
        while stack:
            r, c = stack.pop()
            for nxt in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if nxt in floor and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        assert seen == floor


def test_solver_finds_shortest_and_reports_dead_rooms() -> None:
    assert solve(room("######\n#PX_O#\n######")) == ["Right", "Right"]
    assert solve(room("###\n#S#\n###")) == []
    corner = room("#####\n#X__#\n#_P_#\n#__O#\n#####")
    assert solve(corner) is None
    far = room("##########\n#P_____XO#\n##########")
    assert solve(far, max_states=3) is None
    assert solve(far) == ["Right"] * 6


# ---- the env ----


@pytest.mark.parametrize("seed", range(20))
def test_env_plays_the_solver_solution_to_success(seed: int) -> None:
    env = SokobanEnv(**SIMPLE, max_actions_per_traj=100)
    env.reset(seed=seed)
    solution = solve(env.room)
    assert solution is not None
    total = 0.0
    for action in solution:
        obs, reward, terminated, truncated, info = env.step(format_reply(action))
        total += reward
    assert terminated and not truncated and info["success"]
    assert "X" not in obs and "√" in obs
    assert total == pytest.approx(-0.1 * len(solution) + 1 + 10)


@pytest.mark.parametrize("seed", range(10))
def test_distance_shaping_pays_the_distance_gained_and_telescopes(seed: int) -> None:
    plain = SokobanEnv(**SIMPLE, max_actions_per_traj=100)
    shaped = SokobanEnv(**SIMPLE, max_actions_per_traj=100, distance_shaping=0.5)
    plain.reset(seed=seed)
    shaped.reset(seed=seed)
    start = box_distance(shaped.room)
    rng = np.random.default_rng(seed)
    plain_total = shaped_total = 0.0
    for action in rng.choice(ACTIONS, 30):
        before = box_distance(shaped.room)
        _, plain_reward, done, _, _ = plain.step(format_reply(str(action)))
        _, shaped_reward, _, _, _ = shaped.step(format_reply(str(action)))
        assert shaped_reward - plain_reward == pytest.approx(0.5 * (before - box_distance(shaped.room)))
        plain_total, shaped_total = plain_total + plain_reward, shaped_total + shaped_reward
        if done:
            break
    # Potential-based: the episode's sum gains the distance closed from start to end, nothing for the path.
    assert shaped_total - plain_total == pytest.approx(0.5 * (start - box_distance(shaped.room)))


class OneRoom(SokobanEnv):
    """Plays the same hand-written room whatever the seed."""

    def __init__(self, text: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start = room(text)

    def _new_episode(self, seed: int) -> None:
        self._room = self.start


def test_distance_shaping_on_a_push_and_a_walk() -> None:
    env = OneRoom("#######\n#PX__O#\n#_____#\n#######", distance_shaping=0.5)
    env.reset(seed=0)
    assert env.step(format_reply("Right"))[1] == pytest.approx(-0.1 + 0.5)  # the box one closer
    assert env.step(format_reply("Down"))[1] == pytest.approx(-0.1)  # the player alone moved


def test_same_seed_same_room_and_reuse() -> None:
    a, b = SokobanEnv(**LARGER), SokobanEnv(**LARGER)
    first = a.reset(seed=9)[0]
    assert b.reset(seed=9)[0] == first
    for seed in range(5):
        a.reset(seed=seed)
        a.step(format_reply("Up"))
    assert a.reset(seed=9)[0] == first
    assert len({SokobanEnv(**SIMPLE).reset(seed=s)[0] for s in range(20)}) > 10


def test_no_effect_penalty_charges_blocked_moves_only() -> None:
    charged, plain = SokobanEnv(**SIMPLE, no_effect_penalty=-1.0), SokobanEnv(**SIMPLE)
    seen = set()
    for seed in range(5):
        for action in ACTIONS:  # each first move of five rooms: some walk into a wall, some move
            charged.reset(seed=seed), plain.reset(seed=seed)
            moved = play(charged.room, action)[0] != charged.room
            _, reward, _, _, info = charged.step(format_reply(action))
            assert info["action_is_effective"] == moved
            assert reward - plain.step(format_reply(action))[1] == pytest.approx(0.0 if moved else -1.0)
            seen.add(moved)
    assert seen == {True, False}


def test_invalid_reply_and_truncation() -> None:
    env = SokobanEnv(**SIMPLE, max_actions_per_traj=2)
    obs, _ = env.reset(seed=0)
    after, reward, terminated, truncated, info = env.step("push the box")
    assert (after, reward, terminated, truncated) == (obs, -0.1, False, False)
    assert info["action"] is None and not info["action_is_valid"]
    _, _, terminated, truncated, info = env.step(format_reply("up"))
    assert info["action"] == "Up" and not terminated and truncated


def test_grid_vocab_changes_only_the_symbols() -> None:
    plain, xsb = SokobanEnv(**SIMPLE), SokobanEnv(**SIMPLE, grid_vocab=XSB_VOCAB)
    translate = str.maketrans({DEFAULT_VOCAB[k]: XSB_VOCAB[k] for k in DEFAULT_VOCAB})
    for seed in range(10):
        assert xsb.reset(seed=seed)[0] == plain.reset(seed=seed)[0].translate(translate)
    prompt = xsb.system_prompt()
    assert "$ box" in prompt and "@ you" in prompt and "<answer>" in prompt


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grid_vocab": {"crate": "B"}}, "crate"),
        ({"grid_vocab": {"box": "BB"}}, "grid_vocab.box"),
        ({"grid_vocab": {"box": "#"}}, "share"),
        ({"dim_room": [6, 6, 6]}, "dim_room"),
        ({"dim_room": 4, "num_boxes": 2}, "too small"),
        ({"num_boxes": 0}, "num_boxes"),
        ({"search_depth": -1}, "search_depth"),
        ({"distance_shaping": -0.5}, "distance_shaping"),
        ({"distance_shaping": "yes"}, "distance_shaping"),
        ({"no_effect_penalty": "big"}, "no_effect_penalty"),
    ],
)
def test_bad_config_values_name_the_key(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SokobanEnv(**kwargs)


def test_room_too_cramped_to_generate_says_so() -> None:
    # A 2x2 inside has no three cells in a row, so reverse play can never pull a box off its target.
    with pytest.raises(RuntimeError, match="no Sokoban room with dim_room=\\[4, 4\\]"):
        SokobanEnv(dim_room=4).reset(seed=0)


def test_passes_gymnasium_env_checker() -> None:
    # skip_render_check: the checker's render test wants an env built by gymnasium.make (it warns otherwise).
    check_env(SokobanEnv(**LARGER), skip_render_check=True)


@pytest.mark.parametrize(
    ("text", "message"),
    [("####\n#P#\n###", "differ in length"), ("###\n#P?\n###", "not in the vocabulary"), ("#__#", "one player")],
)
def test_from_text_rejects_malformed_rooms(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Room.from_text(text)


def test_the_greedy_player_walks_to_the_box_and_pushes_it_in() -> None:
    start = room("#######\n#P__XO#\n#_____#\n#######")
    actions = greedy_actions(start, 10, np.random.default_rng(0))
    assert actions == ["Right", "Right", "Right"]  # two steps to the box, one push onto the target: then it stops
    end = start
    for action in actions:
        end = move(end, action)
    assert end.solved

