"""What a run's policy does on its held-out maps, checkpoint by checkpoint: greedy moves and think paths.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/greedy_paths.py OUTPUT_DIR [--steps 0 50 100 150] [--tag TAG]
        [--maps N] [--sampled-rounds R] [--json PATH]

Diagnostic only. For each step (0: the warm-started model in `OUTPUT_DIR/tiny_model`; N: the `torch_train`
checkpoint `OUTPUT_DIR/checkpoints/step_N`), the run's held-out maps of `TAG` (the validation's seeds; the
config's first validation tag by default) are played through the transformers backend, once greedily and twice
sampled at the config's temperature. It prints success, the first moves greedy decoding takes over the maps (one
fixed move on every map: the policy does not read the map), the share of replies that open a `<think>`, the share
of valid moves that leave the state as it was (a walk into a wall) and the share of episodes that come back to a
state they left (a loop) on each path: greedy decoding can settle on a path that sampling, and so RL, rarely takes.

`--maps N` plays N held-out maps instead of the validation's count; the first ones are the validation's own (a
map's seed is a function of the run's seed and its index), so the table also gives greedy success on those alone
beside all N: how far a validation round's figure, on its few maps, lies from the policy's rate on many.
`--json PATH` also writes those two figures per step (`benchmarks/learning_runs.py --checkpoint-maps N` reads them).

On non-slippery FrozenLake a second table says how greedy lost the maps it lost: into a hole from a cell where a move
towards the goal (Right or Down) was still on a safe path to it (a misread of the next cells), into a hole from a
cell where none was (a forward dead end, entered earlier), or out of moves: what a policy on a plateau gets wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

from rollstream.consumer.data.batch_stats import per_tag_stats
from rollstream.consumer.learn.checkpoints import strategy_dir
from rollstream.consumer.learn.state_file import load_state
from rollstream.consumer.learn.strategy.torch_strategy import CHECKPOINT_FILE
from rollstream.producer.episode import EpisodeSpec, Sampling, play_episode
from rollstream.producer.policy.factory import chat_template_of
from rollstream.producer.policy.hf import HFPolicy
from rollstream.shared.config import RollstreamConfig, load_config
from rollstream.shared.envs.frozen_lake import MOVES, FrozenLakeEnv, moved
from rollstream.shared.envs.registry import make_env
from rollstream.shared.schema import Trajectory
from rollstream.shared.seeding import held_out_seed

SAMPLED_ROUNDS = 2


def base_model(run: Path, pretrain: str | None) -> Path:
    """The model the run started from: the tiny model it built in its dir, or the one its config loaded (a run
    on another run's build, `pretrain=<dir> tiny_model.build=false`)."""
    built = run / "tiny_model"
    if built.is_dir():
        return built
    if pretrain and Path(pretrain).is_dir():
        return Path(pretrain)
    raise SystemExit(f"{run}: no tiny_model dir and its config's pretrain ({pretrain}) is not a dir; "
                     "play a run whose starting model is still on disk")


def model_at(base: Path, run: Path, step: int, into: Path) -> Path:
    """The base model with the weights of the run's checkpoint `step` (0: as it started)."""
    shutil.copytree(base, into)
    if step:
        checkpoint = strategy_dir(run / "checkpoints" / f"step_{step}") / CHECKPOINT_FILE
        weights = load_state(checkpoint)["model"]
        save_file({name: t.contiguous() for name, t in weights.items()}, into / "model.safetensors")
    return into


async def play_held_out(
    cfg: RollstreamConfig, tag: str, policy: HFPolicy, sampling: Sampling, rounds: int, maps: int
) -> list[Trajectory]:
    """Held-out maps 0..maps-1, each `rounds` times, all at once (the backend batches the requests)."""

    async def play(g: int) -> Trajectory:
        spec = EpisodeSpec("val", tag, g, 0, 0, held_out_seed(cfg.seed, g), 0)
        return await play_episode(make_env(tag, cfg.custom_envs), policy, spec, sampling,
                                  chat=chat_template_of(policy), sequence_length=cfg.sequence_length)

    return list(await asyncio.gather(*(play(g) for _ in range(rounds) for g in range(maps))))


async def greedy_and_sampled(
    cfg: RollstreamConfig, tag: str, model: Path, maps: int, sampled_rounds: int = SAMPLED_ROUNDS
) -> tuple[list[Trajectory], list[Trajectory]]:
    max_tokens = cfg.reply_tokens(tag)
    policy = HFPolicy(model, seed=cfg.seed)
    try:
        greedy_sampling = Sampling.greedy(max_tokens, cfg.actor_infer.generating_args)
        greedy = await play_held_out(cfg, tag, policy, greedy_sampling, 1, maps)
        sampled = Sampling.training(max_tokens, cfg.actor_infer.generating_args)
        return greedy, await play_held_out(cfg, tag, policy, sampled, sampled_rounds, maps)
    finally:
        await policy.close()


def loop_share(trajs: list[Trajectory]) -> float:
    """Episodes that came back to a state they had left (a stay in place is not a return)."""

    def loops(t: Trajectory) -> bool:
        states = [turn.observation for turn in t.turns]
        return any(states[i] != states[i - 1] and states[i] in states[: i - 1] for i in range(1, len(states)))

    return sum(map(loops, trajs)) / max(len(trajs), 1)


def path_figures(trajs: list[Trajectory]) -> str:
    stats = per_tag_stats("path", trajs)  # the same figures a run's validation logs
    return (f"{stats['path/success']:.2f} / {stats['path/think_rate']:.2f} / {stats['path/no_effect_rate']:.2f} / "
            f"{loop_share(trajs):.2f}")


def success_on(greedy: list[Trajectory], val_maps: int) -> dict[str, float]:
    """Greedy success on the validation's own maps (the first `val_maps`) and on all that were played."""
    ordered = sorted(greedy, key=lambda t: t.group_index)
    return {"on_val_maps": per_tag_stats("g", ordered[:val_maps])["g/success"],
            "on_all_maps": per_tag_stats("g", ordered)["g/success"]}


def success_spread(greedy: list[Trajectory], val_maps: int) -> str:
    """The two figures of `success_on`, the second with its binomial standard error."""
    on = success_on(greedy, val_maps)
    error = math.sqrt(on["on_all_maps"] * (1 - on["on_all_maps"]) / len(greedy))
    return f"{on['on_val_maps']:.2f} | {on['on_all_maps']:.3f} +- {error:.3f}"


def held_out_maps(cfg: RollstreamConfig, tag: str, maps: int) -> list[list[str]] | None:
    """Each held-out map's rows (by index), for an env whose losses can be told apart: non-slippery FrozenLake."""
    env = make_env(tag, cfg.custom_envs)
    if not isinstance(env, FrozenLakeEnv) or env.is_slippery:
        return None
    out = []
    for g in range(maps):
        env.reset(seed=held_out_seed(cfg.seed, g))
        out.append(list(env.desc))
    return out


FORWARD = ("Right", "Down")
"""The moves towards the goal (bottom-right, from the top-left start): every held-out 4x4 map measured has a
shortest safe path of these alone."""


def reaches_goal_forward(desc: list[str], cell: tuple[int, int]) -> bool:
    """The goal can be reached from `cell` by moves towards it alone, without a hole."""
    row, col = cell
    if not (0 <= row < len(desc) and 0 <= col < len(desc[0])) or desc[row][col] == "H":
        return False
    if desc[row][col] == "G":
        return True
    return any(reaches_goal_forward(desc, (row + MOVES[m][0], col + MOVES[m][1])) for m in FORWARD)


def how_lost(traj: Trajectory, desc: list[str]) -> str:
    """How a lost FrozenLake episode was lost: into a hole from a cell where a move towards the goal still led to
    it (a misread of the next cells), into a hole from a cell where none did (a forward dead end, entered
    earlier), or out of moves."""
    if traj.end_reason != "terminated":
        return "out of moves"
    cell = (0, 0)
    for turn in traj.turns[:-1]:
        if turn.action is not None:
            cell = moved(desc, cell, turn.action)
    if reaches_goal_forward(desc, cell):
        return "a hole, beside a move still on a path"
    return "a hole, from a forward dead end"


def next_cell_player(descs: list[list[str]], moves: int, rollouts: int = 32, seed: int = 0) -> float:
    """Success of a player that reads only the next cell: each move at random among the moves towards the goal
    that do not step into a hole (either, when both do). A yardstick for a policy that has learnt no more."""
    rng = np.random.default_rng(seed)
    wins = 0
    for desc in descs:
        for _ in range(rollouts):
            row = col = 0
            for _ in range(moves):
                ahead = [(row + MOVES[m][0], col + MOVES[m][1]) for m in FORWARD]
                inside = [(r, c) for r, c in ahead if r < len(desc) and c < len(desc[0])]
                safe = [cell for cell in inside if desc[cell[0]][cell[1]] != "H"] or inside
                row, col = safe[rng.integers(len(safe))]
                if desc[row][col] in "HG":
                    break
            wins += desc[row][col] == "G"
    return wins / (len(descs) * rollouts)


def lost_maps(greedy: list[Trajectory], descs: list[list[str]]) -> str:
    """How the greedy episodes that failed were lost, with counts."""
    kinds = Counter(how_lost(t, descs[t.group_index]) for t in greedy if not t.success)
    return ", ".join(f"{kind} {n}" for kind, n in kinds.most_common()) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path,
                        help="a run's output dir (config.yaml, checkpoints; its tiny_model unless it loaded another's)")
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 50, 100, 150])
    parser.add_argument("--tag", help="the env tag to play (default: the config's first validation tag)")
    parser.add_argument("--maps", type=int, help="held-out maps to play (default: as many as validation plays)")
    parser.add_argument("--sampled-rounds", type=int, default=SAMPLED_ROUNDS)
    parser.add_argument("--json", type=Path, help="also write greedy success per step here (maps, val_maps, steps)")
    args = parser.parse_args()
    cfg = load_config(args.run / "config.yaml")
    tag = args.tag or cfg.val_env_manager.tags[0]
    val_maps = cfg.val_env_manager.num_env_groups
    maps = args.maps or val_maps
    print(f"{args.run}: {maps} held-out {tag} maps, greedy once, sampled {args.sampled_rounds}x; each path: "
          "success, replies opening a think, valid moves that change nothing, episodes that loop back")
    print("| step | greedy first moves | greedy: success / think / no effect / loop | "
          f"sampled: success / think / no effect / loop | greedy on validation's {val_maps} | on all {maps} |")
    print("|---|---|---|---|---|---|")
    per_step = {}
    losses = {}
    descs = held_out_maps(cfg, tag, maps)
    base = base_model(args.run, cfg.pretrain)
    for step in args.steps:
        with tempfile.TemporaryDirectory() as tmp:
            model = model_at(base, args.run, step, Path(tmp) / "model")
            g, s = asyncio.run(greedy_and_sampled(cfg, tag, model, maps, args.sampled_rounds))
        first = Counter(t.turns[0].action if t.turns else None for t in g)
        moves = ", ".join(f"{move} {n}" for move, n in first.most_common())
        print(f"| {step} | {moves} | {path_figures(g)} | {path_figures(s) if s else '-'} | "
              f"{success_spread(g, val_maps)} |", flush=True)
        per_step[step] = success_on(g, val_maps)
        if descs is not None:
            losses[step] = lost_maps(g, descs)
    if losses:
        assert descs is not None
        print(f"\nA player that reads only the next cell (random among the safe moves towards the goal) wins "
              f"{next_cell_player(descs, cfg.custom_envs[tag].max_actions_per_traj):.2f} of these maps.")
        print("| step | the maps greedy lost, by how |")
        print("|---|---|")
        for step, row in losses.items():
            print(f"| {step} | {row} |")
    if args.json:
        args.json.write_text(json.dumps({"maps": maps, "val_maps": val_maps, "steps": per_step}, indent=1))


if __name__ == "__main__":
    main()
