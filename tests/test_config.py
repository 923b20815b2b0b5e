from pathlib import Path

import pytest

from rollstream.shared.config import ConfigError, load_config
from tests.conftest import REPO

CONFIG = REPO / "configs" / "frozen_lake_scripted.yaml"


def test_shipped_configs_load() -> None:
    for path in (REPO / "configs").glob("*.yaml"):
        load_config(path)


def test_overrides_apply_and_interpolate(tmp_path: Path) -> None:
    cfg = load_config(CONFIG, ["exp_name=abc", "rollout_batch_size=16", "train_env_manager.num_groups_partition=[4,4]"])
    assert cfg.exp_name == "abc"
    assert cfg.output_dir == "./output/abc"
    assert cfg.groups_per_batch == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("async_generation_ratio=-1", "async_generation_ratio=-1: must be an integer >= 0"),
        ("async_generation_ratio=0.5", "async_generation_ratio=0.5: must be an integer"),
        ("rollout_batch_size=30", "rollout_batch_size=30 is not a multiple of train_env_manager.group_size=8"),
        ("train_env_manager.num_groups_partition=[5,2]", "sums to 7 but train_env_manager.num_env_groups=8"),
        ("train_env_manager.num_groups_partition=[8]", "has 1 entries but train_env_manager.tags has 2"),
        ("train_env_manager.tags=[FrozenLake,Nope]", "'Nope', which custom_envs does not define; known tags"),
        ("train_env_manager.max_env_num_per_worker=12", "max_env_num_per_worker=12 is not a multiple of"),
        ("actor_infer.strategy_args.strategy_name=megatron", "must be 'scripted', 'hf_infer', 'vllm' or 'vllm_server'"),
        ("redis.block_ms=60000", "must stay below redis.socket_timeout_s"),
        ("weights_transport=s3", "weights_transport='s3': must be 'filesystem' or 'redis'"),
        ("weights_chunk_mb=0", "weights_chunk_mb=0: must be > 0.0"),
        ("val_sampled_episodes=-1", "val_sampled_episodes=-1: must be an integer >= 0"),
        ("val_sampled_maps=0", "val_sampled_maps=0: must be an integer >= 1"),
        ("max_steps=zero", "max_steps='zero': must be an integer"),
        ("no_such_key=1", "unknown key 'no_such_key'; valid keys: exp_name, seed,"),
    ],
)
def test_bad_values_name_key_value_and_what_is_valid(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [override])
    assert message in str(e.value)


def test_uneven_split_without_partition_suggests_one() -> None:
    with pytest.raises(ConfigError, match=r"does not split evenly over 2 tags \(1 left over\).*\[5, 4\]"):
        load_config(CONFIG, ["train_env_manager.num_groups_partition=null", "train_env_manager.num_env_groups=9"])


def test_validation_samples_only_its_first_maps_where_told() -> None:
    every = load_config(CONFIG, ["val_sampled_episodes=2"])
    assert [every.val_members(g) for g in (0, 3, 7)] == [3, 3, 3]
    first = load_config(CONFIG, ["val_sampled_episodes=2", "val_sampled_maps=4"])
    assert [first.val_members(g) for g in (0, 3, 4, 7)] == [3, 3, 1, 1]  # greedy only from map 4 on


def test_validation_rounds_come_every_eval_steps_and_before_step_0_unless_told() -> None:
    steps = range(9)
    assert [s for s in steps if load_config(CONFIG, ["eval_steps=4"]).validates_before(s)] == [0, 4, 8]
    later = load_config(CONFIG, ["eval_steps=4", "val_before_train=false"])
    assert [s for s in steps if later.validates_before(s)] == [4, 8]
    assert not any(load_config(CONFIG, ["eval_steps=0"]).validates_before(s) for s in steps)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_validation_group_size_must_be_one() -> None:
    with pytest.raises(ConfigError, match="val_env_manager.group_size=2"):
        load_config(CONFIG, ["eval_steps=5", "val_env_manager.group_size=2", "val_env_manager.tags=[FrozenLake]"])


def test_every_key_has_a_one_line_docstring_and_explain_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import fields, is_dataclass

    from rollstream.cli import main
    from rollstream.shared.config import RollstreamConfig
    from rollstream.shared.config_checks import STRATEGY_OPTIONS
    from rollstream.shared.config_docs import field_doc

    assert main(["config", "show", "--explain"]) == 0
    explained = capsys.readouterr().out
    pending = [RollstreamConfig, *[o for o in STRATEGY_OPTIONS.values() if is_dataclass(o)]]
    seen = set()
    while pending:
        cls = pending.pop()
        seen.add(cls)
        for f in fields(cls):
            doc = field_doc(cls, f.name)
            assert doc, f"{cls.__name__}.{f.name} has no docstring"
            assert f"{f.name}: " in explained and doc in explained
            annotation = cls.__pydantic_fields__[f.name].annotation
            if is_dataclass(annotation) and annotation not in seen:
                pending.append(annotation)


def test_a_strategy_named_anew_starts_from_its_own_options(tmp_path: Path) -> None:
    """The main job's vLLM options (gpu_memory_utilization, enforce_eager) do not follow a switch to hf_infer, whose
    check refuses them; options given with the new name apply, and naming the same strategy again keeps them."""
    main = REPO / "configs" / "frozen_lake.yaml"
    out = f"output_dir={tmp_path}"
    hf = load_config(main, [out, "actor_infer.strategy_args.strategy_name=hf_infer",
                            "actor_infer.strategy_args.strategy_config={device: cpu}"])
    assert hf.actor_infer.strategy_args.strategy_name == "hf_infer"
    assert hf.actor_infer.strategy_args.strategy_config == {"device": "cpu"}
    same = load_config(main, [out, "actor_infer.strategy_args.strategy_name=vllm"])
    assert same.actor_infer.strategy_args.strategy_config["enforce_eager"] is True
