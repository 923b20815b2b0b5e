"""The format anchor's coefficient: pure arithmetic on the config and a batch's valid-reply rate."""

from __future__ import annotations

from rollstream.consumer.learn.kl_anchor import needs_reference, step_kl_coef, unparsed_reply_kl_coef
from rollstream.shared.config import RollstreamConfig


def test_the_anchor_engages_below_its_rate_and_never_lowers_a_fixed_penalty() -> None:
    anchored = RollstreamConfig(kl_anchor_valid_rate=0.8, kl_anchor_coef=0.02)
    assert [step_kl_coef(anchored, rate) for rate in (1.0, 0.8, 0.79, 0.0)] == [0.0, 0.0, 0.02, 0.02]
    both = RollstreamConfig(init_kl_coef=0.05, kl_anchor_valid_rate=0.8, kl_anchor_coef=0.02)
    assert [step_kl_coef(both, rate) for rate in (1.0, 0.1)] == [0.05, 0.05]


def test_without_an_anchor_the_coefficient_is_init_kl_coef() -> None:
    assert step_kl_coef(RollstreamConfig(), 0.0) == 0.0
    assert step_kl_coef(RollstreamConfig(init_kl_coef=0.1), 0.0) == 0.1


def test_the_reference_is_loaded_for_a_fixed_penalty_or_an_anchor() -> None:
    assert not needs_reference(RollstreamConfig())
    assert needs_reference(RollstreamConfig(init_kl_coef=0.1))
    assert needs_reference(RollstreamConfig(kl_anchor_valid_rate=0.5))
    assert needs_reference(RollstreamConfig(kl_anchor_unparsed_replies=True))


def test_the_anchor_on_unparsed_replies_has_the_anchor_coefficient() -> None:
    assert unparsed_reply_kl_coef(RollstreamConfig(kl_anchor_coef=0.02)) == 0.0
    assert unparsed_reply_kl_coef(RollstreamConfig(kl_anchor_unparsed_replies=True, kl_anchor_coef=0.02)) == 0.02
