from rollstream.consumer.data.assembler import Added, GroupAssembler
from tests.factories import make_traj


def test_groups_complete_out_of_order_and_duplicates_are_kept_only_for_acking() -> None:
    asm = GroupAssembler(group_size=3)
    arrivals = [(1, 2), (0, 0), (1, 0), (0, 0), (1, 1), (0, 2), (0, 1)]  # (group, member)
    results = [asm.add(f"{i}-0".encode(), make_traj(g, 0, m), now=i) for i, (g, m) in enumerate(arrivals)]
    assert results == [Added.NEW, Added.NEW, Added.NEW, Added.DUPLICATE, Added.COMPLETED, Added.NEW,
                       Added.COMPLETED]
    first, second = asm.take_ready(), asm.take_ready()
    assert asm.take_ready() is None
    assert first.group_id.endswith("g1/e0") and second.group_id.endswith("g0/e0")
    assert [t.member for t in second.trajectories] == [0, 1, 2]
    assert second.entry_ids == [b"1-0", b"3-0", b"5-0", b"6-0"]  # the duplicate's entry is acked too


def test_a_duplicate_of_a_ready_group_attaches_to_it() -> None:
    asm = GroupAssembler(group_size=1)
    assert asm.add(b"1-0", make_traj(0, 0, 0), now=0) is Added.COMPLETED
    assert asm.add(b"2-0", make_traj(0, 0, 0), now=1) is Added.DUPLICATE
    assert asm.take_ready().entry_ids == [b"1-0", b"2-0"]


def test_group_version_is_the_oldest_member_version() -> None:
    asm = GroupAssembler(group_size=2)
    asm.add(b"1-0", make_traj(0, 0, 0, version=4), now=0)
    asm.add(b"2-0", make_traj(0, 0, 1, version=2), now=0)
    assert asm.take_ready().version == 2


def test_discard_forgets_a_partial_group_and_returns_its_entries() -> None:
    asm = GroupAssembler(group_size=2)
    asm.add(b"1-0", make_traj(0, 0, 0), now=0)
    assert asm.known("train/FrozenLake/g0/e0")
    assert asm.discard("train/FrozenLake/g0/e0") == [b"1-0"]
    assert not asm.known("train/FrozenLake/g0/e0")
