from pathlib import Path

from rollstream.consumer.pruning import prune_versions


def _versions(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_only_versions_every_live_worker_has_moved_past_are_removed(tmp_path: Path) -> None:
    for name in ("v1", "v2", "v3", "v3-resumed-from-2", "v4", "notes"):
        (tmp_path / name).mkdir()
    assert prune_versions(tmp_path, loaded=[], newest=4) == []  # nobody beating: keep everything
    prune_versions(tmp_path, loaded=[3, 4], newest=4)
    assert _versions(tmp_path) == ["notes", "v3", "v3-resumed-from-2", "v4"]
    prune_versions(tmp_path, loaded=[9], newest=4)  # never the newest
    assert _versions(tmp_path) == ["notes", "v4"]


def test_leftovers_of_interrupted_writes_are_pruned_like_their_version(tmp_path: Path) -> None:
    for name in (".tmp-v1-0a1b2c3d", ".trash-v2-resumed-from-1-0a1b2c3d", ".tmp-v4-0a1b2c3d", "v4", ".tmp-notes"):
        (tmp_path / name).mkdir()
    prune_versions(tmp_path, loaded=[4], newest=4)
    assert _versions(tmp_path) == [".tmp-notes", ".tmp-v4-0a1b2c3d", "v4"]
