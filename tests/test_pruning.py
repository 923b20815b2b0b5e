from pathlib import Path

from consumer.pruning import prune_versions


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
