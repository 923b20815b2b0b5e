"""ROLL's Hydra layout: a defaults list pulling shared env definitions, interpolated custom_envs and a hydra:
section compose without Hydra, for `config show` and for `rollstream run`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.shared.config import ConfigError, load_config
from rollstream.shared.config_load import load
from tests.conftest import REPO

HYDRA = REPO / "configs" / "roll" / "hydra"
PIPELINE = HYDRA / "agentic" / "agent_val_sokoban.yaml"


def test_the_hydra_example_composes_its_env_definitions() -> None:
    loaded = load(PIPELINE)
    cfg, notices = loaded.cfg, loaded.notices
    assert any(n.startswith("agent_val_sokoban.yaml: hydra: section unused") for n in notices)
    assert any(n.startswith("agent_system_template, agent_template, custom_env, env_manager_cls, "
                            "max_actions_per_traj, max_tokens_per_step: variables") for n in notices)
    larger = cfg.custom_envs["LargerSokoban"]
    assert (larger.env_type, larger.env_config["dim_room"], larger.max_actions_per_traj) == ("sokoban", [8, 8], 10)
    assert cfg.custom_envs["SokobanDifferentGridVocab"].env_config["grid_vocab"]["box_on_target"] == "√"
    assert cfg.actor_infer.generating_args.max_new_tokens == 128  # ${max_tokens_per_step}
    assert cfg.actor_train.strategy_args.strategy_config == {"zero_stage": 2}  # zero_optimization.stage
    assert set(cfg.val_layout.groups_per_tag()) == {"SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab",
                                                    "FrozenLake"}


def _pipeline(tmp_path: Path, head: str, body: str = "actor_infer: {}\n") -> Path:
    (tmp_path / "config").mkdir(exist_ok=True)
    shutil.copy(HYDRA / "config" / "traj_envs.yaml", tmp_path / "config" / "traj_envs.yaml")
    (tmp_path / "agentic").mkdir(exist_ok=True)
    path = tmp_path / "agentic" / "pipeline.yaml"
    path.write_text(head + body)
    return path


@pytest.mark.parametrize(("head", "message"), [
    ("defaults:\n  - ../config/missing@_here_\n", "defaults entry '../config/missing@_here_': no file"),
    ("defaults:\n  - db: mysql\n", "selects a Hydra config-group option"),
    ("defaults:\n  - override hydra/launcher: basic\n", "Hydra overrides are not read"),
    ("defaults:\n  - pipeline\n", "its defaults list includes itself"),
    ("defaults: ../config/traj_envs\n", "defaults must be a list of files"),
    ("defaults:\n  - ../config/traj_envs@_here_\nmax_actions_per_traj: 5\n", None),
])
def test_defaults_entries_rollstream_cannot_compose_are_one_line(tmp_path: Path, head: str,
                                                                  message: str | None) -> None:
    path = _pipeline(tmp_path, head)
    if message is None:  # a variable set in the primary file wins over the included one
        cfg = load_config(path, ["custom_envs.SimpleSokoban='${custom_env.SimpleSokoban}'"])
        assert cfg.custom_envs["SimpleSokoban"].max_actions_per_traj == 5
        return
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_hydra_layout_config_runs(tmp_path: Path) -> None:
    body = """
hydra:
  run: {dir: .}
exp_name: hydra_run
max_steps: 2
rollout_batch_size: 8
wandb_mode: disabled
actor_infer:
  strategy_args: {strategy_name: scripted}
train_env_manager: {max_env_num_per_worker: 8, num_env_groups: 2, group_size: 4, tags: [SimpleSokoban, FrozenLake]}
custom_envs:
  SimpleSokoban: ${custom_env.SimpleSokoban}
  FrozenLake: ${custom_env.FrozenLake}
"""
    path = _pipeline(tmp_path, "defaults:\n  - ../config/traj_envs@_here_\n", body)
    env = dict(os.environ)
    env.pop("ROLLSTREAM_REDIS_URL", None)
    proc = subprocess.run([sys.executable, "-m", "rollstream", "run", str(path), f"output_dir={tmp_path / 'out'}",
                           "redis.block_ms=200"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer done: version 2" in proc.stderr
    assert "hydra: section unused" in proc.stderr  # the notices are logged by run too


def test_roll_env_definitions_shape_prompts_and_parsing() -> None:
    from rollstream.shared.envs.registry import make_env

    loaded = load(PIPELINE)
    assert "custom_envs.SimpleSokoban.max_steps=10: read as max_actions_per_traj" in loaded.notices
    assert any(n.startswith("custom_envs.SimpleSokoban.env_config.max_steps=100: the episode ends after")
               for n in loaded.notices)
    env = make_env("SimpleSokoban", loaded.cfg.custom_envs)
    observation, _ = env.reset(seed=3)
    assert env.system_prompt().startswith("You're a helpful assistant. You are a good game player.")
    assert "Actions: Up, Down, Left, Right." in env.system_prompt()
    message = env.turn_message(1, observation, 64)
    assert message.startswith(f"Turn 1:\nState:\n{observation}\nYou have 10 actions left.")
    assert "Max response length: 64 words (tokens)." in message
    # action_pattern: the first <answer> anywhere in the reply, as ROLL reads it; format_penalty -0.05 otherwise
    *_, info = env.step("<think>go</think> then <answer>Left</answer> and more text")
    assert info["action"] == "Left"
    _, reward, *_ = env.step("Left")
    assert reward == -0.05
    # A tag without templates keeps the built-in prompts and the strict reply format.
    lake = make_env("FrozenLake", loaded.cfg.custom_envs)
    observation, _ = lake.reset(seed=0)
    assert lake.turn_message(1, observation, 64).startswith("Turn 1\nState:")
    assert lake.step("x <answer>Left</answer>")[4]["action"] is None
