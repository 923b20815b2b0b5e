"""The hosts section: ranks dealt to hosts, and one clear line naming the key for every bad section."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollstream.cli import main
from rollstream.shared.config import HostsConfig, MachineConfig, TrainerPlacement
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
