"""Validation rounds on an env-worker: its share of the held-out maps, played greedily and sampled.

The trainer pauses train admission, announces a round on the control stream, and collects the round's
trajectories from the validation stream; a worker that starts mid-round plays its share too.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from rollstream.producer.episode import EpisodeSpec, Sampling
from rollstream.shared.codec import encode_drop, encode_trajectory
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.envs.base import TextEnv
from rollstream.shared.envs.registry import make_env
from rollstream.shared.keys import Keys
from rollstream.shared.layout import GroupSpec, Layout
from rollstream.shared.schema import VAL_GREEDY_MEMBER, GroupDropNotice, Trajectory
from rollstream.shared.seeding import held_out_seed

log = logging.getLogger(__name__)


class Player(Protocol):
    """What validation needs of its env-worker."""

    cfg: RollstreamConfig
    rank: int
    keys: Keys
    layout: Layout

    async def ensure_version(self, version: int) -> None: ...

    async def play(self, env: TextEnv, spec: EpisodeSpec, sampling: Sampling, render_dir: Path | None = None
                   ) -> Trajectory: ...

    async def publish(self, fields: dict[str, bytes | str | int | float], stream: str | None = None) -> None: ...


class ValidationPlayer:
    """This worker's share of the val groups (dealt round-robin over the train workers), played once per round
    greedily (member 0) and `val_sampled_episodes` times at the training sampling settings (members 1..n; on the
    first `val_sampled_maps` groups only, where set), at most val_env_manager.max_env_num_per_worker episodes at
    once."""

    def __init__(self, worker: Player, val_layout: Layout | None) -> None:
        """`val_layout`: the val env manager's layout, None without validation."""
        self.worker = worker
        cfg = worker.cfg
        groups = val_layout.groups if val_layout else []
        self.groups = [g for g in groups if g.group_index % worker.layout.num_workers == worker.rank]
        self.concurrency = cfg.val_env_manager.max_env_num_per_worker

    async def play_round(self, round_: int, version: int) -> None:
        await self.worker.ensure_version(version)
        slots = asyncio.Semaphore(self.concurrency)

        async def play(spec: GroupSpec, member: int) -> None:
            async with slots:
                await self._play(spec, round_, member)

        cfg = self.worker.cfg
        await asyncio.gather(*(play(g, m) for g in self.groups for m in range(cfg.val_members(g.group_index))))

    async def _play(self, group: GroupSpec, round_: int, member: int) -> None:
        cfg, worker = self.worker.cfg, self.worker
        spec = EpisodeSpec("val", group.tag, group.group_index, round_, member,
                           held_out_seed(cfg.seed, group.group_index), worker.rank)
        max_tokens = cfg.reply_tokens(group.tag)
        gen = cfg.actor_infer.generating_args
        sampling = (Sampling.greedy(max_tokens, gen) if member == VAL_GREEDY_MEMBER
                    else Sampling.training(max_tokens, gen))
        try:
            traj = await worker.play(make_env(group.tag, cfg.custom_envs), spec, sampling)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("worker %d: validation episode %s member %d failed", worker.rank, spec.group_id, member)
            notice = GroupDropNotice(spec.group_id, "error", f"{type(e).__name__}: {e}"[:500], worker.rank)
            await worker.publish(encode_drop(notice), worker.keys.val)
            return
        await worker.publish(encode_trajectory(traj), worker.keys.val)
