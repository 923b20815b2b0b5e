"""Replay a run's updates from a checkpoint with the batches it recorded, bit for bit, and take one update apart.

    .venv/bin/python benchmarks/replay_update.py RUN_DIR --from 50 --to 86 [--take-apart [--over N] [--score N]]

RUN_DIR is a run's output dir, run with `record_to` set (`'record_to=${output_dir}/trajectories.msgpack'`): the
trainer writes every batch it trained on there, in order, `rollout_batch_size` trajectories a step. Starting from
the checkpoint of step `--from` (`save_steps`; a checkpoint holds the optimizer's moments and the RNG), this trains
steps from..to-1 again on those batches with the run's own config (`RUN_DIR/config.yaml`) and checks the weights
against every later checkpoint and published version still on disk: on the CPU the replay is exact, so any
difference is reported as a failed replay, not explained away.

`--take-apart` then trains step `--to` (the update that made version to+1) again under variants, each from the same
state: as the run made it; without the policy gradient; the policy gradient alone; without each of the other terms
(entropy bonus, format unlikelihood, fatal and no-effect moves); the move terms over the vocabulary; with the
format's likelihood (`format_likelihood_coef`) at 1.0, or without it in a run that had it; with Adam's
first moment zeroed (no momentum carried in) and with every term out (the momentum alone). `--over N` takes the N
steps up to `--to` apart together: the variant on each of them, the momentum zeroed before the first. A variant
changes the loss only: the mini-batches stay as the step planned them. Each is scored on the replies of the next
recorded batch (`--score N`: of batch N, e.g. the broken batch a step later, sampled by the version this update
made), under the weights it leaves:
- leak: the mass on tokens that begin no move at each valid reply's action token (mean, and its worst context);
- unspelled: the mass there on tokens that no valid reply of the scored batch chose its action with, so that a leak
  into a token that begins a move but that no reply finishes (`U` for `Up`) counts too (as
  `format_likelihood_moves: spelled` counts it);
- breaks: p of each break of an unparsed reply at its position (mean, and the largest).
A format wobble (a batch whose replies leave the format after one update) shows as a leak or break figure that the
update as run raises; the variant that leaves it low names the part of the update that raised it.
Only for `torch_train` (the momentum variants read torch's AdamW state).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rollstream.consumer.data.assembler import Group
from rollstream.consumer.data.batcher import Batch
from rollstream.consumer.learn.checkpoints import checkpoint_dir, strategy_dir
from rollstream.consumer.learn.format_unlikelihood import break_positions
from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.learn.move_share import MoveTokens, move_names, move_positions
from rollstream.consumer.learn.policy_learner import PolicyLearner, UpdateSettings
from rollstream.consumer.learn.state_file import load_state
from rollstream.consumer.learn.strategy.torch_strategy import CHECKPOINT_FILE
from rollstream.shared.codec import decode_entry
from rollstream.shared.config import RollstreamConfig, load_config
from rollstream.shared.recording import read_records
from rollstream.shared.schema import Trajectory

TERMS_OFF = {"policy_loss_coef": 0.0, "entropy_coef": 0.0, "kl_coef": 0.0, "unparsed_kl_coef": 0.0,
             "format_unlikelihood_coef": 0.0, "fatal_move_unlikelihood_coef": 0.0, "no_effect_unlikelihood_coef": 0.0,
             "format_likelihood_coef": 0.0}
"""Every term of the loss out: a step with these trains nothing but Adam's momentum."""


@dataclass(frozen=True)
class Variant:
    name: str
    settings: dict[str, Any]
    """Replaced in the step's settings, for its loss."""
    zero_momentum: bool = False


VARIANTS = (
    Variant("as run", {}),
    Variant("without the policy gradient", {"policy_loss_coef": 0.0}),
    Variant("the policy gradient alone", {k: v for k, v in TERMS_OFF.items() if k != "policy_loss_coef"}),
    Variant("without the entropy bonus", {"entropy_coef": 0.0}),
    Variant("without the format term", {"format_unlikelihood_coef": 0.0}),
    Variant("without the fatal-move term", {"fatal_move_unlikelihood_coef": 0.0}),
    Variant("without the no-effect term", {"no_effect_unlikelihood_coef": 0.0}),
    Variant("move terms over the vocabulary", {"blames_among_moves": False}),
    Variant("no momentum carried in", {}, zero_momentum=True),
    Variant("the momentum alone", TERMS_OFF),
)


def variants_for(cfg: RollstreamConfig) -> tuple[Variant, ...]:
    """`VARIANTS`, and the format's likelihood taken out of a run that had it, or put into one that had not."""
    if cfg.format_likelihood_coef > 0:
        toggled = Variant("without the format's likelihood", {"format_likelihood_coef": 0.0})
    else:
        toggled = Variant("with the format's likelihood (1.0)", {"format_likelihood_coef": 1.0})
    return (*VARIANTS[:-2], toggled, *VARIANTS[-2:])


def recorded_batches(path: Path, batch_size: int, group_size: int) -> list[Batch]:
    """The batches a run trained on, step by step, from its `record_to` file."""
    trajs = [decode_entry(fields) for fields in read_records(path)]
    if len(trajs) % batch_size:
        raise SystemExit(f"{path}: {len(trajs)} trajectories is not a whole number of batches of {batch_size} "
                         f"(rollout_batch_size): not a record of this run's config")
    return [as_batch(step, trajs[at:at + batch_size], group_size)
            for step, at in enumerate(range(0, len(trajs), batch_size))]


def as_batch(step: int, trajs: list[Trajectory], group_size: int) -> Batch:
    """`trajs` (whole groups, as recorded) as the batch of `step`."""
    groups: dict[str, Group] = {}
    for traj in trajs:
        if not isinstance(traj, Trajectory):
            raise SystemExit(f"step {step}: a recorded entry is not a trajectory ({type(traj).__name__})")
        groups.setdefault(traj.group_id, Group(traj.group_id, group_size, 0.0)).add(traj)
    return Batch(step, list(groups.values()))


def weights_difference(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between `model`'s parameters and `state`'s (those both hold)."""
    own = model.state_dict()
    return max(float((own[k].float() - v.float()).abs().max()) for k, v in state.items() if k in own)


def saved_weights(cfg: RollstreamConfig, version: int) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The weights of `version` still on disk: its checkpoint's model and its published version."""
    checkpoint = strategy_dir(checkpoint_dir(cfg, version)) / CHECKPOINT_FILE
    if checkpoint.exists():
        yield str(checkpoint), load_state(checkpoint)["model"]
    published = Path(cfg.output_dir) / "weights" / f"v{version}" / "model.safetensors"
    if published.exists():
        yield str(published), load_file(str(published))


def replay(learner: PolicyLearner, cfg: RollstreamConfig, batches: list[Batch], start: int, stop: int) -> int:
    """Train steps start..stop-1 from `start`'s checkpoint, checking every saved version on the way; returns how
    many were checked."""
    learner.load_checkpoint(checkpoint_dir(cfg, start))
    checked = 0
    for step in range(start, stop):
        learner.train_step(batches[step])
        for where, state in saved_weights(cfg, step + 1):
            difference = weights_difference(learner.strategy.model, state)
            print(f"step {step}: v{step + 1} against {where}: largest difference {difference:.1e}", flush=True)
            if difference:
                raise SystemExit(f"the replay of step {step} differs from {where}: not the run's update")
            checked += 1
    if not checked and stop > start:
        print(f"replayed steps {start}..{stop - 1}: no checkpoint or published version of v{start + 1}..v{stop} is "
              f"on disk to check them against", flush=True)
    return checked


@dataclass(frozen=True)
class Probe:
    """Where the next batch's replies choose a move, and where they left the format: per trajectory, the indices in
    its `input_ids` of its action tokens and of its breaks."""

    marks: list[tuple[Trajectory, list[int], list[int]]]

    @classmethod
    def of(cls, learner: PolicyLearner, batch: Batch) -> Probe:
        marks = []
        for traj in batch.trajectories:
            if traj.tag not in learner.reply_formats:
                continue
            actions = move_positions(traj, learner.piece)
            breaks = break_positions(traj, learner.piece, learner.reply_formats[traj.tag],
                                     whole_moves=learner.whole_moves[traj.tag])
            if actions or breaks:
                marks.append((traj, actions, breaks))
        return cls(marks)

    @property
    def actions(self) -> int:
        return sum(len(actions) for _, actions, _ in self.marks)

    @property
    def spelled(self) -> torch.Tensor:
        """The distinct tokens at which the batch's valid replies chose their action."""
        return torch.tensor(sorted({traj.input_ids[at] for traj, actions, _ in self.marks for at in actions}),
                            dtype=torch.long)

    @property
    def breaks(self) -> list[tuple[Trajectory, int]]:
        return [(traj, at) for traj, _, breaks in self.marks for at in breaks]


@torch.no_grad()
def score(model: torch.nn.Module, probe: Probe, moves: torch.Tensor) -> dict[str, float]:
    """Leak (mass on tokens that begin no move at the action tokens), the mass there off the moves the batch's valid
    replies spelled, and p of each break, under `model`."""
    leaks: list[float] = []
    unspelled: list[float] = []
    breaks: list[float] = []
    spelled = probe.spelled
    for traj, actions, breaking in probe.marks:
        ids = torch.as_tensor(traj.input_ids, dtype=torch.long)
        p = torch.softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
        leaks += [1.0 - float(p[at - 1, moves].sum()) for at in actions]
        unspelled += [1.0 - float(p[at - 1, spelled].sum()) for at in actions]
        breaks += [float(p[at - 1, ids[at]]) for at in breaking]
    return {"leak mean": _mean(leaks), "leak worst": max(leaks, default=0.0),
            "unspelled mean": _mean(unspelled), "unspelled worst": max(unspelled, default=0.0),
            "break p mean": _mean(breaks), "break p max": max(breaks, default=0.0)}


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def take_apart(learner: PolicyLearner, batches: list[Batch], probe: Probe,
               variants: tuple[Variant, ...] = VARIANTS) -> list[tuple[str, dict[str, float]]]:
    """Score the weights before `batches`' steps and after them under each variant (on every one of them; the
    momentum zeroed before the first), each from the same state: the learner's own checkpoint, taken first and
    loaded again after the last."""
    model = learner.strategy.model
    moves = MoveTokens.of(learner.piece, model.get_output_embeddings().weight.shape[0],
                          move_names(learner.reply_formats)).ids
    rows = [("before the update", score(model, probe, moves))]
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "before"
        learner.save_checkpoint(state)
        for variant in variants:
            learner.load_checkpoint(state)
            if variant.zero_momentum:
                for moments in learner.strategy.optimizer.state.values():
                    moments["exp_avg"].zero_()
            for batch in batches:
                learner.train_step(batch, _adjust(variant.settings))
            rows.append((variant.name, score(model, probe, moves)))
        learner.load_checkpoint(state)
    return rows


def _adjust(changes: dict[str, Any]) -> Callable[[UpdateSettings], UpdateSettings] | None:
    return (lambda settings: replace(settings, **changes)) if changes else None


def print_table(step: int, over: int, scored: int, rows: list[tuple[str, dict[str, float]]], probe: Probe) -> None:
    steps = f"step {step}" if over == 1 else f"steps {step - over + 1}-{step}"
    print(f"\n{steps} (the update{'s' if over > 1 else ''} that made v{step + 1}), scored on batch {scored}: "
          f"{probe.actions} action tokens, {len(probe.breaks)} breaks")
    columns = list(rows[0][1])
    print(f"| variant | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
    for name, figures in rows:
        print(f"| {name} | {' | '.join(f'{figures[c]:.4f}' for c in columns)} |")


def print_breaks(learner: PolicyLearner, probe: Probe, show: int) -> None:
    for traj, at in probe.breaks[:show]:
        text = learner.tokenizer.decode(traj.input_ids[max(0, at - 4):at + 3])
        print(f"  break in {traj.traj_id} at token {at}: ...{text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run's output dir")
    parser.add_argument("--from", dest="start", type=int, required=True, help="a step with a checkpoint")
    parser.add_argument("--to", type=int, required=True, help="replay steps --from..--to-1 (then take --to apart)")
    parser.add_argument("--take-apart", action="store_true", help="then take step --to apart")
    parser.add_argument("--over", type=int, default=1,
                        help="take apart the last N steps up to --to together (the variant on each)")
    parser.add_argument("--score", type=int, help="score on this recorded batch (default: the one after --to)")
    parser.add_argument("--show", type=int, default=8, help="breaks to print (with --take-apart)")
    args = parser.parse_args()
    cfg = load_config(args.run / "config.yaml", [])
    if cfg.actor_train.strategy_args.strategy_name != "torch_train" or not cfg.record_to:
        raise SystemExit(f"{args.run}: needs a torch_train run with record_to set")
    learner = make_learner(cfg)  # the run's own threads (cpu_threads) too: the replay is bit for bit
    assert isinstance(learner, PolicyLearner)
    batches = recorded_batches(Path(cfg.record_to), cfg.rollout_batch_size, cfg.train_env_manager.group_size)
    first = args.to - args.over + 1 if args.take_apart else args.to  # the first step taken apart
    scored = args.to + 1 if args.score is None else args.score
    if not args.start <= first <= args.to < len(batches) or (args.take_apart and not 0 <= scored < len(batches)):
        raise SystemExit(f"--from {args.start} --to {args.to} --over {args.over} --score {scored}: the record holds "
                         f"steps 0..{len(batches) - 1}")
    replay(learner, cfg, batches, args.start, first)
    if args.take_apart:
        probe = Probe.of(learner, batches[scored])
        print_breaks(learner, probe, args.show)
        print_table(args.to, args.over, scored, take_apart(learner, batches[first:args.to + 1], probe,
                                                              variants_for(cfg)), probe)


if __name__ == "__main__":
    main()
