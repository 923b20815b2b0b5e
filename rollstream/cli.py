"""The `rollstream` command. Errors become one clear line and an exit code here, at the edge."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

from rollstream.shared.codec import CodecError
from rollstream.shared.config import ConfigError, RollstreamConfig, TinyModelConfig, load_config, to_yaml
from rollstream.shared.config_checks import num_engines
from rollstream.shared.config_load import Loaded, load
from rollstream.shared.keys import TRAINER_CONSUMER
from rollstream.shared.redis_io import RedisDataLost, RedisUnavailable, connect, resolve_url

log = logging.getLogger("rollstream")

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the options (argparse stops a positional list at the first option)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*(args.overrides or []), *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:  # one line per HTTP request to the engine servers otherwise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.monotonic()
    try:
        if args.env_file:
            _load_env_file(args.env_file)
        code = int(args.func(args) or 0)
    except (ConfigError, RedisUnavailable, RedisDataLost, CodecError, FileNotFoundError) as e:
        print(f"rollstream: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if code == 0 and args.min_uptime:
        # supervisord counts an exit within startsecs as a failed start even with exit code 0; a producer
        # that finds the experiment finished must end as EXITED, not as FATAL after retries.
        time.sleep(max(0.0, args.min_uptime - _process_age(time.monotonic() - started)))
    if args.func is _trainer and _rank_of_a_launch():
        _leave_rank(code)
    return code


def _rank_of_a_launch() -> bool:
    from rollstream.consumer.learn.strategy import launched_world_size

    return launched_world_size() > 1


def _leave_rank(code: int) -> None:
    """End a rank of a multi-rank trainer whose work is done and whose process group is destroyed, skipping the
    interpreter's teardown: there gloo's and the TCPStore's C++ threads can still abort a finished rank
    ("terminate called without an active exception", SIGABRT, so the launcher reports a failure; seen once in
    a full test run, after `end_rank`)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _process_age(fallback: float) -> float:
    """Seconds since this process was spawned (Linux /proc; imports included), else `fallback`."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return fallback


def _load_env_file(path: str) -> None:
    """KEY=VALUE lines (from `rollstream deploy supervisor`) into this process's environment."""
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        raise ConfigError(f"--env-file {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--env-file {path} line {n}: expected KEY=VALUE")
        os.environ[key.strip()] = value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollstream", description="Asynchronous agentic RL on Redis Streams.")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--env-file", metavar="PATH", help="load KEY=VALUE lines into the environment first")
    parser.add_argument("--min-uptime", type=float, default=0.0, metavar="S",
                        help="on success, exit no sooner than S seconds after start (supervisord's startsecs)")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, func: Callable[[argparse.Namespace], int | None], help: str,
                config: str = "required") -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        if config == "required":
            p.add_argument("config", help="YAML config file")
        elif config == "optional":
            p.add_argument("config", nargs="?", help="YAML config file")
        if config != "none":
            p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
        p.set_defaults(func=func)
        return p

    p = command("run", _run, "run env-workers and trainer on this machine until max_steps")
    p.add_argument("--fresh", action="store_true", help="delete the experiment's keys in Redis first")
    p = command("producer", _producer, "run one env-worker process")
    p.add_argument("--worker-rank", type=int, required=True)
    p.add_argument("--episodes-per-group", type=int, default=None,
                   help="burst mode: each group plays this many episodes, then the worker exits")
    p = command("engine", _engine, "run one inference engine server (strategy_name vllm_server) and keep its "
                "weights at the newest published version")
    p.add_argument("--engine-rank", type=int, required=True)
    p = command("trainer", _trainer, "run the trainer")
    p.add_argument("--consumer", default=TRAINER_CONSUMER, help="stable consumer name in the stream's group")
    p = command("deploy", _deploy, "write one host's supervisord.conf from the config's hosts section "
                "(deploy supervisor CONFIG --host NAME --out DIR)", config="none")
    p.add_argument("target", choices=["supervisor"])
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--host", required=True, help="a host of hosts.machines")
    p.add_argument("--out", required=True, help="directory for supervisord.conf and its files")
    p = command("config", _config, "show: the resolved config, ROLL-key notices and the env layouts; "
                "show --explain: every key documented; roll-keys: the ROLL key table (markdown)", config="none")
    p.add_argument("action", choices=["show", "roll-keys"])
    p.add_argument("config", nargs="?", help="YAML config file (more files may follow; later ones win)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--explain", action="store_true", help="print every key with its type, default and meaning")
    p = command("status", _status, "backlog, pending, lag, versions, group counters and live workers",
                config="optional")
    _redis_target(p)
    p = command("record", _record, "copy the trajectory stream's backlog to a file (nothing is consumed)",
                config="optional")
    _redis_target(p)
    p.add_argument("--out", required=True, help="file to write")
    p.add_argument("--limit", type=int, default=None)
    p = command("debug-env", _debug_env, "play one env's episode in this process, showing every turn")
    p.add_argument("--tag", required=True)
    p.add_argument("--policy", choices=["scripted", "human", "llm"], default="scripted",
                   help="llm = the config's actor_infer backend")
    p.add_argument("--seed", type=int, default=0)
    p = command("tiny-model", _tiny_model, "build the offline tiny model with its format warm start",
                config="none")
    p.add_argument("out", help="directory to write the model and tokenizer to")
    p.add_argument("--tied", action="store_true", help="tie the input and output embeddings")
    p.add_argument("--sft-seconds", type=float, default=TinyModelConfig.sft_seconds)
    p.add_argument("--sft-steps", type=int, default=TinyModelConfig.sft_steps)
    p = command("replay", _replay, "push a recorded file into the trajectory stream", config="none")
    p.add_argument("file")
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    _redis_target(p)
    return parser


def _redis_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", metavar="URL", help="Redis URL (else from the config / ROLLSTREAM_REDIS_URL)")
    p.add_argument("--exp", metavar="NAME", help="experiment name (else exp_name from the config)")


def _files_and_overrides(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`CONFIG [MORE.yaml ...] [key=value ...]`: items without '=' are further config files."""
    rest = list(args.overrides or [])
    files = [args.config] if args.config else []
    return files + [a for a in rest if "=" not in a], [a for a in rest if "=" in a]


def _load_with_notices(args: argparse.Namespace) -> Loaded:
    files, overrides = _files_and_overrides(args)
    return load(files, overrides)


def _load(args: argparse.Namespace) -> RollstreamConfig:
    loaded = _load_with_notices(args)
    for notice in loaded.notices:
        log.info("config: %s", notice)
    return loaded.cfg


def _run(args: argparse.Namespace) -> int:
    from rollstream.launch import run_local

    return run_local(_load(args), fresh=args.fresh)


def _require_url(cfg: RollstreamConfig) -> str:
    from rollstream.shared.hosts import hosts_redis_url

    url = resolve_url(cfg.redis) or hosts_redis_url(cfg.hosts)
    if url is None:
        raise ConfigError("no Redis to connect to: set redis.url or ROLLSTREAM_REDIS_URL, or hosts.redis.host "
                          "(only `rollstream run` starts an embedded server)")
    return url


def _producer(args: argparse.Namespace) -> int:
    from rollstream.producer.main import run_producer

    cfg = _load(args)
    os.nice(cfg.env_worker_nice)  # inherited by the engine processes it starts
    run_producer(cfg, args.worker_rank, _require_url(cfg), episodes_per_group=args.episodes_per_group)
    return 0


def _engine(args: argparse.Namespace) -> int:
    from rollstream.producer.engine import run_engine

    cfg = _load(args)
    os.nice(cfg.env_worker_nice)
    run_engine(cfg, args.engine_rank, _require_url(cfg))
    return 0


def _trainer(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from rollstream.consumer.learn.distributed import Follower, LeaderLearner, end_rank, start_rank
    from rollstream.consumer.learn.rank_watch import RankLost
    from rollstream.consumer.learn.strategy import launched_world_size
    from rollstream.consumer.train import run_trainer

    # transformers draws a "Loading weights" bar per model it loads (the policy, the reference) under the run's
    # own progress bar; the run's bar is the one to watch.
    transformers_logging.disable_progress_bar()
    cfg = _load(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Handlers only set a flag; the loop drains. Ranks > 0 of a multi-rank launch ignore it and wait for
        # rank 0's stop message, which rank 0 sends once its loop has drained.
        signal.signal(sig, lambda *_: stop.set())
    learner: LeaderLearner | None = None
    if launched_world_size() > 1:  # torchrun / deepspeed: every rank runs this command
        rank = start_rank(cfg)
        if isinstance(rank, Follower):
            rank.run()
            end_rank()
            return 0
        learner = rank
    try:
        client = connect(_require_url(cfg), cfg.redis)
        summary = run_trainer(cfg, client, consumer=args.consumer, stop=stop, learner=learner)
    except RankLost as e:  # a multi-rank trainer lost a rank: one line naming it (rank_watch)
        print(f"rollstream: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if learner is not None:
            learner.close()  # run_trainer closes it too; a second close is a no-op, a missed one hangs the ranks
            end_rank()
    log.info("trainer done: version %d, groups %s%s", summary.last_version, summary.counters,
             f", curves in {summary.plot}" if summary.plot else "")
    return 0 if summary.last_version >= cfg.max_steps or stop.is_set() else 1


def _deploy(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rollstream.deploy import write_supervisor

    conf = write_supervisor(_load(args), args.host, Path(args.out))
    print(f"wrote {conf}\n  supervisord -c {conf}\n  supervisorctl -c {conf} start producers:*"
          + (f"\n  supervisorctl -c {conf} start trainer" if "[program:trainer]" in conf.read_text()
             else ""))
    return 0


def _debug_env(args: argparse.Namespace) -> int:
    from rollstream.producer.debug import debug_env

    cfg = _load(args)
    if args.tag not in cfg.custom_envs:
        raise ConfigError(f"--tag {args.tag!r} is not in custom_envs; known tags: {', '.join(cfg.custom_envs)}")
    debug_env(cfg, args.tag, args.policy, args.seed)
    return 0


def _tiny_model(args: argparse.Namespace) -> int:
    from rollstream.tiny_model import main_tiny_model

    main_tiny_model(args.out, TinyModelConfig(tie_word_embeddings=args.tied, sft_steps=args.sft_steps,
                                              sft_seconds=args.sft_seconds))
    return 0


def _config(args: argparse.Namespace) -> int:
    from rollstream.shared.config_checks import check_paths
    from rollstream.shared.config_docs import explain
    from rollstream.shared.layout import describe_layout
    from rollstream.shared.roll_keys import markdown_table

    if args.action == "roll-keys":
        print(markdown_table(), end="")
        return 0
    if args.explain and not args.config:
        print(explain(), end="")
        return 0
    if not args.config:
        raise ConfigError("config show needs a config file (or --explain alone for the documented keys)")
    loaded = _load_with_notices(args)
    cfg = loaded.cfg
    for notice in loaded.notices:
        print(f"# notice: {notice}")
    for problem in check_paths(cfg):
        print(f"# warning (rollstream run refuses this here): {problem}")
    print(to_yaml(cfg))
    print("# train_env_manager layout")
    print("# " + describe_layout(cfg.train_layout).replace("\n", "\n# "))
    if cfg.hosts.machines:
        from rollstream.shared.hosts import describe_hosts, plan_hosts

        print("# hosts")
        roles = plan_hosts(cfg.hosts, cfg.train_layout.num_workers, num_engines(cfg))
        print("# " + describe_hosts(roles).replace("\n", "\n# "))
    print("# val_env_manager layout" + ("" if cfg.eval_steps else " (eval_steps is 0: validation never runs)"))
    print("# " + describe_layout(cfg.val_layout).replace("\n", "\n# "))
    if args.explain:
        print(explain(), end="")
    return 0


def _target(args: argparse.Namespace) -> tuple[RollstreamConfig, str]:
    cfg = load_config(args.config, args.overrides or ()) if args.config else RollstreamConfig()
    if args.exp:
        cfg.exp_name = args.exp
    from rollstream.shared.hosts import hosts_redis_url

    url = args.redis or resolve_url(cfg.redis) or hosts_redis_url(cfg.hosts)
    if url is None:
        raise ConfigError("which Redis? pass --redis URL, set ROLLSTREAM_REDIS_URL, or give a config with redis.url")
    return cfg, url


def _status(args: argparse.Namespace) -> int:
    from rollstream.shared.keys import Keys
    from rollstream.shared.status import format_status, read_status

    cfg, url = _target(args)
    keys = Keys.for_exp(cfg.exp_name)
    print(format_status(read_status(connect(url, cfg.redis), keys), keys.ns))
    return 0


def _record(args: argparse.Namespace) -> int:
    from rollstream.shared.keys import Keys
    from rollstream.shared.replay import record_backlog

    cfg, url = _target(args)
    n = record_backlog(connect(url, cfg.redis), Keys.for_exp(cfg.exp_name), args.out, args.limit)
    print(f"recorded {n} entries to {args.out}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from rollstream.shared.keys import Keys
    from rollstream.shared.replay import replay_file

    cfg, url = _target(args)
    n = replay_file(connect(url, cfg.redis), Keys.for_exp(cfg.exp_name), args.file)
    print(f"replayed {n} entries into {Keys.for_exp(cfg.exp_name).traj}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
