"""The adaptive entropy bonus's controller: pure arithmetic, no model."""

from __future__ import annotations

import pytest

from rollstream.consumer.learn.entropy_control import EntropyControl


def test_the_coefficient_climbs_below_the_target_and_the_bonus_stops_at_once_above_it() -> None:
    control = EntropyControl(0.0, target=0.5, step=0.1, max_coef=0.25)
    bonuses = [control.bonus]
    for entropy in (0.2, 0.3, 0.4, 0.45, 0.6, 0.7, 0.4):
        control.observe(entropy)
        bonuses.append(control.bonus)
    # up by one step per step below the target, held at the ceiling; the first step above the target gives no
    # bonus to the next, and the coefficient walks down (0.15, 0.05) until the entropy is below the target again
    assert bonuses == pytest.approx([0.0, 0.1, 0.2, 0.25, 0.25, 0.0, 0.0, 0.15])
    for _ in range(3):
        control.observe(0.9)
    assert control.coef == 0.0  # never below zero


def test_without_a_target_the_bonus_is_fixed() -> None:
    control = EntropyControl(0.001)
    for entropy in (0.0, 5.0):
        control.observe(entropy)
        assert control.bonus == 0.001


def test_its_state_round_trips() -> None:
    control = EntropyControl(0.0, target=0.5, step=0.1, max_coef=0.25)
    control.observe(0.6)
    control.observe(0.2)
    restored = EntropyControl(0.0, target=0.5, step=0.1, max_coef=0.25)
    restored.restore(control.state())
    assert (restored.coef, restored.bonus) == (control.coef, control.bonus)
