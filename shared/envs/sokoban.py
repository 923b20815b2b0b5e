"""Sokoban as a text game: the rules, a seeded room generator solvable by construction, and a BFS solver."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from gymnasium import spaces

from rollstream.shared.envs.base import TextEnv, check_positive_int
from rollstream.shared.envs.render import CellStyle, draw_grid

Pos = tuple[int, int]

ACTIONS = ("Up", "Down", "Left", "Right")
DIRECTIONS: dict[str, Pos] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}

STEP_PENALTY = -0.1
BOX_ON_TARGET_REWARD = 1.0
"""Given for a push onto a target and taken back (-1) for a push off one."""
SOLVED_REWARD = 10.0

DEFAULT_VOCAB: dict[str, str] = {
    "wall": "#",
    "empty": "_",
    "target": "O",
    "box": "X",
    "box_on_target": "√",
    "player": "P",
    "player_on_target": "S",
}
"""Cell kind -> text symbol; an env's `grid_vocab` overrides any of these."""
_LEGEND_WORDS = {
    "wall": "wall",
    "empty": "floor",
    "target": "target",
    "box": "box",
    "box_on_target": "box on target",
    "player": "you",
    "player_on_target": "you on target",
}

_FLOOR_RGB, _TARGET_RGB = (230, 230, 220), (240, 180, 180)
_KIND_STYLES = {
    "wall": CellStyle((90, 70, 60)),
    "empty": CellStyle(_FLOOR_RGB),
    "target": CellStyle(_TARGET_RGB),
    "box": CellStyle(_FLOOR_RGB, (190, 130, 40)),
    "box_on_target": CellStyle(_TARGET_RGB, (60, 170, 60)),
    "player": CellStyle(_FLOOR_RGB, (40, 90, 220)),
    "player_on_target": CellStyle(_TARGET_RGB, (40, 90, 220)),
}


@dataclass(frozen=True)
class Room:
    """A Sokoban state: the fixed layout (walls, targets) and where the boxes and the player are."""

    shape: Pos
    walls: frozenset[Pos]
    targets: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos

    @property
    def boxes_on_target(self) -> int:
        return len(self.boxes & self.targets)

    @property
    def solved(self) -> bool:
        return self.boxes <= self.targets

    def blocked(self, pos: Pos) -> bool:
        """A wall or outside the grid."""
        return pos in self.walls or not (0 <= pos[0] < self.shape[0] and 0 <= pos[1] < self.shape[1])

    def to_text(self, vocab: Mapping[str, str] = DEFAULT_VOCAB) -> str:
        return "\n".join("".join(vocab[self.kind((r, c))] for c in range(self.shape[1])) for r in range(self.shape[0]))

    def kind(self, pos: Pos) -> str:
        """The cell kind at `pos` (a key of DEFAULT_VOCAB)."""
        if pos in self.walls:
            return "wall"
        on_target = pos in self.targets
        if pos == self.player:
            return "player_on_target" if on_target else "player"
        if pos in self.boxes:
            return "box_on_target" if on_target else "box"
        return "target" if on_target else "empty"

    @classmethod
    def from_text(cls, text: str, vocab: Mapping[str, str] = DEFAULT_VOCAB) -> Room:
        """Parse a grid written with `vocab` (the inverse of `to_text`)."""
        kinds = {symbol: kind for kind, symbol in vocab.items()}
        rows = text.strip("\n").split("\n")
        if len({len(row) for row in rows}) != 1:
            raise ValueError(f"room rows differ in length: {[len(row) for row in rows]}")
        unknown = set("".join(rows)) - set(kinds)
        if unknown:
            raise ValueError(f"room symbols {sorted(unknown)} are not in the vocabulary {vocab}")
        cells = {(r, c): kinds[ch] for r, row in enumerate(rows) for c, ch in enumerate(row)}
        players = [p for p, k in cells.items() if k.startswith("player")]
        if len(players) != 1:
            raise ValueError(f"a room needs exactly one player, found {len(players)}")
        return cls(
            shape=(len(rows), len(rows[0])),
            walls=frozenset(p for p, k in cells.items() if k == "wall"),
            targets=frozenset(p for p, k in cells.items() if k.endswith("target")),
            boxes=frozenset(p for p, k in cells.items() if k.startswith("box")),
            player=players[0],
        )


def move(room: Room, action: str) -> Room:
    """The room after the player tries `action`: walk, push one box, or stay put when blocked."""
    dr, dc = DIRECTIONS[action]
    nxt = (room.player[0] + dr, room.player[1] + dc)
    if room.blocked(nxt):
        return room
    if nxt in room.boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if room.blocked(beyond) or beyond in room.boxes:
            return room
        return replace(room, boxes=(room.boxes - {nxt}) | {beyond}, player=nxt)
    return replace(room, player=nxt)


def box_distance(room: Room) -> int:
    """Summed distance (Manhattan, through walls) of each box off target to its nearest target; 0 when solved."""
    return sum(min(_distance(box, t) for t in room.targets) for box in room.boxes - room.targets)


def play(room: Room, action: str) -> tuple[Room, float, bool]:
    """One move with its reward; the bool says whether every box is now on a target."""
    after = move(room, action)
    reward = STEP_PENALTY + BOX_ON_TARGET_REWARD * (after.boxes_on_target - room.boxes_on_target)
    if after.solved:
        reward += SOLVED_REWARD
    return after, reward, after.solved


# ---- generation: reverse play from a solved room, so every room has a solution ----


def _distance(a: Pos, b: Pos) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def _carve_floor(rng: np.random.Generator, rows: int, cols: int) -> set[Pos]:
    """Floor cells of a connected room: a random walk inside the border that also opens a neighbour per step."""
    pos = (int(rng.integers(1, rows - 1)), int(rng.integers(1, cols - 1)))
    direction = DIRECTIONS[ACTIONS[rng.integers(4)]]
    floor = {pos}
    for _ in range(int(2.5 * (rows + cols))):
        if rng.random() < 0.35:
            direction = DIRECTIONS[ACTIONS[rng.integers(4)]]
        pos = (min(max(pos[0] + direction[0], 1), rows - 2), min(max(pos[1] + direction[1], 1), cols - 2))
        side = DIRECTIONS[ACTIONS[rng.integers(4)]]
        wide = (min(max(pos[0] + side[0], 1), rows - 2), min(max(pos[1] + side[1], 1), cols - 2))
        floor |= {pos, wide}
    return floor


def _reverse_play(rng: np.random.Generator, room: Room, steps: int) -> tuple[Room, int]:
    """Walk the player randomly, pulling the box behind it most of the time; also returns how spread out it got.

    Every reverse move is a legal forward move backwards (a pull from p to p+d is a push from p+d to p),
    so the solved start stays reachable from the result.
    """
    boxes, player = list(room.boxes), room.player
    starts = list(boxes)
    for _ in range(steps):
        dr, dc = DIRECTIONS[ACTIONS[rng.integers(4)]]
        nxt = (player[0] + dr, player[1] + dc)
        if room.blocked(nxt) or nxt in boxes:
            continue
        behind = (player[0] - dr, player[1] - dc)
        if behind in boxes and rng.random() < 0.8:
            boxes[boxes.index(behind)] = player
        player = nxt
    # Boxes far from their targets and a player far from the boxes make for longer solutions.
    spread = sum(_distance(b, s) for b, s in zip(boxes, starts)) + min(_distance(b, player) for b in boxes)
    return replace(room, boxes=frozenset(boxes), player=player), spread


def generate_room(
    rng: np.random.Generator,
    dim_room: Pos = (6, 6),
    num_boxes: int = 1,
    search_depth: int = 30,
    rollouts: int = 8,
    max_tries: int = 200,
) -> Room:
    """A room with no box on a target that reverse play proves solvable in at most `search_depth` moves.

    Of `rollouts` reverse walks on one layout the most spread out wins, since a plain random walk mostly
    leaves the boxes next to their targets.
    """
    rows, cols = dim_room
    for _ in range(max_tries):
        floor = sorted(_carve_floor(rng, rows, cols))
        if len(floor) < 2 * num_boxes + 2:
            continue
        picks = rng.choice(len(floor), size=num_boxes + 1, replace=False)
        targets = frozenset(floor[i] for i in picks[:num_boxes])
        walls = frozenset((r, c) for r in range(rows) for c in range(cols)) - set(floor)
        solved = Room(dim_room, walls, targets, boxes=targets, player=floor[picks[-1]])
        played = [_reverse_play(rng, solved, search_depth) for _ in range(rollouts)]
        # Rooms with a box still on a target are rejected: every box must need pushing.
        candidates = [(spread, room) for room, spread in played if not room.boxes & room.targets]
        if candidates:
            return max(candidates, key=lambda c: c[0])[1]
    raise RuntimeError(
        f"no Sokoban room with dim_room={list(dim_room)}, num_boxes={num_boxes}, search_depth={search_depth} "
        f"after {max_tries} tries; give more room, fewer boxes or a larger search_depth"
    )


# ---- solving ----


def _live_cells(room: Room) -> set[Pos]:
    """Cells from which a lone box can still be pushed onto some target (others are dead ends)."""
    live, frontier = set(room.targets), deque(room.targets)
    while frontier:
        r, c = frontier.popleft()
        for dr, dc in DIRECTIONS.values():
            # A box reaches (r, c) from `prev` pushed by a player standing at `stand`.
            prev, stand = (r - dr, c - dc), (r - 2 * dr, c - 2 * dc)
            if prev not in live and not room.blocked(prev) and not room.blocked(stand):
                live.add(prev)
                frontier.append(prev)
    return live


def solve(room: Room, max_states: int = 200_000) -> list[str] | None:
    """A shortest action sequence that puts every box on a target; None if none is found within `max_states`."""
    live = _live_cells(room)
    start = (room.player, room.boxes)
    parent: dict[tuple[Pos, frozenset[Pos]], tuple[tuple[Pos, frozenset[Pos]], str] | None] = {start: None}
    frontier = deque([start])
    while frontier:
        state = frontier.popleft()
        player, boxes = state
        if boxes <= room.targets:
            path: list[str] = []
            while (link := parent[state]) is not None:
                state, action = link
                path.append(action)
            return path[::-1]
        for action, (dr, dc) in DIRECTIONS.items():
            nxt = (player[0] + dr, player[1] + dc)
            if room.blocked(nxt):
                continue
            if nxt in boxes:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond not in live or beyond in boxes:
                    continue
                new_state = (nxt, (boxes - {nxt}) | {beyond})
            else:
                new_state = (nxt, boxes)
            if new_state not in parent:
                parent[new_state] = (state, action)
                frontier.append(new_state)
        if len(parent) > max_states:
            return None
    return None


# ---- the env ----


def greedy_actions(room: Room, steps: int, rng: np.random.Generator) -> list[str]:
    """A myopic player that reads the room but does not plan: each move is one that brings the boxes nearest their
    targets (summed distance of each box off target to its nearest target), then the player nearest a box off
    target; moves that change nothing are left out while another exists, ties are broken at random. It solves a
    room where the box can be walked and pushed straight in, and gets stuck where a detour is needed."""

    def score(after: Room) -> tuple[int, int]:
        player = min((_distance(after.player, box) for box in after.boxes - after.targets), default=0)
        return box_distance(after), player

    actions: list[str] = []
    while len(actions) < steps and not room.solved:
        options = {a: after for a in ACTIONS if (after := move(room, a)) != room} or {a: room for a in ACTIONS}
        scores = {a: score(after) for a, after in options.items()}
        best = min(scores.values())
        choice = str(rng.choice([a for a, s in scores.items() if s == best]))
        actions.append(choice)
        room = options[choice]
    return actions


def _check_vocab(grid_vocab: Mapping[str, str] | None) -> dict[str, str]:
    vocab = dict(DEFAULT_VOCAB)
    for kind, symbol in (grid_vocab or {}).items():
        if kind not in DEFAULT_VOCAB:
            raise ValueError(f"grid_vocab: unknown cell kind {kind!r}; valid kinds: {', '.join(DEFAULT_VOCAB)}")
        if not isinstance(symbol, str) or len(symbol) != 1 or symbol.isspace():
            raise ValueError(f"grid_vocab.{kind}: a symbol is one visible character, got {symbol!r}")
        vocab[kind] = symbol
    if len(set(vocab.values())) != len(vocab):
        raise ValueError(f"grid_vocab: two cell kinds share a symbol in {vocab}")
    return vocab


def _check_dim_room(dim_room: Any, num_boxes: int) -> Pos:
    dims = (dim_room, dim_room) if isinstance(dim_room, int) else dim_room
    if not isinstance(dims, Sequence) or isinstance(dims, str) or len(dims) != 2:
        raise ValueError(f"dim_room must be an int or [rows, cols], got {dim_room!r}")
    rows, cols = (check_positive_int("dim_room", d) for d in dims)
    # The border is wall; the inside must hold the targets, the player and room to move.
    if (rows - 2) * (cols - 2) < 2 * num_boxes + 2:
        raise ValueError(f"dim_room={list(dims)} is too small for num_boxes={num_boxes}")
    return rows, cols


def _check_shaping(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"distance_shaping must be a number >= 0 (0: off), got {value!r}")
    return float(value)


class SokobanEnv(TextEnv):
    """Push every box onto a target: -0.1 a step, +1 a box onto a target, -1 off one, +10 when all are on.

    `distance_shaping` > 0 adds that much per step of `box_distance` a move gains, and takes it back per step
    lost: a potential-based shaping (Ng, Harada & Russell, 1999), so an episode's sum gains
    `distance_shaping` x (distance at the start - distance at the end), and a plan that solves the room stays
    the best. Without it an episode that never reaches a target scores -0.1 a move, however close it pushed the
    box, and a group whose every member fails has no episode-level advantage to learn from.
    """

    action_names = ACTIONS

    def __init__(
        self,
        *,
        dim_room: int | Sequence[int] = (6, 6),
        num_boxes: int = 1,
        search_depth: int = 30,
        grid_vocab: Mapping[str, str] | None = None,
        format_penalty: float = -0.1,
        no_effect_penalty: float = 0.0,
        action_pattern: str | None = None,
        max_actions_per_traj: int = 10,
        distance_shaping: float = 0.0,
    ) -> None:
        super().__init__(max_actions_per_traj=max_actions_per_traj, format_penalty=format_penalty,
                         no_effect_penalty=no_effect_penalty, action_pattern=action_pattern)
        self.num_boxes = check_positive_int("num_boxes", num_boxes)
        self.dim_room = _check_dim_room(dim_room, self.num_boxes)
        self.search_depth = check_positive_int("search_depth", search_depth)
        self.vocab = _check_vocab(grid_vocab)
        self.distance_shaping = _check_shaping(distance_shaping)
        self.styles = {self.vocab[kind]: style for kind, style in _KIND_STYLES.items()}
        rows, cols = self.dim_room
        self.observation_space = spaces.Text(max_length=rows * (cols + 1) - 1, charset="".join(self.styles) + "\n")
        self._room: Room | None = None

    @property
    def room(self) -> Room:
        """The current state (for reference policies and tests)."""
        if self._room is None:
            raise RuntimeError("SokobanEnv: call reset() first")
        return self._room

    def _new_episode(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self._room = generate_room(rng, self.dim_room, self.num_boxes, self.search_depth)

    def _play(self, action: str) -> tuple[float, bool]:
        before = self.room
        self._room, reward, solved = play(before, action)
        if self.distance_shaping:
            reward += self.distance_shaping * (box_distance(before) - box_distance(self._room))
        return reward, solved

    def is_success(self) -> bool:
        return self._room is not None and self._room.solved

    def render_text(self) -> str:
        return self.room.to_text(self.vocab)

    def render_rgb(self) -> np.ndarray:
        return draw_grid(self.render_text().split("\n"), self.styles)

    def rules(self) -> str:
        return (
            "Sokoban: push every box onto a target. Walk into a box to push it. "
            "Boxes cannot be pulled or pushed into a wall or another box."
        )

    def legend(self) -> str:
        return ", ".join(f"{self.vocab[kind]} {word}" for kind, word in _LEGEND_WORDS.items())
