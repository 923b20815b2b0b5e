"""Which of a run's trained groups could teach anything: a recording's groups by outcome, step range by range.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/group_makeup.py RECORDING [--groups-per-step 16] [--bin 50]

Diagnostic only. RECORDING is the file a run wrote with `record_to=...` (every trajectory the trainer trained on,
in training order). Each group is one of: every member solved; every member failed with the same score (no
episode-level advantage: GiGPO's step level still compares the discounted returns of the states the members
share, which then differ only by the costs of the moves left); every member failed with different scores;
members that differ in success. The table gives each kind's share of the groups of each range of steps, the
share whose members all played the same actions, and the mean moves per episode.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from rollstream.shared.codec import decode_entry
from rollstream.shared.recording import read_records
from rollstream.shared.schema import Trajectory

KINDS = ("all solved", "all failed, one score", "all failed, scores differ", "success differs")


def recorded_groups(path: Path) -> Iterator[list[Trajectory]]:
    """The recording's groups in the order the trainer trained them (a group's members are recorded together)."""
    group: list[Trajectory] = []
    for fields in read_records(path):
        traj = decode_entry(fields)
        if not isinstance(traj, Trajectory):
            continue
        if group and traj.group_id != group[0].group_id:
            yield group
            group = []
        group.append(traj)
    if group:
        yield group


def kind_of(group: list[Trajectory]) -> str:
    solved = [t.success for t in group]
    if all(solved):
        return KINDS[0]
    if any(solved):
        return KINDS[3]
    return KINDS[1] if len({round(t.score, 6) for t in group}) == 1 else KINDS[2]


def same_actions(group: list[Trajectory]) -> bool:
    return len({tuple(turn.action for turn in t.turns) for t in group}) == 1


def table(groups: list[list[Trajectory]], groups_per_step: int, bin_steps: int) -> str:
    head = ["steps", "groups", *KINDS, "same actions", "moves per episode"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    size = groups_per_step * bin_steps
    for start in range(0, len(groups), size):
        chunk = groups[start:start + size]
        kinds = Counter(kind_of(g) for g in chunk)
        episodes = [t for g in chunk for t in g]
        first, last = start // groups_per_step, (start + len(chunk)) // groups_per_step
        cells = [f"{first}-{last}", str(len(chunk)), *(f"{kinds[k] / len(chunk):.2f}" for k in KINDS),
                 f"{sum(map(same_actions, chunk)) / len(chunk):.2f}",
                 f"{sum(t.num_actions for t in episodes) / len(episodes):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recording", type=Path)
    parser.add_argument("--groups-per-step", type=int, default=16, help="the config's num_env_groups")
    parser.add_argument("--bin", type=int, default=50, help="steps per row")
    args = parser.parse_args()
    groups = list(recorded_groups(args.recording))
    print(f"{args.recording}: {len(groups)} groups, {sum(map(len, groups))} trajectories")
    print(table(groups, args.groups_per_step, args.bin))


if __name__ == "__main__":
    main()
