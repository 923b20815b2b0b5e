"""Run `rollstream.consumer.learn.distributed` for real: N spawned processes on CPU, gloo, DeepSpeed.

Rank 0 drives the leader.

Spawned processes import this module, not the test module, so it stays free of pytest.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import socket
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from rollstream.shared.schema import Trajectory

from .helpers import learner_config, make_batch

RANK_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STEP, SAVE, RESUME = "step", "save", "resume"
"""What rank 0 does in a run. STEP: train one step on the groups, publish version 1. SAVE: train a step, save a
checkpoint (`<run>/checkpoint`), train a second step, publish version 2. RESUME (`resume:<run>`): load that
run's checkpoint, train the second step, publish version 2 — the same weights as the SAVE run, if every rank
saved and restored its part."""
Run = tuple[str, Sequence[str], str]
"""(name, config overrides, action)."""


def run_ranks(world_size: int, tmp_path: Path, model: Path, groups: list[list[Trajectory]],
              runs: Sequence[Run]) -> dict[str, dict[str, float]]:
    """Every run in turn: every rank builds its learner, rank 0 does the run's action on `groups`, writing under
    tmp_path/name. Returns rank 0's metrics (of its last step) per run. Raises if a rank fails or hangs."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "groups.pkl").write_bytes(pickle.dumps(groups))
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, tmp_path, model, list(runs)),
                         daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [(tmp_path / f"rank{r}.error").read_text() for r in range(world_size)
              if (tmp_path / f"rank{r}.error").exists()]
    codes = [p.exitcode for p in procs]
    if errors or codes != [0] * world_size:
        raise AssertionError(f"ranks exited {codes} (None: killed after {RANK_TIMEOUT_S:.0f} s)\n" + "\n".join(errors))
    return {name: json.loads((tmp_path / name / "metrics.json").read_text()) for name, _, _ in runs}


def _rank_main(rank: int, world_size: int, port: int, tmp_path: Path, model: Path, runs: list[Run]) -> None:
    # What torchrun would set; the parent may carry a one-process DeepSpeed group's values.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        from rollstream.consumer.learn.distributed import Follower, end_rank, start_rank

        torch.set_num_threads(1)  # N ranks on a small CI machine
        groups = pickle.loads((tmp_path / "groups.pkl").read_bytes())
        for name, overrides, action in runs:
            cfg = learner_config(tmp_path / name, model, "deepspeed_train", *overrides)
            learner = start_rank(cfg)
            if isinstance(learner, Follower):
                learner.run()
                continue
            try:
                if action == STEP:
                    metrics = learner.train_step(make_batch(groups, 0))
                else:
                    if action == SAVE:
                        learner.train_step(make_batch(groups, 0))
                        learner.save_checkpoint(tmp_path / name / "checkpoint")
                    else:
                        learner.load_checkpoint(tmp_path / action.removeprefix(f"{RESUME}:") / "checkpoint")
                    metrics = learner.train_step(make_batch(groups, 1))
                metrics["publish/digest"] = learner.publish(1 if action == STEP else 2).digest  # type: ignore[assignment]
            finally:
                learner.close()
            (tmp_path / name / "metrics.json").write_text(json.dumps(metrics))
        end_rank()
    except BaseException:
        (tmp_path / f"rank{rank}.error").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
