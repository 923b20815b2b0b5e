"""The group make-up diagnostic reads a real recording and sorts its groups by what they could teach."""

from dataclasses import replace
from pathlib import Path

from rollstream.shared.codec import encode_trajectory
from rollstream.shared.recording import Recorder
from tests.benchmark_modules import load_benchmark
from tests.factories import make_traj

group_makeup = load_benchmark("group_makeup")


def test_groups_are_read_in_order_and_sorted_by_kind(tmp_path: Path) -> None:
    scores = [[1.0, 1.0], [-1.0, -1.0], [-1.0, -0.5], [1.0, -1.0]]  # one group of each kind, in KINDS' order
    path = tmp_path / "run.msgpack"
    with Recorder(path) as recorder:
        for g, group in enumerate(scores):
            recorder.write_all([encode_trajectory(make_traj(g, member=m, score=s)) for m, s in enumerate(group)])
    groups = list(group_makeup.recorded_groups(path))
    assert [[t.score for t in g] for g in groups] == scores
    assert [group_makeup.kind_of(g) for g in groups] == list(group_makeup.KINDS)
    rows = group_makeup.table(groups, groups_per_step=2, bin_steps=1).splitlines()[2:]
    shares = [row.split(" | ")[2:6] for row in rows]  # a row: | steps | groups | the four kinds | ...
    assert shares == [["0.50", "0.50", "0.00", "0.00"], ["0.00", "0.00", "0.50", "0.50"]]


def test_same_actions_compares_whole_action_sequences() -> None:
    a, b = make_traj(member=0), make_traj(member=1)
    assert group_makeup.same_actions([a, b])
    b = replace(b, turns=[b.turns[0], replace(b.turns[1], action="Right")])
    assert not group_makeup.same_actions([a, b])
