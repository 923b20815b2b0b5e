"""The learner's config keys: defaults, and errors that name the key, the value and what is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.consumer.learn.strategy import ModelSettings, OptimSettings, make_strategy
from rollstream.consumer.learn.strategy.deepspeed_strategy import ds_config
from rollstream.shared.config import ConfigError, load_config


def test_defaults_load_without_a_model() -> None:
    cfg = load_config(None, [])
    assert (cfg.old_logprobs, cfg.adv_std_normalize, cfg.adv_clip, cfg.is_ratio_cap) == ("engine", "group", None, 3.0)
    assert cfg.actor_train.training_args.max_grad_norm == 1.0
    assert cfg.actor_train.training_args.max_tokens_per_microbatch == 0


@pytest.mark.parametrize(("override", "message"), [
    ("old_logprobs=trainer", "old_logprobs='trainer': must be 'engine' or 'recompute'"),
    ("adv_std_normalize=batch", "adv_std_normalize='batch': must be 'group' or 'none'"),
    ("adv_std_floor=0", "adv_std_floor=0: must be > 0"),
    ("adv_clip=-1", "adv_clip=-1: must be > 0"),
    ("is_ratio_cap=1", "is_ratio_cap=1: must be > 1"),
    ("gamma=1.5", "gamma=1.5: must be <= 1"),
    ("init_kl_coef=-0.1", "init_kl_coef=-0.1: must be >= 0"),
    ("pg_clip_low=1", "pg_clip_low=1: must be < 1"),
    ("pg_clip_high=0", "pg_clip_high=0: must be > 0"),
    ("early_stop_kl=0", "early_stop_kl=0: must be > 0"),
    ("kl_anchor_valid_rate=0", "kl_anchor_valid_rate=0: must be > 0"),
    ("kl_anchor_valid_rate=1.5", "kl_anchor_valid_rate=1.5: must be <= 1"),
    ("kl_anchor_coef=0", "kl_anchor_coef=0: must be > 0"),
    ("entropy_target=-1", "entropy_target=-1: must be > 0"),
    ("entropy_coef_max=0", "entropy_coef_max=0: must be > 0"),
])
def test_bad_learning_values_are_named(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [override])


@pytest.mark.parametrize(("override", "message"), [
    ("actor_train.training_args.lr_scheduler_type=polynomial",
     "lr_scheduler_type='polynomial': must be 'constant', 'linear' or 'cosine'"),
    ("actor_train.model_args.dtype=fp16", "dtype='fp16': must be 'fp32' or 'bf16'"),
    ("actor_train.training_args.per_device_train_batch_size=0", "per_device_train_batch_size=0: must be an integer"),
    ("actor_train.training_args.max_grad_norm=-1", "max_grad_norm=-1: must be >= 0"),
    ("actor_train.training_args.adam_beta2=1", "adam_beta2=1: must be < 1"),
    ("actor_train.training_args.adam_epsilon=0", "adam_epsilon=0: must be > 0"),
])
def test_bad_training_values_are_named(tmp_path: Path, override: str, message: str) -> None:
    base = [f"pretrain={tmp_path}", "actor_train.strategy_args.strategy_name=torch_train"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, override])


def test_adam_settings_reach_both_strategies_optimizers(tiny_model: Path) -> None:
    cfg = load_config(None, [f"pretrain={tiny_model}", "actor_train.strategy_args.strategy_name=torch_train",
                             "actor_train.strategy_args.strategy_config={device: cpu}",
                             "actor_train.training_args.adam_beta2=0.99",
                             "actor_train.training_args.adam_epsilon=1e-6"])
    optim = OptimSettings.from_config(cfg)
    assert (optim.betas, optim.eps) == ((0.9, 0.99), 1e-6)
    torch_group = make_strategy(cfg).optimizer.param_groups[0]  # type: ignore[attr-defined]
    assert (torch_group["betas"], torch_group["eps"]) == ((0.9, 0.99), 1e-6)
    params = ds_config(ModelSettings.from_config(cfg), optim, zero_stage=2, micro_batch_size=1)["optimizer"]["params"]
    assert (params["betas"], params["eps"]) == ([0.9, 0.99], 1e-6)
    assert OptimSettings.from_config(load_config(None, [])).betas == (0.9, 0.999)  # torch's defaults unless set


def test_an_adaptive_entropy_bonus_cannot_start_above_its_ceiling() -> None:
    with pytest.raises(ConfigError, match="entropy_loss_coef=0.01 is above entropy_coef_max=0.005"):
        load_config(None, ["entropy_target=0.3", "entropy_loss_coef=0.01"])
    assert load_config(None, ["entropy_loss_coef=0.01"]).entropy_target is None  # a fixed bonus has no ceiling


def test_pg_clip_range_is_rolls() -> None:
    """pg_clip on both sides unless use_pg_clip_range, then pg_clip_low and pg_clip_high (ROLL's keys)."""
    assert load_config(None, ["pg_clip=0.3", "pg_clip_high=0.28"]).pg_clip_range == (0.3, 0.3)
    assert load_config(None, ["use_pg_clip_range=true", "pg_clip_high=0.28"]).pg_clip_range == (0.2, 0.28)


def test_a_training_strategy_needs_pretrain() -> None:
    with pytest.raises(ConfigError, match="pretrain is unset"):
        load_config(None, ["actor_train.strategy_args.strategy_name=deepspeed_train"])


def test_actor_infer_infer_batch_size_sizes_hf_infer_batches(tiny_model: Path) -> None:
    from rollstream.producer.policy.factory import make_policy

    cfg = load_config(None, [f"pretrain={tiny_model}", "actor_infer.strategy_args.strategy_name=hf_infer",
                             "actor_infer.infer_batch_size=3"])
    assert make_policy(cfg).max_batch_size == 3  # type: ignore[attr-defined]
    cfg = load_config(None, [f"pretrain={tiny_model}", "actor_infer.strategy_args.strategy_name=hf_infer"])
    assert make_policy(cfg).max_batch_size == 64  # type: ignore[attr-defined]
