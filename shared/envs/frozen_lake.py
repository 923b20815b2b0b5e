"""FrozenLake as a text game: gymnasium's own FrozenLakeEnv on a map that is a pure function of the seed."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
from gymnasium import spaces
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from rollstream.shared.envs.base import TextEnv, check_positive_int
from rollstream.shared.envs.render import CellStyle, draw_grid

ACTIONS = ("Left", "Down", "Right", "Up")
"""In gymnasium's order: the index of a name is its gymnasium action."""
MOVES = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}

# Text symbols. The start cell S is plain ice once the player has left it.
ICE, HOLE, GOAL, PLAYER, PLAYER_IN_HOLE, PLAYER_ON_GOAL = "_", "O", "G", "P", "X", "√"
_CELL_SYMBOL = {"S": ICE, "F": ICE, "H": HOLE, "G": GOAL}
_PLAYER_SYMBOL = {"S": PLAYER, "F": PLAYER, "H": PLAYER_IN_HOLE, "G": PLAYER_ON_GOAL}

_ICE_RGB, _HOLE_RGB, _GOAL_RGB, _PLAYER_RGB = (200, 230, 255), (20, 40, 90), (60, 180, 75), (220, 40, 40)
STYLES = {
    ICE: CellStyle(_ICE_RGB),
    HOLE: CellStyle(_HOLE_RGB),
    GOAL: CellStyle(_GOAL_RGB),
    PLAYER: CellStyle(_ICE_RGB, _PLAYER_RGB),
    PLAYER_IN_HOLE: CellStyle(_HOLE_RGB, _PLAYER_RGB),
    PLAYER_ON_GOAL: CellStyle(_GOAL_RGB, _PLAYER_RGB),
}


def moved(desc: Sequence[str], cell: tuple[int, int], action: str) -> tuple[int, int]:
    """The cell a non-slippery `action` from `cell` leads to: a move into the map's edge leaves the player where it
    was, as in gymnasium."""
    dr, dc = MOVES[action]
    return min(max(cell[0] + dr, 0), len(desc) - 1), min(max(cell[1] + dc, 0), len(desc[0]) - 1)


def optimal_actions(desc: Sequence[str], start: tuple[int, int] | None = None) -> list[str]:
    """A shortest hole-free path on a non-slippery map (gymnasium letters S F H G), from S or `start`.

    Raises ValueError when the goal cannot be reached.
    """
    rows, cols = len(desc), len(desc[0])
    if start is None:
        start = next((r, c) for r in range(rows) for c in range(cols) if desc[r][c] == "S")
    came_from: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    frontier = deque([start])
    while frontier:
        cell = frontier.popleft()
        if desc[cell[0]][cell[1]] == "G":
            path: list[str] = []
            while (step := came_from[cell]) is not None:
                cell, action = step
                path.append(action)
            return path[::-1]
        if desc[cell[0]][cell[1]] == "H":
            continue
        for action in ACTIONS:
            nxt = moved(desc, cell, action)  # a move into the edge stays on `cell`, already seen
            if nxt not in came_from:
                came_from[nxt] = (cell, action)
                frontier.append(nxt)
    raise ValueError(f"no path from {start} to the goal on map {list(desc)}")


class FrozenLakeEnv(TextEnv):
    """Walk from the top-left corner to the goal in the bottom-right corner without falling into a hole.

    Reward 1 on reaching the goal, 0 otherwise; a hole or the goal ends the episode.
    """

    action_names = ACTIONS

    def __init__(
        self,
        *,
        size: int = 4,
        p: float = 0.8,
        is_slippery: bool = False,
        format_penalty: float = -0.1,
        no_effect_penalty: float = 0.0,
        action_pattern: str | None = None,
        max_actions_per_traj: int = 10,
    ) -> None:
        super().__init__(max_actions_per_traj=max_actions_per_traj, format_penalty=format_penalty,
                         no_effect_penalty=no_effect_penalty, action_pattern=action_pattern)
        # size 1 and p 0 would make gymnasium's generator loop forever looking for a path.
        self.size = check_positive_int("size", size)
        if self.size < 2:
            raise ValueError(f"size must be at least 2, got {size!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"p (probability that a cell is ice) must be in (0, 1], got {p!r}")
        if not isinstance(is_slippery, bool):
            raise ValueError(f"is_slippery must be true or false, got {is_slippery!r}")
        self.p = float(p)
        self.is_slippery = is_slippery
        self.observation_space = spaces.Text(
            max_length=self.size * (self.size + 1) - 1,
            charset="".join(STYLES) + "\n",
        )
        self.desc: list[str] = []
        self._lake: GymFrozenLake | None = None

    def _new_episode(self, seed: int) -> None:
        self.desc = generate_random_map(size=self.size, p=self.p, seed=seed)
        # The transition table depends on the map, so each episode gets a fresh gymnasium env; seeding it
        # makes slippery moves a pure function of (seed, actions).
        self._lake = GymFrozenLake(desc=self.desc, is_slippery=self.is_slippery)
        self._lake.reset(seed=seed)

    @property
    def player(self) -> tuple[int, int]:
        """The player's (row, col)."""
        if self._lake is None:
            raise RuntimeError("FrozenLakeEnv: call reset() first")
        return divmod(int(self._lake.s), self.size)

    def _letter(self) -> str:
        row, col = self.player
        return self.desc[row][col]

    def _play(self, action: str) -> tuple[float, bool]:
        assert self._lake is not None
        _, reward, terminated, _, _ = self._lake.step(ACTIONS.index(action))
        return float(reward), bool(terminated)

    def is_success(self) -> bool:
        return self._lake is not None and self._letter() == "G"

    def render_text(self) -> str:
        player = self.player
        return "\n".join(
            "".join(
                (_PLAYER_SYMBOL if (r, c) == player else _CELL_SYMBOL)[letter] for c, letter in enumerate(row)
            )
            for r, row in enumerate(self.desc)
        )

    def render_rgb(self) -> np.ndarray:
        return draw_grid(self.render_text().split("\n"), STYLES)

    def rules(self) -> str:
        slippery = " The ice is slippery: a move sometimes goes sideways." if self.is_slippery else ""
        return f"FrozenLake: walk from P to the goal G. A hole O ends the game.{slippery}"

    def legend(self) -> str:
        return (
            f"{PLAYER} you, {ICE} ice, {HOLE} hole, {GOAL} goal, "
            f"{PLAYER_IN_HOLE} you in a hole, {PLAYER_ON_GOAL} you on the goal"
        )
