"""The command line at its edges: clear one-line errors, exit codes, config show and status."""

import subprocess
import sys
from pathlib import Path

from rollstream.shared.embedded import free_port
from rollstream.shared.keys import Keys
from rollstream.shared.replay import replay_file
from tests.conftest import REPO

CONFIG = str(REPO / "configs" / "frozen_lake_scripted.yaml")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    full_env = dict(os.environ) | (env or {})
    full_env.pop("ROLLSTREAM_REDIS_URL", None) if env is None or "ROLLSTREAM_REDIS_URL" not in env else None
    return subprocess.run([sys.executable, "-m", "rollstream", *args], capture_output=True, text=True,
                          timeout=120, env=full_env)


def test_malformed_config_is_one_clear_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_infer: {}\nrollout_batch_size: 48\ntrain_env_manager:\n  group_size: 3\n"
                   "  max_env_num_per_worker: 16\n")
    proc = _cli("config", "show", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "train_env_manager.max_env_num_per_worker=16 is not a multiple of train_env_manager.group_size=3" \
        in proc.stderr


def test_unreachable_redis_names_the_url_and_what_to_check() -> None:
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    proc = _cli("trainer", CONFIG, env={"ROLLSTREAM_REDIS_URL": url})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "cannot reach Redis at redis://:***@127.0.0.1" in proc.stderr and "s3cret" not in proc.stderr
    assert "ROLLSTREAM_REDIS_URL" in proc.stderr


def test_config_show_prints_the_layout() -> None:
    proc = _cli("config", "show", CONFIG, "train_env_manager.max_env_num_per_worker=32")
    assert proc.returncode == 0, proc.stderr
    assert "workers: 2 (at most 32 envs each)" in proc.stdout
    assert "worker 1: 4 groups, 32 envs [g1:FrozenLake, g3:FrozenLake, g5:FrozenLake, g7:SimpleSokoban]" \
        in proc.stdout


def test_status_shows_backlog_and_counters(redis_server, redis_client) -> None:
    replay_file(redis_client, Keys.for_exp("st"), REPO / "tests" / "data" / "frozen_lake_scripted.msgpack")
    proc = _cli("status", "--redis", redis_server.url, "--exp", "st")
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split("  ", 1) for line in proc.stdout.splitlines() if "  " in line and ":" not in line[:3])
    assert lines["stream backlog (entries)"].strip() == "32"
    assert lines["groups in flight"].strip() == "4"
    assert lines["counters reconcile"].strip() == "yes"
    assert "no live env-workers" in proc.stdout


def test_debug_env_shows_prompts_replies_actions_and_rewards() -> None:
    proc = _cli("debug-env", CONFIG, "--tag", "SimpleSokoban", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--- system ---" in out and "Sokoban: push every box onto a target." in out
    assert out.count("--- user ---") == out.count("--- reply ---") == out.count("--- env ---") >= 1
    assert "reward=-0.10" in out and "=== " in out.splitlines()[-1]


def test_debug_env_human_policy_reads_replies_from_stdin() -> None:
    proc = subprocess.run([sys.executable, "-m", "rollstream", "debug-env", CONFIG, "--tag", "FrozenLake",
                           "--policy", "human", "custom_envs.FrozenLake.max_actions_per_traj=2"],
                          input="<answer>right</answer>\nnonsense\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "action=Right valid=True" in proc.stdout
    # Seed 0's map leaves room for a second move after Right, so the second reply is read and refused.
    assert "action=None valid=False reward=-0.10" in proc.stdout
    assert "truncated: score -0.10, success False, 2 turns, 1 valid actions" in proc.stdout
