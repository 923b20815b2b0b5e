"""Tags to envs: the registered env types, user env classes by import path, and the default tags.

A tag (FrozenLake, SimpleSokoban, ...) names an entry of `custom_envs`: an `env_type` plus the `env_config`
keyword arguments of that type's constructor. `env_type` is a registered name (`known_env_types()`) or an
import path `package.module:ClassName` to a subclass of `rollstream.shared.envs.base.TextEnv`; a plain gymnasium env
is not enough, since the episode loop needs `system_prompt()`, `action_names` and a text `step(reply)`.
The constructor is called as `Class(**env_config, max_actions_per_traj=...)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from rollstream.shared.config import PRESETS, XSB_VOCAB, CustomEnvConfig, default_custom_envs
from rollstream.shared.envs.base import TextEnv, check_positive_int
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.envs.sokoban import SokobanEnv
from rollstream.shared.imports import import_object, is_import_path

__all__ = ["PRESETS", "XSB_VOCAB", "default_custom_envs", "known_env_types", "make_env", "resolve_env_type"]

ENV_TYPES: dict[str, type[TextEnv]] = {"frozen_lake": FrozenLakeEnv, "sokoban": SokobanEnv}


def known_env_types() -> list[str]:
    return sorted(ENV_TYPES)


def resolve_env_type(env_type: str) -> type[TextEnv]:
    """The env class for a registered name or a `package.module:ClassName` import path."""
    if env_type in ENV_TYPES:
        return ENV_TYPES[env_type]
    if not is_import_path(env_type):
        raise ValueError(
            f"unknown env_type {env_type!r}; registered types: {', '.join(known_env_types())}, "
            "or an import path 'package.module:ClassName' to a TextEnv subclass"
        )
    cls = import_object(env_type, "env_type")
    if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
        raise ValueError(f"env_type {env_type!r} is {cls!r}, not a subclass of rollstream.shared.envs.base.TextEnv")
    return cls


def _check_env_config(cls: type[TextEnv], env_config: Mapping[str, Any]) -> None:
    """Every key must be a constructor keyword; max_actions_per_traj belongs to the tag, not env_config."""
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not takes_any and "max_actions_per_traj" not in params:
        raise ValueError(f"{cls.__qualname__}.__init__ must accept max_actions_per_traj")
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    valid = [name for name, p in params.items() if p.kind in named and name != "max_actions_per_traj"]
    for key in env_config:
        if key == "max_actions_per_traj":
            raise ValueError("max_actions_per_traj is set on the tag (next to env_type), not in env_config")
        if key not in valid and not takes_any:
            raise ValueError(f"unknown key {key!r} for {cls.__qualname__}; valid keys: {', '.join(valid)}")


def make_env(tag: str, custom_envs: Mapping[str, CustomEnvConfig]) -> TextEnv:
    """A new env for `tag`; errors name the tag, the key and what would be valid."""
    if tag not in custom_envs:
        raise ValueError(f"unknown env tag {tag!r}; known tags: {', '.join(sorted(custom_envs)) or '(none)'}")
    spec = custom_envs[tag]
    try:
        cls = resolve_env_type(spec.env_type)
    except ValueError as e:
        raise ValueError(f"custom_envs.{tag}.env_type: {e}") from e
    try:
        check_positive_int("max_actions_per_traj", spec.max_actions_per_traj)
    except ValueError as e:
        raise ValueError(f"custom_envs.{tag}.{e}") from e
    try:
        _check_env_config(cls, spec.env_config)
        env = cls(**spec.env_config, max_actions_per_traj=spec.max_actions_per_traj)
        env.use_templates(spec.agent_system_template, spec.agent_template)
        return env
    except ValueError as e:
        raise ValueError(f"custom_envs.{tag}.env_config: {e}") from e
