"""The multi-turn text env interface: observations are grids as text, actions are the policy's raw replies."""

from __future__ import annotations

import string
from abc import ABC, abstractmethod
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from rollstream.shared.envs.text import compile_action_pattern, parse_action, reply_instructions, turn_prompt

MAX_REPLY_CHARS = 8192
"""Longest reply the action space describes; longer replies are still parsed, just outside the space."""


def check_positive_int(name: str, value: Any) -> int:
    """`value` as an int, or a ValueError naming the config key."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


class TextEnv(gym.Env[str, str], ABC):
    """A gymnasium env for an LLM agent: `step` takes the reply text, parses the action and plays it.

    Subclasses set `action_names` and implement the game hooks below; this class owns parsing, the format
    penalty, the turn count and truncation. An invalid reply costs `format_penalty`, changes nothing and is
    not terminal. A valid move that leaves the state as it was (a walk into a wall) costs the game's own reward
    plus `no_effect_penalty` (0: nothing more). After `max_actions_per_traj` turns (valid or not) the episode
    is truncated.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 2}
    action_names: tuple[str, ...] = ()

    def __init__(self, *, max_actions_per_traj: int = 10, format_penalty: float = -0.1,
                 no_effect_penalty: float = 0.0, action_pattern: str | None = None) -> None:
        self.max_actions_per_traj = check_positive_int("max_actions_per_traj", max_actions_per_traj)
        self.format_penalty = _check_number("format_penalty", format_penalty)
        self.no_effect_penalty = _check_number("no_effect_penalty", no_effect_penalty)
        self.action_pattern = compile_action_pattern(action_pattern)
        """ROLL's env_config.action_pattern: a regex whose first group (or whole match) is the action."""
        self.system_template: str | None = None
        """ROLL's agent_system_template: put before the env's own rules (see `use_templates`)."""
        self.turn_template: str | None = None
        """ROLL's agent_template: the user message of a turn, with {turn_idx}, {observation}, {actions_left} and
        {max_response_length}."""
        self.render_mode = "rgb_array"
        # Replies are free text; the charset only describes what `sample()` draws.
        self.action_space = spaces.Text(max_length=MAX_REPLY_CHARS, min_length=0, charset=string.printable)
        self._turn = 0
        self._done = True

    # ---- the game: subclasses implement these ----

    @abstractmethod
    def _new_episode(self, seed: int) -> None:
        """Set up the game state for an episode; the state must be a pure function of `seed`."""

    @abstractmethod
    def _play(self, action: str) -> tuple[float, bool]:
        """Play one valid action; returns (reward, terminated)."""

    @abstractmethod
    def is_success(self) -> bool:
        """Whether the current state is a win."""

    @abstractmethod
    def render_text(self) -> str:
        """The current state as text (the observation)."""

    @abstractmethod
    def render_rgb(self) -> np.ndarray:
        """The current state as an (H, W, 3) uint8 image."""

    @abstractmethod
    def rules(self) -> str:
        """The game's rules in a sentence or two."""

    @abstractmethod
    def legend(self) -> str:
        """What each symbol of the text grid means."""

    # ---- the gymnasium interface ----

    def use_templates(self, system_template: str | None, turn_template: str | None) -> None:
        """ROLL's agent_system_template and agent_template for this env's prompts (None keeps the built-in ones)."""
        self.system_template, self.turn_template = system_template, turn_template

    def system_prompt(self) -> str:
        """Rules, symbols, valid actions and the reply format (after agent_system_template, when set)."""
        rules = [self.rules(), f"Symbols: {self.legend()}.", f"Actions: {', '.join(self.action_names)}."]
        if self.action_pattern is None:
            rules.append(reply_instructions(self.action_names))
        return "\n".join([self.system_template, *rules] if self.system_template else rules)

    def turn_message(self, turn: int, observation: str, max_response_tokens: int) -> str:
        """The user message of turn `turn` (from 1): agent_template when set, else the built-in one."""
        if self.turn_template is None:
            return turn_prompt(turn, observation, self.actions_left, max_response_tokens)
        return self.turn_template.format(turn_idx=turn, observation=observation, actions_left=self.actions_left,
                                         max_response_length=max_response_tokens)

    @property
    def actions_left(self) -> int:
        return self.max_actions_per_traj - self._turn

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; the same seed gives the same game. Envs are reused across many episodes."""
        super().reset(seed=seed)
        # Without a seed the game seed is drawn from the env's own generator, as gymnasium does.
        game_seed = int(seed) if seed is not None else int(self.np_random.integers(2**31))
        self._new_episode(game_seed)
        self._turn = 0
        self._done = False
        return self.render_text(), {"success": False, "actions_left": self.actions_left}

    def step(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Parse `reply`, play its action (or charge the format penalty) and report the new state."""
        if self._done:
            raise RuntimeError(f"{type(self).__name__}.step() called without reset() or after the episode ended")
        action = parse_action(reply, self.action_names, self.action_pattern) if isinstance(reply, str) else None
        self._turn += 1
        before = self.render_text()
        if action is None:
            reward, terminated = self.format_penalty, False
        else:
            reward, terminated = self._play(action)
        observation = self.render_text()
        effective = observation != before
        if action is not None and not effective:
            reward += self.no_effect_penalty
        truncated = not terminated and self._turn >= self.max_actions_per_traj
        self._done = terminated or truncated
        info = {
            "action": action,
            "action_is_valid": action is not None,
            "action_is_effective": effective,
            "success": self.is_success(),
            "actions_left": self.actions_left,
        }
        return observation, float(reward), terminated, truncated, info

    def render(self) -> np.ndarray:
        """gymnasium's render API: the only render mode is rgb_array."""
        return self.render_rgb()
