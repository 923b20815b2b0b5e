"""The scripted policy as a config makes it: every option its constructor takes is a checked config key."""

import dataclasses
import inspect

from rollstream.producer.policy.factory import make_policy
from rollstream.producer.policy.scripted import ScriptedPolicy
from rollstream.shared.config_checks import ScriptedOptions
from tests.conftest import scripted_config


def test_every_constructor_option_is_a_config_key() -> None:
    # benchmarks/async_vs_sync.py sets turn_latency_s; the typed options once lacked it and refused its config
    taken = {name for name, p in inspect.signature(ScriptedPolicy).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert taken == {f.name for f in dataclasses.fields(ScriptedOptions)}


def test_a_configured_turn_latency_reaches_the_policy(tmp_path) -> None:
    cfg = scripted_config(tmp_path, "actor_infer.strategy_args.strategy_config.turn_latency_s=0.25")
    policy = make_policy(cfg)
    assert isinstance(policy, ScriptedPolicy) and policy.turn_latency_s == 0.25
