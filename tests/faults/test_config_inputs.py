"""Bad config input from outside: every one is one clear line naming the key (or file), exit code 2, no
traceback, and nothing started. Runs the real CLI entry point in-process (`rollstream.cli.main`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rollstream.cli import main
from rollstream.shared.config import as_dict, dump_config, load_config
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from tests.conftest import REPO

SCRIPTED = REPO / "configs" / "frozen_lake_scripted.yaml"
PASSWORD = "s3cret-pw"


class EnvThatCannotStart(FrozenLakeEnv):
    """A user's env whose constructor raises something other than a value error."""

    def __init__(self, **kwargs: Any) -> None:
        raise RuntimeError("this env cannot start")


def test_a_users_env_that_cannot_be_built_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _show(capsys, str(SCRIPTED), f"custom_envs.FrozenLake.env_type={__name__}:EnvThatCannotStart")
    _assert_one_line(code, err, "custom_envs.FrozenLake", "could not be built", "RuntimeError: this env cannot start")


def _show(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["config", "show", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("rollstream: error:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(("content", "fragments"), [
    (b"actor_infer: {}\nmax_steps: [1\n", ("YAML syntax error at line",)),
    (b"actor_infer: {}\ntrain_env_manager:\n\tgroup_size: 4\n", ("YAML syntax error", "not tabs")),
    (bytes(range(256)) * 4, ("is not UTF-8 text",)),
    (b"\x00\x01\x02garbage", ("YAML syntax error",)),
    (b"- actor_infer\n- max_steps\n", ("holds a list, not a mapping",)),
    (b"", ("is empty",)),
    (b"# only a comment\n", ("is empty",)),
    (b"max_steps: 3\n", ("no actor_infer section",)),
    (b"actor_infer: {}\ncustom_envs:\n  - FrozenLake\n", ("custom_envs=['FrozenLake']: must be a mapping",)),
], ids=["syntax", "tabs", "binary", "control-chars", "top-level-list", "empty", "comment-only", "no-actor_infer",
        "custom_envs-list"])
def test_unreadable_files_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes,
                                       fragments: tuple[str, ...]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    code, _, err = _show(capsys, str(path))
    _assert_one_line(code, err, *fragments)


@pytest.mark.parametrize(("override", "fragments"), [
    ("train_env_manager.num_env_groups=1000000000000", ("train_env_manager.num_env_groups=", "<= 100000")),
    ("custom_envs.FrozenLake.env_type=frozen_lakes", ("custom_envs.FrozenLake.env_type", "frozen_lake, sokoban")),
    ("custom_envs.FrozenLake.env_config.size=-4", ("custom_envs.FrozenLake.env_config", "size", "-4")),
    ("custom_envs.FrozenLake.env_config.sizes=4", ("custom_envs.FrozenLake.env_config", "'sizes'", "valid keys")),
    ("actor_infer.strategy_args.strategy_config.invalid_rate=0.1",
     ("actor_infer.strategy_args.strategy_config", "'invalid_rate'", "invalid_reply_rate")),
    ("actor_infer.strategy_args.strategy_config.invalid_reply_rate=2",
     ("actor_infer.strategy_args.strategy_config.invalid_reply_rate=2", "<= 1")),
    ("redis.heartbeat_s=0", ("redis.heartbeat_s=0", "must be > 0")),
    ("redis.read_count=0", ("redis.read_count=0", "must be an integer >= 1")),
    ("redis.url=localhost:6379", ("redis.url=", "redis://", "rediss://", "unix://")),
    ("redis.url=http://example.com", ("redis.url='http://example.com'", "redis://")),
    ("redis.url=redis://host:notaport", ("redis.url=", "not a URL")),
    ("sequence_length=-5", ("sequence_length=-5", ">= 1")),
    ("exp_name='a:b'", ("exp_name='a:b'", "colon")),
    ("exp_name='a b'", ("exp_name='a b'", "space")),
    ("exp_name='run*'", ("exp_name='run*'", "glob")),
    ("exp_name='run[1]'", ("exp_name=", "glob")),
    ("exp_name='r?n'", ("exp_name='r?n'", "glob")),
    ("actor_train.model_args.dtype=fp16", ("actor_train.model_args.dtype='fp16'", "'fp32' or 'bf16'")),
    ("adv_estimator=gae", ("adv_estimator='gae'", "critic")),
    ("lambd=0.95", ("lambd=0.95", "GAE")),
    ("no_such_key=1", ("unknown key 'no_such_key'",)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_values_name_key_value_and_what_is_valid(capsys: pytest.CaptureFixture[str], override: str,
                                                      fragments: tuple[str, ...]) -> None:
    code, _, err = _show(capsys, str(SCRIPTED), override)
    _assert_one_line(code, err, *fragments)


def test_valid_redis_urls_load() -> None:
    for url in ("redis://localhost:6379/0", "rediss://user:pw@host:6380/1", "unix:///tmp/redis.sock"):
        assert load_config(SCRIPTED, [f"redis.url={url}"]).redis.url == url


def _config_with_password(tmp_path: Path) -> Path:
    data = yaml.safe_load(SCRIPTED.read_text())
    data["redis"] = {"url": f"redis://default:{PASSWORD}@redis-host:6379/0?password={PASSWORD}"}
    path = tmp_path / "with_password.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_redis_password_is_never_shown_or_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _config_with_password(tmp_path)
    code, out, err = _show(capsys, str(path))
    assert code == 0, err
    assert PASSWORD not in out + err
    assert "redis://default:***@redis-host:6379/0?password=***" in out
    cfg = load_config(path)
    assert PASSWORD in str(cfg.redis.url)  # the real URL stays in memory, for connecting
    dump_config(cfg, tmp_path / "out" / "config.yaml")  # what `rollstream run` writes to output_dir
    assert PASSWORD not in (tmp_path / "out" / "config.yaml").read_text()
    assert PASSWORD not in repr(as_dict(cfg))  # what wandb gets as the run's config


def test_a_bad_password_url_error_does_not_print_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _show(capsys, str(SCRIPTED), f"redis.url=http://user:{PASSWORD}@host")
    _assert_one_line(code, err, "redis.url='http://user:***@host'")
    assert PASSWORD not in err


@pytest.mark.parametrize("override", [
    "actor_infer.strategy_args.strategy_config.no_such_option=1",
    "custom_envs.FrozenLake.env_config.size=0",
    "resume_from_checkpoint=/nonexistent/step_3",
])
def test_run_fails_before_any_process_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             override: str) -> None:
    out_dir = tmp_path / "out"
    code = main(["run", str(SCRIPTED), f"output_dir={out_dir}", override])
    _, err = capsys.readouterr()
    _assert_one_line(code, err, override.split("=")[0].rsplit(".", 1)[0])
    assert not out_dir.exists()  # no config written, no Redis, no process


def test_run_refuses_a_missing_pretrain_dir_that_config_show_only_warns_about(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hf.yaml"
    path.write_text("actor_infer:\n  strategy_args: {strategy_name: hf_infer}\n")
    args = [str(path), f"output_dir={tmp_path / 'out'}", f"pretrain={tmp_path / 'no_model'}"]
    code, out, err = _show(capsys, *args)
    assert code == 0, err
    assert "# warning (rollstream run refuses this here): pretrain=" in out
    code = main(["run", *args])
    _, err = capsys.readouterr()
    _assert_one_line(code, err, "pretrain=", "no Hugging Face model directory")
    assert not (tmp_path / "out").exists()
