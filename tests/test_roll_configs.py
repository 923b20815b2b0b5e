"""ROLL's configs read as they stand: each file under configs/roll/ loads with its notices; ROLL keys rollstream
cannot honour are refused with the rollstream way; the formerly ignored keys change behaviour or are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollstream.consumer.learn.policy_learner import UpdateSettings
from rollstream.consumer.learn.tensors import plan_shards
from rollstream.launch import _devices
from rollstream.producer.episode import Sampling
from rollstream.shared.config import ConfigError, load_config
from rollstream.shared.config_load import load
from rollstream.shared.roll_keys import markdown_table
from tests.conftest import REPO
from tests.learner.test_tensors import synthetic_batch

ROLL = REPO / "configs" / "roll"
WEBSHOP = ROLL / "agentic_val_webshop_async.yaml"
PARTITION = ROLL / "env_manager_partition.yaml"
PIPELINE = ROLL / "agent_val_frozen_lake_sokoban.yaml"
SCRIPTED = REPO / "configs" / "frozen_lake_scripted.yaml"


def _notice(notices: list[str], start: str) -> str:
    found = [n for n in notices if n.startswith(start)]
    assert len(found) == 1, notices
    return found[0]


def test_the_async_training_example_loads_with_a_notice_per_mapped_key() -> None:
    loaded = load(WEBSHOP)
    cfg, notices = loaded.cfg, loaded.notices
    assert "unused: env rewards are rule-based" in _notice(notices, "reward_pretrain=")
    assert "validation plays every val_env_manager group" in _notice(notices, "val_batch_size=64")
    assert "zero_stage 1" in _notice(notices, "actor_train.strategy_args.strategy_name='megatron_train'")
    assert "vLLM batches requests continuously" in _notice(notices, "actor_infer.infer_batch_size=1")
    assert "one trainer rank" in _notice(notices, "actor_train.device_mapping=[0, 1, 2, 3]")
    assert len(notices) == 5
    train, infer = cfg.actor_train, cfg.actor_infer
    assert (train.strategy_args.strategy_name, train.strategy_args.strategy_config) == ("deepspeed_train",
                                                                                         {"zero_stage": 1})
    assert train.model_args.disable_gradient_checkpointing is False  # recompute_granularity: full
    assert train.model_args.attn_implementation == "flash_attention_2"  # fa2
    assert (train.device_mapping, infer.device_mapping) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert train.infer_batch_size == 1 and infer.infer_batch_size is None
    assert infer.strategy_args.strategy_config == {"gpu_memory_utilization": 0.8,
                                                   "engine_kwargs": {"block_size": 16, "load_format": "auto"}}
    assert (infer.generating_args.max_new_tokens, infer.generating_args.top_k) == (1024, 100)
    assert (cfg.async_generation_ratio, cfg.sequence_length, cfg.eval_steps) == (1, 8192, 10)


def test_the_env_manager_fragment_layers_on_a_full_config_and_alone_says_so() -> None:
    cfg = load_config([WEBSHOP, PARTITION])
    assert (len(cfg.train_layout.groups), cfg.train_layout.num_workers) == (128, 64)
    assert cfg.val_layout.groups_per_tag() == {"SimpleSokoban": 256, "LargerSokoban": 256,
                                               "SokobanDifferentGridVocab": 256, "FrozenLake": 256}
    assert cfg.val_layout.num_workers == 32
    with pytest.raises(ConfigError, match="no actor_infer section.*layer it after a full config"):
        load_config(PARTITION)


def test_the_key_table_example_loads() -> None:
    loaded = load(PIPELINE)
    cfg = loaded.cfg
    assert "the KL reference is pretrain's weights" in _notice(loaded.notices, "reference:")
    assert cfg.val_layout.groups_per_tag() == {"SimpleSokoban": 64, "LargerSokoban": 64,
                                               "SokobanDifferentGridVocab": 64, "FrozenLake": 64}
    assert cfg.custom_envs["FrozenLake"].env_config == {"is_slippery": False}  # the written tag replaces the preset
    assert cfg.actor_train.model_args.model_type == "causal_lm"
    assert cfg.actor_train.infer_batch_size == 4
    assert cfg.render_save_dir == "./output/render"


def test_the_seed_tags_exist_by_default() -> None:
    cfg = load_config(SCRIPTED, ["train_env_manager.tags=[LargerSokoban,SokobanDifferentGridVocab]",
                                 "train_env_manager.num_groups_partition=[4,4]"])
    assert cfg.train_layout.groups_per_tag() == {"LargerSokoban": 4, "SokobanDifferentGridVocab": 4}
    assert cfg.custom_envs["LargerSokoban"].env_config["dim_room"] == [10, 10]
    # An override of one preset key edits the preset rather than replacing it.
    cfg = load_config(SCRIPTED, ["custom_envs.LargerSokoban.env_config.num_boxes=3"])
    assert cfg.custom_envs["LargerSokoban"].env_type == "sokoban"
    assert cfg.custom_envs["LargerSokoban"].env_config["num_boxes"] == 3


@pytest.mark.parametrize(("value", "expected"), [
    ("list(range(4,8))", [4, 5, 6, 7]), ("list(range(2))", [0, 1]), ("[0,1]+list(range(4,6))", [0, 1, 4, 5]),
    ("[3, 1]", [3, 1]),
])
def test_device_lists_read_as_roll_writes_them(value: str, expected: list[int]) -> None:
    assert load_config(SCRIPTED, [f"actor_infer.device_mapping='{value}'"]).actor_infer.device_mapping == expected


@pytest.mark.parametrize("value", ["__import__('os').system('true')", "list(range(0,4,0))", "range(4)", "[1.5]"])
def test_anything_else_in_a_device_list_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"actor_infer\.device_mapping=.*cannot read .* as a list of integers"):
        load_config(SCRIPTED, [f"actor_infer.device_mapping=\"{value}\""])


@pytest.mark.parametrize(("override", "message"), [
    ("lambd=0.95", "lambd=0.95: GAE's lambda needs a critic"),
    ("target_kl=0.1", "target_kl=0.1: adaptive KL control is not implemented"),
    ("critic={strategy_args: {strategy_name: megatron_train}}", "critic=.*no critic"),
    ("adv_estimator=gae", "adv_estimator='gae': GAE needs a critic"),
    ("actor_infer.strategy_args.strategy_name=sglang", "sglang.*use vllm"),
    ("actor_infer.generating_args.num_return_sequences=4", "num_return_sequences=4: must be 1"),
    ("actor_infer.generating_args.num_beams=4", "num_beams=4: must be 1"),
    ("actor_train.model_args.model_type=value_head", "model_type='value_head': must be 'causal_lm'"),
    ("custom_envs.FrozenLake.agent_template='Turn {turn}'",
     r"custom_envs.FrozenLake.agent_template='Turn \{turn\}': cannot fill the template.*\{turn_idx\}"),
    ("custom_envs.FrozenLake.env_config.action_pattern='<answer>(.*'",
     "custom_envs.FrozenLake.env_config: action_pattern '<answer>.*' is not a regular expression"),
])
def test_roll_keys_rollstream_cannot_honour_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(SCRIPTED, [override])


def test_megatron_parallelism_is_refused_with_the_deepspeed_way(tmp_path: Path) -> None:
    path = tmp_path / "mt.yaml"
    path.write_text("actor_infer: {}\nactor_train:\n  strategy_args:\n    strategy_name: megatron_train\n"
                    "    strategy_config: {tensor_model_parallel_size: 2}\n")
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2: .*data parallel only.*zero_stage 3"):
        load_config(path)


def test_rolls_default_group_filter_reads_as_keeping_every_group() -> None:
    loaded = load(SCRIPTED, ["train_env_manager.group_filter_cls=roll.pipeline.agentic.agentic_pipeline.GroupFilter"])
    assert loaded.cfg.train_env_manager.group_filter_cls is None
    assert "ROLL's default keeps every group" in _notice(loaded.notices, "train_env_manager.group_filter_cls=")


def test_max_new_tokens_caps_every_reply() -> None:
    cfg = load_config(SCRIPTED, ["actor_infer.generating_args.max_new_tokens=16"])
    assert cfg.custom_envs["FrozenLake"].max_tokens_per_step == 64
    assert cfg.reply_tokens("FrozenLake") == 16  # validation's greedy member
    assert Sampling.training(64, cfg.actor_infer.generating_args).max_tokens == 16  # train episodes
    uncapped = load_config(SCRIPTED)
    assert uncapped.reply_tokens("FrozenLake") == 64
    assert Sampling.training(64, uncapped.actor_infer.generating_args).max_tokens == 64


def test_device_mapping_sets_each_process_gpus() -> None:
    cfg = load_config(SCRIPTED, ["actor_train.device_mapping='list(range(0,2))'",
                                 "actor_infer.device_mapping='list(range(4,8))'"])
    assert _devices({}, cfg, "actor_train", 0) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert [_devices({}, cfg, "actor_infer", r)["CUDA_VISIBLE_DEVICES"] for r in range(5)] == ["4", "5", "6", "7", "4"]
    assert _devices({"X": "1"}, load_config(SCRIPTED), "actor_infer", 0) == {"X": "1"}  # unset: left alone


def test_device_mapping_gives_each_vllm_engine_tensor_parallel_gpus(tmp_path: Path) -> None:
    path = tmp_path / "tp.yaml"
    path.write_text(f"pretrain: {tmp_path}\nactor_infer:\n  device_mapping: list(range(0,4))\n  strategy_args:\n"
                    "    strategy_name: vllm\n    strategy_config: {tensor_parallel_size: 2}\n")
    cfg = load_config(path)
    assert [_devices({}, cfg, "actor_infer", r)["CUDA_VISIBLE_DEVICES"] for r in range(3)] == ["0,1", "2,3", "0,1"]
    with pytest.raises(ConfigError, match=r"actor_infer.device_mapping=\[0, 1, 2\]: 3 GPUs do not split"):
        load_config(path, ["actor_infer.device_mapping=[0,1,2]"])


def test_actor_train_infer_batch_size_sizes_the_no_grad_logprob_forwards() -> None:
    tokens = synthetic_batch([10, 12, 14, 16, 18, 20])
    plan = dict(epochs=1, minibatch_size=6, max_tokens=0, max_rows=6)
    default, = plan_shards(tokens, 1, generator=torch.Generator().manual_seed(0), **plan)
    sized, = plan_shards(tokens, 1, generator=torch.Generator().manual_seed(0), logprob_rows=2, **plan)
    assert [len(m) for m in default.logprob_microbatches] == [6]
    assert [len(m) for m in sized.logprob_microbatches] == [2, 2, 2]
    assert [len(m) for m in sized.steps[0].microbatches] == [6]  # the training micro-batches are unchanged
    cfg = load_config(SCRIPTED, ["actor_train.infer_batch_size=2"])
    assert UpdateSettings.from_config(cfg).logprob_rows == 2


def test_docs_roll_keys_is_generated_from_the_table() -> None:
    assert (REPO / "docs" / "roll_keys.md").read_text() == markdown_table()


@pytest.mark.parametrize("files", [[WEBSHOP], [WEBSHOP, PARTITION], [PIPELINE]], ids=["webshop", "layered", "table"])
def test_config_show_accepts_each_roll_config(capsys: pytest.CaptureFixture[str], files: list[Path]) -> None:
    from rollstream.cli import main

    assert main(["config", "show", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert "# notice: reward_pretrain=" in out and "# warning (rollstream run refuses this here): pretrain=" in out
