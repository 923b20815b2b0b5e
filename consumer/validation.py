"""Validation rounds: pause train admission, have the workers play the val envs once, score them, resume.

Round n plays a fixed set of held-out episodes (the seed of val group g is a function of (seed, g) only, so
every round plays the same maps and rounds compare): each map once greedily (`val/...`) and
`val_sampled_episodes` times sampled as in training (`val_sampled/...`; on the first `val_sampled_maps` only,
where set). Val trajectories travel on their own stream, `<ns>:val`, so they can never enter a train batch.

A round is collected on a thread, so the trainer trains step n's batch while the workers play round n; it
publishes version n + 1 only once the round is in, so every episode of round n is played by version n
(`val/off_version` counts any that was not).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import redis

from rollstream.consumer.data.batch_stats import per_tag_stats
from rollstream.consumer.data.reader import StreamReader
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.keys import TRAINER_GROUP, Keys
from rollstream.shared.ledger import add_control
from rollstream.shared.messages import ControlMessage, PausedRound, ValidationEnded, ValidationStarted
from rollstream.shared.schema import VAL_GREEDY_MEMBER, GroupDropNotice, Trajectory, parse_group_id
from rollstream.shared.seeding import held_out_seed

log = logging.getLogger(__name__)

RECORD_MAPS = 64
"""Validation's map count until 2026-12-05: a round over more maps also reports greedy success on its first
RECORD_MAPS (the same maps, since a val group's map depends only on its index), so a curve on more maps still
reads against the FrozenLake record kept on these (docs/learning.md)."""


class Validator:
    def __init__(self, client: redis.Redis, cfg: RollstreamConfig, consumer: str, stop: threading.Event) -> None:
        """`stop`: the trainer's; once set, a round in progress is abandoned."""
        self.client = client
        self.cfg = cfg
        self.keys = Keys.for_exp(cfg.exp_name)
        self.expected = sum(cfg.val_members(g.group_index) for g in cfg.val_layout.groups)
        self.reader = StreamReader(client, self.keys, self.keys.val, consumer,
                                   count=cfg.redis.read_count, block_ms=cfg.redis.block_ms)
        client.delete(self.keys.paused)  # a trainer that died mid-round must not leave producers paused
        self.references = reference_stats(cfg)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validation")
        self._stop = stop
        self._closing = threading.Event()

    def start(self, round_: int, version: int) -> Future[dict[str, float]]:
        """Begin round `round_` at policy `version` and collect it on a thread; the future holds its `val/...`
        metrics, none if a stop ended the round first. Train admission stays paused until the round is in.
        Publish no newer version before then: the workers load new weights as they are announced, and the whole
        round is to be played by `version`."""
        started = time.monotonic()
        # The flag holds the round too, so a worker that starts mid-round still plays its share.
        self.client.set(self.keys.paused, PausedRound(round_, version).value())
        self._announce(ValidationStarted(round_, version))
        return self._thread.submit(self._finish, round_, version, started)

    def run(self, round_: int, version: int) -> dict[str, float]:
        """One round at policy `version`, waited for; returns `val/...` metrics (none if a stop ended it)."""
        return self.start(round_, version).result()

    def close(self) -> None:
        """Abandon a round still in flight (its pause is lifted) and end the thread."""
        self._closing.set()
        self._thread.shutdown(wait=True)

    def _finish(self, round_: int, version: int, started: float) -> dict[str, float]:
        try:
            collected = self._collect(round_)
        finally:
            self.client.delete(self.keys.paused)
            self._announce(ValidationEnded(round_))
        if collected is None:
            return {}  # abandoned: the part played is not the round
        trajs, failed = collected
        greedy = [t for t in trajs if t.member == VAL_GREEDY_MEMBER]
        sampled = [t for t in trajs if t.member != VAL_GREEDY_MEMBER]
        stats = per_tag_stats("val", greedy) | per_tag_stats("val_sampled", sampled) | self.references
        if len(self.cfg.val_layout.groups) > RECORD_MAPS:
            stats |= first_maps_success(greedy, RECORD_MAPS)
        # Not the round's version: a turn from other weights (none, while the trainer holds publication back).
        off_version = sum(any(turn.version != version for turn in t.turns) for t in trajs)
        stats |= {"val/episodes": float(len(trajs)), "val/failed": float(failed),
                  "val/missing": float(self.expected - len(trajs) - failed), "val/off_version": float(off_version),
                  "time/val_s": time.monotonic() - started}
        return stats

    def _announce(self, message: ControlMessage) -> None:
        add_control(self.client, self.keys.control, message)

    def _collect(self, round_: int) -> tuple[list[Trajectory], int] | None:
        """The round's trajectories and its failed episodes, once all are in or group_timeout_s has passed;
        None if the trainer's stop or close() ended the collection first."""
        deadline = time.monotonic() + self.cfg.group_timeout_s
        trajs: dict[str, Trajectory] = {}
        failed: Counter[str] = Counter()  # notices per group: one per failed member

        def done() -> int:
            return len(trajs) + sum(min(n, self.cfg.val_members(parse_group_id(g)[2])) for g, n in failed.items())

        while done() < self.expected and time.monotonic() < deadline:
            if self._stop.is_set() or self._closing.is_set():
                return None
            entries = self.reader.read()
            for entry in entries:
                item = entry.item
                if _round_of(item.group_id) != round_:
                    continue  # left over from an interrupted round
                if isinstance(item, GroupDropNotice):
                    failed[item.group_id] += 1
                else:
                    trajs[item.traj_id] = item  # a worker restarted mid-round plays its share again
            if entries:
                ids = [e.entry_id for e in entries]
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.xack(self.keys.val, TRAINER_GROUP, *ids)
                    pipe.xdel(self.keys.val, *ids)
                    pipe.execute()
        if done() < self.expected:
            log.warning("validation round %d: %d of %d episodes arrived within group_timeout_s",
                        round_, done(), self.expected)
        return list(trajs.values()), done() - len(trajs)


def first_maps_key(maps: int) -> str:
    """The metric of greedy success on a round's first `maps` maps."""
    return f"val_first{maps}/success"


def first_maps_success(greedy: list[Trajectory], maps: int) -> dict[str, float]:
    """`first_maps_key(maps)`: greedy success on the val groups with index below `maps`."""
    head = [t.success for t in greedy if t.group_index < maps]
    return {first_maps_key(maps): sum(head) / len(head)} if head else {}


def reference_stats(cfg: RollstreamConfig) -> dict[str, float]:
    """`val/<tag>/ref_<policy>`: reference policies' success on exactly the held-out maps validation plays."""
    from rollstream.shared.envs.references import REFERENCES, reference_success
    from rollstream.shared.envs.registry import make_env

    layout = cfg.val_layout
    stats = {}
    for tag in layout.groups_per_tag():
        seeds = [held_out_seed(cfg.seed, g.group_index) for g in layout.groups if g.tag == tag]
        for name in REFERENCES:
            value = reference_success(functools.partial(make_env, tag, cfg.custom_envs), seeds, name, seed=cfg.seed)
            if value is not None:
                stats[f"val/{tag}/ref_{name}"] = value
    return stats


def _round_of(group_id: str) -> int | None:
    try:
        mode, _, _, episode = parse_group_id(group_id)
    except ValueError:
        return None
    return episode if mode == "val" else None
