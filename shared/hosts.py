"""Which host runs what: the `hosts` section of the config, and its checks. Pure.

One config drives every host; `rollstream deploy supervisor CONFIG --host NAME` turns each host's share into
its supervisord programs. Env-worker ranks are those of the train env layout (0 .. workers - 1); each runs on
exactly one host, named in a list or dealt out to the hosts that say `auto`.

    hosts:
      redis: {host: host-a, port: 6379}   # or no host: Redis is external (redis.url / ROLLSTREAM_REDIS_URL)
      trainer: {host: host-a, ranks: 1}
      machines:
        host-a: {address: 10.0.0.1, env_workers: [0, 1], env: {CUDA_VISIBLE_DEVICES: "1"}}
        host-b: {address: 10.0.0.2, env_workers: auto}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollstream.shared.config import AUTO, ConfigError, HostsConfig


@dataclass(frozen=True)
class HostRole:
    """What one host runs."""
    name: str
    address: str
    redis: bool
    trainer_ranks: int
    """0 when the trainer runs elsewhere."""
    env_workers: tuple[int, ...]
    env: dict[str, str]
    engines: tuple[int, ...] = ()
    """Inference engine servers (vllm_server) this host runs."""


def plan_hosts(hosts: HostsConfig, num_workers: int, num_engines: int = 0) -> dict[str, HostRole]:
    """Check the hosts section against the env layout's `num_workers` ranks and the `num_engines` inference
    engines (vllm_server); what each host runs."""
    names = list(hosts.machines)
    if not names:
        if hosts.redis.host or hosts.trainer.host:
            raise ConfigError("hosts.machines is empty but hosts.redis/hosts.trainer name a host: list every host "
                              "under hosts.machines")
        return {}
    _known(hosts.redis.host, "hosts.redis.host", names, required=False)
    _known(hosts.trainer.host, "hosts.trainer.host", names, required=True)
    if hosts.trainer.ranks < 1:
        raise ConfigError(f"hosts.trainer.ranks={hosts.trainer.ranks}: must be an integer >= 1")
    if not 0 < hosts.redis.port < 65536:
        raise ConfigError(f"hosts.redis.port={hosts.redis.port}: must be a TCP port, 1..65535")
    ranks = _deal_ranks(hosts, num_workers)
    engines = _engine_ranks(hosts, num_engines)
    roles = {
        name: HostRole(name, m.address, name == hosts.redis.host,
                       hosts.trainer.ranks if name == hosts.trainer.host else 0, ranks[name], dict(m.env),
                       engines[name])
        for name, m in hosts.machines.items()
    }
    for role in roles.values():
        if not (role.redis or role.trainer_ranks or role.env_workers or role.engines):
            raise ConfigError(f"hosts.machines.{role.name} has nothing to run (no Redis, no trainer, no "
                              "env-workers): remove it, or give it env_workers")
    return roles


def _engine_ranks(hosts: HostsConfig, num_engines: int) -> dict[str, tuple[int, ...]]:
    """Each engine rank on exactly one host's `engines` list."""
    owner: dict[int, str] = {}
    for name, machine in hosts.machines.items():
        for rank in machine.engines:
            key = f"hosts.machines.{name}.engines"
            if not 0 <= rank < num_engines:
                raise ConfigError(f"{key} names engine {rank}, but the config has {num_engines} engines (ranks "
                                  f"0..{num_engines - 1}; only strategy_name vllm_server runs engines)")
            if rank in owner:
                raise ConfigError(f"engine {rank} is on two hosts: hosts.machines.{owner[rank]}.engines and {key}")
            owner[rank] = name
    missing = [r for r in range(num_engines) if r not in owner]
    if missing:
        raise ConfigError(f"engines {missing} are on no host: add them to a hosts.machines.<name>.engines list "
                          "(and their URLs to actor_infer.strategy_args.strategy_config.urls)")
    return {name: tuple(sorted(r for r, o in owner.items() if o == name)) for name in hosts.machines}


def _known(name: str | None, key: str, names: list[str], *, required: bool) -> None:

    if name is None:
        if required:
            raise ConfigError(f"{key} is unset: name the host (one of {', '.join(names)}) that runs it")
        return
    if name not in names:
        raise ConfigError(f"{key}={name!r} is not a host of hosts.machines; known hosts: {', '.join(names)}")


def _deal_ranks(hosts: HostsConfig, num_workers: int) -> dict[str, tuple[int, ...]]:
    """Listed ranks stay where they are; the rest are dealt in contiguous, even runs to the `auto` hosts."""
    owner: dict[int, str] = {}
    auto: list[str] = []
    listed: dict[str, list[int]] = {}
    for name, machine in hosts.machines.items():
        key = f"hosts.machines.{name}.env_workers"
        if machine.env_workers == AUTO:
            auto.append(name)
            listed[name] = []
            continue
        listed[name] = _rank_list(machine.env_workers, key, num_workers)
        for rank in listed[name]:
            if rank in owner:
                raise ConfigError(f"env-worker rank {rank} is on two hosts: hosts.machines.{owner[rank]}.env_workers "
                                  f"and {key}; give each rank to one host")
            owner[rank] = name
    rest = [r for r in range(num_workers) if r not in owner]
    if rest and not auto:
        raise ConfigError(f"env-worker ranks {rest} are on no host (the train layout has {num_workers} env-workers, "
                          f"ranks 0..{num_workers - 1}): add them to a hosts.machines.<name>.env_workers list, "
                          "or set one host's env_workers to auto")
    for i, name in enumerate(auto):
        share, extra = divmod(len(rest), len(auto))
        start = i * share + min(i, extra)
        listed[name] = rest[start:start + share + (i < extra)]
    return {name: tuple(sorted(ranks)) for name, ranks in listed.items()}


def _rank_list(value: Any, key: str, num_workers: int) -> list[int]:

    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                       for r in value):
        raise ConfigError(f"{key}={value!r}: must be a list of env-worker ranks (integers) or {AUTO!r}")
    bad = [r for r in value if not 0 <= r < num_workers]
    if bad:
        raise ConfigError(f"{key} names ranks {bad}, but the train layout has {num_workers} env-workers (ranks "
                          f"0..{num_workers - 1}); see `rollstream config show`")
    if len(set(value)) != len(value):
        raise ConfigError(f"{key}={list(value)} names a rank twice")
    return list(value)


def hosts_redis_url(hosts: HostsConfig) -> str | None:
    """redis://<address>:<port>/0 of the host that runs Redis, or None (no such host; no password: that comes
    with redis.url or ROLLSTREAM_REDIS_URL, which win over this)."""
    machine = hosts.machines.get(hosts.redis.host or "")
    return None if machine is None else f"redis://{machine.address}:{hosts.redis.port}/0"


def describe_hosts(roles: dict[str, HostRole]) -> str:
    """A few readable lines for `rollstream config show`."""
    lines = []
    for r in roles.values():
        parts = ["redis"] if r.redis else []
        parts += [f"trainer ({r.trainer_ranks} rank{'s' if r.trainer_ranks > 1 else ''})"] if r.trainer_ranks else []
        parts += [f"env-workers {list(r.env_workers)}"] if r.env_workers else []
        parts += [f"engines {list(r.engines)}"] if r.engines else []
        env = f"; env {', '.join(sorted(r.env))}" if r.env else ""
        lines.append(f"  {r.name} ({r.address}): {', '.join(parts)}{env}")
    return "\n".join(lines)


def role_of(roles: dict[str, HostRole], host: str) -> HostRole:
    """The named host's role; an error naming the known hosts otherwise."""
    if not roles:
        raise ConfigError("the config has no hosts section (hosts.machines): nothing to deploy; see "
                          "configs/two_hosts_scripted.yaml")
    if host not in roles:
        raise ConfigError(f"--host {host!r} is not a host of hosts.machines; known hosts: {', '.join(roles)}")
    return roles[host]
