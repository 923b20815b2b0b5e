"""The registry: default tags, user envs by import path, and errors that name what would be valid."""

from __future__ import annotations

import numpy as np
import pytest

from rollstream.shared.config import CustomEnvConfig
from rollstream.shared.envs.base import TextEnv
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.envs.registry import PRESETS, default_custom_envs, known_env_types, make_env
from rollstream.shared.envs.sokoban import SokobanEnv
from rollstream.shared.envs.text import format_reply


class CoinGuessEnv(TextEnv):
    """A user's own env, reached through the import path `tests.envs.test_registry:CoinGuessEnv`."""

    action_names = ("Heads", "Tails")

    def __init__(self, *, bias: float = 0.5, max_actions_per_traj: int = 10) -> None:
        super().__init__(max_actions_per_traj=max_actions_per_traj)
        self.bias = bias
        self.coin = "Heads"
        self.guessed = False

    def _new_episode(self, seed: int) -> None:
        self.coin = "Heads" if np.random.default_rng(seed).random() < self.bias else "Tails"
        self.guessed = False

    def _play(self, action: str) -> tuple[float, bool]:
        self.guessed = action == self.coin
        return float(self.guessed), self.guessed

    def is_success(self) -> bool:
        return self.guessed

    def render_text(self) -> str:
        return self.coin[0] if self.guessed else "?"

    def render_rgb(self) -> np.ndarray:
        return np.full((8, 8, 3), 255 if self.guessed else 0, np.uint8)

    def rules(self) -> str:
        return "Guess the coin."

    def legend(self) -> str:
        return "? hidden, H heads, T tails"


class NoTurnLimitEnv(CoinGuessEnv):
    def __init__(self, *, bias: float = 0.5) -> None:
        super().__init__(bias=bias)


def _envs(env_type: str, env_config: dict | None = None, **fields: int) -> dict[str, CustomEnvConfig]:
    return {"Mine": CustomEnvConfig(env_type=env_type, env_config=env_config or {}, **fields)}


def test_default_tags_build_the_presets() -> None:
    custom_envs = default_custom_envs()
    assert set(custom_envs) == {"FrozenLake", "SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab"}
    assert known_env_types() == ["frozen_lake", "sokoban"]
    assert isinstance(make_env("FrozenLake", custom_envs), FrozenLakeEnv)
    larger = make_env("LargerSokoban", custom_envs)
    assert isinstance(larger, SokobanEnv) and larger.dim_room == (10, 10) and larger.num_boxes == 2
    assert "@" in make_env("SokobanDifferentGridVocab", custom_envs).reset(seed=0)[0]
    # Entries are fresh copies: editing one does not change the presets.
    custom_envs["SimpleSokoban"].env_config["dim_room"][0] = 7
    assert PRESETS["SimpleSokoban"][1]["dim_room"] == [6, 6]


def test_max_actions_per_traj_comes_from_the_tag() -> None:
    env = make_env("Mine", _envs("frozen_lake", {"size": 5}, max_actions_per_traj=3))
    assert env.max_actions_per_traj == 3 and len(env.reset(seed=0)[0].split("\n")) == 5


def test_unknown_tag_lists_the_known_tags() -> None:
    with pytest.raises(ValueError, match="unknown env tag 'Lake'.*FrozenLake, LargerSokoban"):
        make_env("Lake", default_custom_envs())


def test_unknown_env_type_lists_types_and_the_import_path_form() -> None:
    expected = r"custom_envs.Mine.env_type: .*frozen_lake, sokoban.*package.module:ClassName"
    with pytest.raises(ValueError, match=expected):
        make_env("Mine", _envs("frozenlake"))


@pytest.mark.parametrize(
    ("env_type", "message"),
    [
        ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
        ("tests.envs.test_registry:Missing", "has no attribute 'Missing'"),
        ("collections:OrderedDict", "not a subclass of rollstream.shared.envs.base.TextEnv"),
        ("tests.envs.test_registry:NoTurnLimitEnv", "must accept max_actions_per_traj"),
    ],
)
def test_bad_import_paths_say_why(env_type: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_env("Mine", _envs(env_type))


def test_import_path_builds_a_user_env() -> None:
    env = make_env("Mine", _envs("tests.envs.test_registry:CoinGuessEnv", {"bias": 1.0}, max_actions_per_traj=2))
    assert isinstance(env, CoinGuessEnv) and env.bias == 1.0
    assert env.reset(seed=3)[0] == "?"
    assert "Actions: Heads, Tails." in env.system_prompt()
    obs, reward, terminated, truncated, info = env.step(format_reply("heads"))
    assert (obs, reward, terminated, info["success"]) == ("H", 1.0, True, True)


def test_bad_env_config_key_names_the_key_and_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"custom_envs.Mine.env_config: unknown key 'sizee'.*size, p, is_slippery"):
        make_env("Mine", _envs("frozen_lake", {"sizee": 4}))
    with pytest.raises(ValueError, match="unknown key 'dim'.*dim_room, num_boxes, search_depth, grid_vocab"):
        make_env("Mine", _envs("sokoban", {"dim": 6}))
    with pytest.raises(ValueError, match="set on the tag"):
        make_env("Mine", _envs("sokoban", {"max_actions_per_traj": 6}))


def test_bad_values_name_the_tag_and_key() -> None:
    with pytest.raises(ValueError, match="custom_envs.Mine.env_config: size must be"):
        make_env("Mine", _envs("frozen_lake", {"size": 0}))
    with pytest.raises(ValueError, match="custom_envs.Mine.env_config: grid_vocab: unknown cell kind 'crate'"):
        make_env("Mine", _envs("sokoban", {"grid_vocab": {"crate": "B"}}))
    # The typed schema refuses a bad turn limit when the entry is made, before any env is built.
    with pytest.raises(ValueError, match="max_actions_per_traj"):
        make_env("Mine", _envs("sokoban", max_actions_per_traj=0))
