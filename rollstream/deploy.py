"""`rollstream deploy supervisor CONFIG --host NAME --out DIR`: one host's supervisord.conf from the one config.

DIR gets, all mode 0600 (secrets never land in a world-readable file, nor on a command line or in a log line):
- supervisord.conf: [group:producers] of one program per env-worker rank on this host, [group:engines] of one
  program per inference engine server on this host (vllm_server; start them before the producers),
  [program:trainer] on the trainer host (torchrun when it has several ranks), [program:redis] on the Redis host, and the
  [supervisord] / [unix_http_server] / [supervisorctl] / [rpcinterface:supervisor] sections;
- config.yaml: the resolved config the programs read, without redis.url (its password would leak);
- env: KEY=VALUE lines every program loads (`rollstream --env-file`): the Redis URL, the host's env, PYTHONPATH;
- redis.conf on the Redis host: deploy/redis.conf with this run's port, data dir and password.

Programs: autostart only for Redis (`supervisorctl start producers:*` / `start trainer` start the rest);
autorestart=unexpected with exitcodes=0, so a producer that exits 0 at the end of the experiment stays stopped
while a crashed one is restarted; stopsignal=TERM with a stopwaitsecs that covers a graceful stop;
stopasgroup/killasgroup, so no engine child process outlives its program.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from rollstream.shared.config import ConfigError, RollstreamConfig, to_yaml
from rollstream.shared.config_checks import num_engines
from rollstream.shared.hosts import HostRole, hosts_redis_url, plan_hosts, role_of
from rollstream.shared.layout import plan_layout
from rollstream.shared.redis_io import URL_ENV, resolve_url

REDIS_CONF = Path(__file__).resolve().parent.parent / "deploy" / "redis.conf"

START_SECS = 5
"""A program that exits sooner counts as a failed start (supervisord's startsecs): long enough for imports and
the first Redis round trip. Programs that end at once on purpose stay up this long (`--min-uptime`)."""
START_RETRIES = 5
PRODUCER_STOP_S = 45
"""A producer reports its unfinished episodes for up to 2 x 15 s after SIGTERM (worker.SHUTDOWN_REPORT_S)."""
ENGINE_STOP_S = 30
"""An engine SIGTERMs its vLLM server's process group and SIGKILLs it 5 s later (producer/engine.py)."""
TRAINER_STOP_S = 300
"""The trainer finishes its current step, commits it and saves nothing half-written; a large model's step is long."""
REDIS_STOP_S = 60
LOG_MAX = "50MB"
LOG_BACKUPS = 10


@dataclass(frozen=True)
class Program:
    name: str
    command: list[str]
    stopwaitsecs: int
    autostart: bool = False
    priority: int = 100


def programs(role: HostRole, python: str, conf_dir: Path, redis_server: str | None) -> list[Program]:
    """This host's programs, Redis first. Pure."""
    rollstream = [python, "-m", "rollstream", "--env-file", str(conf_dir / "env"), "--min-uptime", str(START_SECS)]
    config = str(conf_dir / "config.yaml")
    found: list[Program] = []
    if role.redis:
        assert redis_server is not None
        found.append(Program("redis", [redis_server, str(conf_dir / "redis.conf")], REDIS_STOP_S, True, 10))
    if role.trainer_ranks > 1:
        launcher = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(role.trainer_ranks), "--module",
                    "rollstream", *rollstream[3:]]
        found.append(Program("trainer", [*launcher, "trainer", config], TRAINER_STOP_S))
    elif role.trainer_ranks:
        found.append(Program("trainer", [*rollstream, "trainer", config], TRAINER_STOP_S))
    found += [Program(f"engine-{rank}", [*rollstream, "engine", config, "--engine-rank", str(rank)], ENGINE_STOP_S,
                      priority=50) for rank in role.engines]
    found += [Program(f"producer-{rank}", [*rollstream, "producer", config, "--worker-rank", str(rank)],
                      PRODUCER_STOP_S) for rank in role.env_workers]
    return found


def render_supervisord(role: HostRole, progs: list[Program], conf_dir: Path, log_dir: Path, cwd: Path,
                       exp_name: str) -> str:
    """The supervisord.conf text. Pure."""
    # umask 027: logs and outputs readable by the group, never by others; the secret files are 0600 regardless
    sections: list[tuple[str, dict[str, str]]] = [
        ("unix_http_server", {"file": str(conf_dir / "supervisor.sock"), "chmod": "0700"}),
        ("supervisord", {"logfile": str(log_dir / "supervisord.log"), "logfile_maxbytes": LOG_MAX,
                         "logfile_backups": str(LOG_BACKUPS), "loglevel": "info",
                         "pidfile": str(conf_dir / "supervisord.pid"), "childlogdir": str(log_dir),
                         "identifier": f"rollstream-{exp_name}-{role.name}", "umask": "027"}),
        ("rpcinterface:supervisor", {"supervisor.rpcinterface_factory":
                                     "supervisor.rpcinterface:make_main_rpcinterface"}),
        ("supervisorctl", {"serverurl": f"unix://{conf_dir / 'supervisor.sock'}"}),
    ]
    for p in progs:
        sections.append((f"program:{p.name}", {
            "command": " ".join(_quote(a) for a in p.command), "directory": str(cwd),
            "autostart": str(p.autostart).lower(), "autorestart": "unexpected", "exitcodes": "0",
            "startsecs": str(START_SECS), "startretries": str(START_RETRIES), "priority": str(p.priority),
            "stopsignal": "TERM", "stopwaitsecs": str(p.stopwaitsecs), "stopasgroup": "true", "killasgroup": "true",
            "redirect_stderr": "true", "stdout_logfile": str(log_dir / f"{p.name}.log"),
            "stdout_logfile_maxbytes": LOG_MAX, "stdout_logfile_backups": str(LOG_BACKUPS),
        }))
    for group, prefix in (("producers", "producer-"), ("engines", "engine-")):
        members = [p.name for p in progs if p.name.startswith(prefix)]
        if members:
            sections.append((f"group:{group}", {"programs": ",".join(members)}))
    header = (f"; rollstream {exp_name}, host {role.name}: written by `rollstream deploy supervisor`; regenerate "
              "rather than edit.\n; supervisord -c THIS; supervisorctl -c THIS start producers:* (and trainer)\n")
    body = "\n".join(f"[{name}]\n" + "".join(f"{k}={_escape(v)}\n" for k, v in options.items())
                     for name, options in sections)
    return header + "\n" + body


def _escape(value: str) -> str:
    # supervisord expands %(name)s in values: a literal % must be doubled
    return value.replace("%", "%%")


def _quote(arg: str) -> str:
    # supervisord splits `command` with shlex; paths with spaces need quotes
    return f'"{arg}"' if any(c.isspace() for c in arg) else arg


def program_url(cfg: RollstreamConfig) -> str:
    url = resolve_url(cfg.redis) or hosts_redis_url(cfg.hosts)
    if url is None:
        raise ConfigError("hosts.redis.host is unset and there is no redis.url or "
                          f"${URL_ENV}: say which host runs Redis, or where an external Redis is")
    return url


def env_file_text(values: dict[str, str]) -> str:
    for key, value in values.items():
        if "\n" in value or "=" in key or not key:
            raise ConfigError(f"environment variable {key!r}: names need no '=' and values no newline")
    return "".join(f"{k}={v}\n" for k, v in values.items())


def redis_conf_text(template: str, port: int, data_dir: Path, password: str | None) -> str:
    """deploy/redis.conf with this run's port, data dir and password. Pure.

    The template's own lines for those directives are dropped, not overridden: redis-server applies `dir` as it
    reads it, so the template's /var/lib path would have to exist."""
    settings = {"port": str(port), "dir": str(data_dir), "logfile": '""', "daemonize": "no"}
    if password:
        settings["requirepass"] = password
    kept = [line for line in template.splitlines() if line.split(" ", 1)[0] not in settings]
    return "\n".join([*kept, "", "# rollstream deploy supervisor: this run's settings",
                      *(f"{k} {v}" for k, v in settings.items())]) + "\n"


def write_supervisor(cfg: RollstreamConfig, host: str, out: Path) -> Path:
    """Write the host's files under `out`; returns the supervisord.conf path."""
    layout = plan_layout(cfg.train_env_manager, cfg.custom_envs, "train_env_manager")
    roles = plan_hosts(cfg.hosts, layout.num_workers, num_engines(cfg))
    role = role_of(roles, host)
    url = program_url(cfg)
    out = out.resolve()
    cwd = Path.cwd()
    log_dir = (Path(cfg.logging_dir) / role.name).resolve()
    redis_server = shutil.which("redis-server") if role.redis else None
    if role.redis and redis_server is None:
        raise ConfigError(f"host {host} runs Redis (hosts.redis.host) but redis-server is not on PATH here")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {URL_ENV: url, **role.env}
    if os.environ.get("PYTHONPATH"):  # programs import what this command imported
        env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
    _write_private(out / "env", env_file_text(env))
    _write_private(out / "config.yaml", to_yaml(replace(cfg, redis=replace(cfg.redis, url=None))))
    if role.redis:
        data = out / "redis-data"
        data.mkdir(exist_ok=True, mode=0o700)
        port = urlsplit(url).port or cfg.hosts.redis.port  # an explicit URL says where clients will look
        _write_private(out / "redis.conf", redis_conf_text(REDIS_CONF.read_text(), port, data,
                                                           urlsplit(url).password))
    progs = programs(role, sys.executable, out, redis_server)
    conf = out / "supervisord.conf"
    _write_private(conf, render_supervisord(role, progs, out, log_dir, cwd, cfg.exp_name))
    return conf


def _write_private(path: Path, text: str) -> None:
    """Created 0600 from the first byte: a secret is never readable by others, even briefly."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)
