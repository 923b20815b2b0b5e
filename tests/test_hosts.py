"""The hosts section: ranks dealt to hosts, and one clear line naming the key for every bad section."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollstream.cli import main
from rollstream.deploy import programs
from rollstream.shared.config import HostsConfig, MachineConfig, TrainerPlacement, load_config
from rollstream.shared.config_checks import num_engines
from rollstream.shared.engines import engine_plans, server_argv
from rollstream.shared.hosts import plan_hosts
from tests.conftest import REPO

TWO_HOSTS = REPO / "configs" / "two_hosts_scripted.yaml"


def test_listed_ranks_stay_and_the_rest_are_dealt_evenly_to_auto_hosts() -> None:
    hosts = HostsConfig(trainer=TrainerPlacement("a", 2), machines={
        "a": MachineConfig(env_workers=[4]), "b": MachineConfig(env_workers="auto"),
        "c": MachineConfig(env_workers="auto", env={"CUDA_VISIBLE_DEVICES": "1"})})
    roles = plan_hosts(hosts, 6)
    assert [roles[h].env_workers for h in "abc"] == [(4,), (0, 1, 2), (3, 5)]
    assert (roles["a"].trainer_ranks, roles["b"].trainer_ranks, roles["a"].redis) == (2, 0, False)
    assert roles["c"].env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert plan_hosts(HostsConfig(), 6) == {}  # no hosts section: one machine


@pytest.mark.parametrize(("overrides", "message"), [
    (["hosts.machines.host-b.env_workers=[2]"], "env-worker ranks [3] are on no host"),
    (["hosts.machines.host-b.env_workers=[1,2,3]"],
     "env-worker rank 1 is on two hosts: hosts.machines.host-a.env_workers and hosts.machines.host-b.env_workers"),
    (["hosts.trainer.host=host-c"], "hosts.trainer.host='host-c' is not a host of hosts.machines"),
    (["hosts.redis.host=hostA"], "hosts.redis.host='hostA' is not a host of hosts.machines"),
    (["hosts.machines.host-c.address=10.0.0.3"], "hosts.machines.host-c has nothing to run"),
    (["hosts.machines.host-b.env_workers=[2,3,9]"], "hosts.machines.host-b.env_workers names ranks [9]"),
    (["hosts.machines.host-b.env_workers=all"], "hosts.machines.host-b.env_workers='all': must be a list"),
    (["hosts.trainer.ranks=0"], "hosts.trainer.ranks=0: must be an integer >= 1"),
])
def test_a_bad_hosts_section_is_one_line_naming_the_key(capsys, overrides: list[str], message: str) -> None:
    assert main(["config", "show", str(TWO_HOSTS), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rollstream: error: "), err
    assert message in err


def test_deploy_to_an_unknown_host_is_one_line_without_a_traceback(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "rollstream", "deploy", "supervisor", str(TWO_HOSTS),
                           "--host", "host-z", "--out", str(tmp_path / "conf")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr == ("rollstream: error: --host 'host-z' is not a host of hosts.machines; known hosts: "
                           "host-a, host-b\n")
    assert not (tmp_path / "conf").exists()


FROZEN_LAKE = REPO / "configs" / "frozen_lake.yaml"
HOSTS = """
hosts:
  redis: {host: host-a}
  trainer: {host: host-a}
  machines:
    host-a: {address: 10.0.0.1, env_workers: [0], engines: [0]}
    host-b: {address: 10.0.0.2, env_workers: [1], engines: [1]}
train_env_manager: {max_env_num_per_worker: 32}
"""
ENGINES = ["actor_infer.strategy_args.strategy_name=vllm_server",
           "actor_infer.strategy_args.strategy_config={tensor_parallel_size: 2, host: 0.0.0.0, "
           "urls: ['http://10.0.0.1:8100', 'http://10.0.0.2:8200']}", "actor_infer.device_mapping=[4,5,6,7]"]


def engine_files(tmp_path) -> list[str]:
    (tmp_path / "hosts.yaml").write_text(HOSTS)
    return [str(FROZEN_LAKE), str(tmp_path / "hosts.yaml")]


def test_engines_take_tensor_parallel_slices_of_the_mapping_and_run_on_their_hosts(tmp_path) -> None:
    cfg = load_config(engine_files(tmp_path), ENGINES)
    assert num_engines(cfg) == 2
    plans = engine_plans(cfg)
    assert [(p.url, p.port, p.devices) for p in plans] == [("http://10.0.0.1:8100", 8100, "4,5"),
                                                            ("http://10.0.0.2:8200", 8200, "6,7")]
    argv = server_argv(cfg, plans[1], "/models/policy", cpu=False)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--port") + 1] == "8200"
    assert "--enable-scale-out" in argv and "--no-enable-chunked-prefill" not in argv  # chunking: vLLM's own on GPU
    roles = plan_hosts(cfg.hosts, cfg.train_layout.num_workers, num_engines(cfg))
    progs = {p.name: p for p in programs(roles["host-b"], "python", tmp_path, None)}
    assert progs["engine-1"].command[-4:] == ["engine", str(tmp_path / "config.yaml"), "--engine-rank", "1"]
    assert "engine-0" not in progs and progs["engine-1"].priority < progs["producer-1"].priority


@pytest.mark.parametrize(("overrides", "message"), [
    (["hosts.machines.host-b.engines=[]"], "engines [1] are on no host"),
    (["hosts.machines.host-b.engines=[0,1]"], "engine 0 is on two hosts"),
    (["actor_infer.device_mapping=[4,5,6]"], "3 GPUs do not split into engines of tensor_parallel_size=2"),
    (["actor_infer.device_mapping=[4,5]"], "has 2 URLs but there are 1 engines"),
])
def test_a_bad_engine_placement_is_one_line_naming_the_key(tmp_path, capsys, overrides: list[str],
                                                          message: str) -> None:
    assert main(["config", "show", *engine_files(tmp_path), *ENGINES, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rollstream: error: "), err
    assert message in err
