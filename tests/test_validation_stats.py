"""Validation's own figures: the first maps of a larger round, reported beside the whole."""

from __future__ import annotations

from rollstream.consumer.validation import first_maps_success
from tests.factories import make_traj


def test_validation_reports_its_first_maps_beside_all() -> None:
    greedy = [make_traj(group_index=g, score=float(g % 2 == 0 or g >= 4)) for g in range(8)]
    assert first_maps_success(greedy, 4) == {"val_first4/success": 0.5}  # groups 0-3: 0 and 2 succeed
    assert first_maps_success([], 4) == {}
