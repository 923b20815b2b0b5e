"""The FrozenLake learning record: every measured run of `make run`'s config, against the goal's parts.

    .venv/bin/python benchmarks/learning_record.py [extra_measurement ...]

Reads the CSVs `benchmarks/learning_runs.py` wrote for each measurement in RECORD, read on validation's 64
held-out maps, and in RECORD_256, read on 256 (and any named on the command line, e.g. a new one before it is
added there) and prints, for each record, per measurement and over all of them, which runs met the
goal's own parts: greedy held-out success >= 0.6 within 15 minutes, and never back below 0.5 after first reaching
it. A measurement of three runs holds the whole goal when each of its runs did and their median at 15 minutes is
>= 0.7. This is where the README's and docs/learning.md's record comes from.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RECORD = (
    ("ban_masked",), ("masked_control",), ("masked_s1_3",), ("shipped_nov28",), ("masked_s4",), ("shipped_nov28b",),
    ("shipped_nov29", "shipped_nov29c"), ("shipped_nov29d", "shipped_nov29e"), ("shipped_nov29g",),
    ("shipped_dec01",), ("machine10_dec02",), ("machine11_dec02",), ("s5_6_dec02",), ("s7_9_dec03",),
    ("machine12_dec03",), ("machine13_dec03",), ("anchor09_dec03",), ("machine14_dec03",), ("pair_dec04_r1",),
    ("machine18_dec04",), ("causal_dec04",), ("ul1_dec04",), ("ul1_dec04m20",), ("shipped_dec04m20",),
    ("shipped_m21",), ("s1_3_m21",), ("s2_again_m21",), ("wall_ctrl",), ("machine23",), ("ctrl_m24",),
    ("val256_m25-first64",), ("shipped_m25-first64",), ("shipped_m26-first64",), ("fatalS_m26-first64",),
    ("fatalS_s12_m26-first64",), ("shipped_m27-first64",), ("shipped_m28-first64",),
    ("fatalS_s34_m28-first64",), ("shipped_m30-first64",), ("overlap_m31-first64", "base_m31-first64"),
    ("shipped_m32-first64",), ("nov0_m32-first64",), ("shipped_m33-first64",), ("shipped_m34-first64",),
    ("nice_m34-first64",), ("shipped_m35-first64",), ("shipped_m36-first64",),
    ("noeffect_m36-first64",), ("ship_m38-first64",), ("ship_m39-first64",), ("moves_m39-first64",),
    ("moves_m39_r4-first64",), ("ship_m40-first64",), ("ent_m40-first64",), ("ship_m41-first64",),
    ("stop_m41-first64",), ("stop_m41_r4-first64",), ("ship_m42-first64",), ("ship_m43-first64",),
    ("ship_m44-first64",), ("flikeS_m44-first64",), ("ship_m45-first64",), ("ship_s123_m45-first64",),
)
"""Read on validation's 64 held-out maps: the measurements of the config `make run` shipped on their day, of a
change to it that computed the same updates, or of the next config measured before it shipped (`ul1_dec04`,
`ul1_dec04m20`: the unlikelihood term, shipped on 2026-12-04; `fatalS_m26`: the fatal move's, shipped on
2026-12-05; `overlap_m31` and `base_m31`: validation beside the update, shipped on 2026-12-06, and the trainer
before it, the same updates; `nov0_m32`: no round before step 0, shipped on 2026-12-06, the same updates;
`nice_m34`: the env-workers at niceness 10, shipped on 2026-12-06, the same updates; `noeffect_m36`: unlikelihood
on moves that change nothing, shipped on 2026-12-06; `moves_m39`: those terms over the moves' share
(`move_unlikelihood_among_moves`), shipped on 2026-12-07; `ent_m40`: the entropy bonus over the moves' shares
(`entropy_among_moves`), shipped on 2026-12-07; `stop_m41`: no advantage after a reply's format break
(`format_break_ends_advantage`), shipped on 2026-12-07; `flikeS_m44`: the format's likelihood on every valid reply
(`format_likelihood_coef`, p(any move) over the moves the batch spelled), shipped on 2026-12-08;
docs/learning.md says which is which), in the order taken; each the runs of one or more
`learning_runs-frozen_lake_<name>.csv` (a measurement of three written in two parts; `<name>-first64`: runs
validated on more maps, read on their first 64, `learning_runs.py --first-maps 64`)."""
RECORD_256 = (("val256_m25",), ("shipped_m25",), ("shipped_m26",), ("fatalS_m26",), ("fatalS_s12_m26",),
              ("shipped_m27",), ("shipped_m28",), ("fatalS_s34_m28",), ("shipped_m30",), ("overlap_m31", "base_m31"),
              ("shipped_m32",), ("nov0_m32",), ("shipped_m33",), ("shipped_m34",), ("nice_m34",),
              ("shipped_m35",), ("shipped_m36",), ("noeffect_m36",), ("ship_m38",), ("ship_m39",), ("moves_m39",),
              ("moves_m39_r4",), ("ship_m40",), ("ent_m40",), ("ship_m41",), ("stop_m41",),
              ("stop_m41_r4",), ("ship_m42",), ("ship_m43",), ("ship_m44",), ("flikeS_m44",),
              ("ship_m45",), ("ship_s123_m45",))
"""The same, read on 256 held-out maps (a standard error of about 0.03 against 0.06 on 64), from 2026-12-05."""
REACHED, FLOOR, MEDIAN, BY_MINUTES = 0.6, 0.5, 0.7, 15
"""Issue 16's bars: >= 0.6 within 15 minutes, never back below 0.5 after, a median of three >= 0.7."""


@dataclass(frozen=True)
class RecordRun:
    seed: int
    at_15: float | None
    sampled_at_15: float | None
    reached_by_15: bool
    low_after_reaching: float | None
    at_15_on_many_maps: float | None = None
    """The last checkpoint by 15 minutes on many held-out maps (`learning_runs.py --checkpoint-maps`), where
    measured: validation's 64 maps are one fixed draw per seed."""

    @property
    def met(self) -> bool:
        """This run's own parts of the goal: reached the bar by the mark, and never fell under the floor after."""
        return self.reached_by_15 and (self.low_after_reaching is None or self.low_after_reaching >= FLOOR)


def _number(text: str) -> float | None:
    return float(text) if text else None


def read_runs(name: str, results: Path = RESULTS) -> list[RecordRun]:
    """One measurement's runs. A run reached the bar by 15 minutes if a validation round at or before the mark
    (the 5, 10 and 15-minute figures, or its peak if that came earlier) was >= 0.6."""
    runs = []
    with (results / f"learning_runs-frozen_lake_{name}.csv").open() as f:
        for row in csv.DictReader(f):
            marks = [_number(row[f"greedy_success_{m}min"]) for m in (5, 10, BY_MINUTES)]
            peak, peak_at = _number(row["greedy_success_peak"]), _number(row["greedy_peak_minutes"])
            reached = any(v is not None and v >= REACHED for v in marks) or (
                peak is not None and peak >= REACHED and peak_at is not None and peak_at <= BY_MINUTES)
            many = next((_number(v) for k, v in row.items() if k.startswith(f"greedy_success_{BY_MINUTES}min_")), None)
            runs.append(RecordRun(int(row["seed"]), marks[-1], _number(row[f"sampled_success_{BY_MINUTES}min"]),
                                  reached, _number(row[f"greedy_success_after_{REACHED:g}_min"]), many))
    return runs


def figures(values: Sequence[float | None]) -> str:
    """Each run's figure in order, `-` where it has none."""
    return " ".join("-" if v is None else f"{v:.2f}" for v in values)


def spread(values: Sequence[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{min(present):.2f} / {statistics.median(present):.2f} / {max(present):.2f}" if present else "-"


def whole_goal(runs: Sequence[RecordRun]) -> bool:
    """A measurement of three held every part: each run its own, and the median at 15 minutes."""
    return len(runs) == 3 and all(r.met for r in runs) and statistics.median(r.at_15 or 0.0 for r in runs) >= MEDIAN


def report(parts: Sequence[tuple[str, ...]], maps: int) -> None:
    """The record's table, its tallies and its spreads, for measurements read on `maps` held-out maps."""
    measurements = {" + ".join(names): [r for name in names for r in read_runs(name)] for names in parts}
    runs = [r for rs in measurements.values() for r in rs]
    print(f"\n## read on {maps} held-out maps\n")
    print("| measurement | seeds | greedy at 15 min | met its own parts | whole goal |\n|---|---|---|---|---|")
    for name, rs in measurements.items():
        whole = ("yes" if whole_goal(rs) else "no") if len(rs) == 3 else "-"
        print(f"| {name} | {' '.join(str(r.seed) for r in rs)} | "
              f"{figures([r.at_15 for r in rs])} | "
              f"{sum(r.met for r in rs)} of {len(rs)} | {whole} |")
    threes = [rs for rs in measurements.values() if len(rs) == 3]
    own_seed = [r for r in runs if r.seed == 42]
    print(f"\n{sum(r.met for r in runs)} of {len(runs)} runs met their own parts over {len(measurements)} "
          f"measurement{'s' * (len(measurements) != 1)}; "
          f"make run's seed (42): {sum(r.met for r in own_seed)} of {len(own_seed)}; "
          f"every part held in {sum(map(whole_goal, threes))} of {len(threes)} measurements of three")
    for name, rs in measurements.items():
        many = [r.at_15_on_many_maps for r in rs]
        if all(v is not None for v in many):
            print(f"{name} on many held-out maps, the last checkpoint by {BY_MINUTES} min: {figures(many)} "
                  f"against {figures([r.at_15 for r in rs])} on validation's")
    lows = [r.low_after_reaching for r in runs if r.low_after_reaching is not None]
    print(f"greedy at 15 min {spread([r.at_15 for r in runs])}; sampled {spread([r.sampled_at_15 for r in runs])}; "
          f"lowest after first >= {REACHED:g} {spread(lows)} over {len(lows)} runs; "
          f"{sum(r.reached_by_15 for r in runs)} reached {REACHED:g} by {BY_MINUTES} min, "
          f"{sum(1 for r in runs if r.at_15 is not None and r.at_15 >= REACHED)} at the mark (min / median / max)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extra", nargs="*", help="measurements to count beside the record's (their CSV names' tails)")
    parser.add_argument("--maps", type=int, choices=(64, 256), default=64, help="the record the extras join")
    args = parser.parse_args()
    extras = tuple((name,) for name in args.extra)
    report((*RECORD, *(extras if args.maps == 64 else ())), 64)
    report((*RECORD_256, *(extras if args.maps == 256 else ())), 256)


if __name__ == "__main__":
    main()
