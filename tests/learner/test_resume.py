"""Resuming the trainer: the checkpoint's model, the ledger's version, and the weights producers reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch

from rollstream.consumer.learn.checkpoints import checkpoint_dir
from rollstream.consumer.learn.learner import make_learner
from rollstream.consumer.train import resume
from rollstream.shared.config import ConfigError
from rollstream.shared.keys import Keys
from rollstream.shared.ledger import Ledger
from tests.learner.helpers import TinySampler, even_first_token, learner_config, make_batch, sample_single_turn_groups


def _params(learner) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {k: v.detach().clone() for k, v in learner.strategy.model.state_dict().items()}


@pytest.mark.parametrize("transport", ["filesystem", "redis"])
def test_resume_from_an_older_checkpoint_reannounces_its_weights(transport: str, tmp_path: Path, tiny_model: Path,
                                                                 redis_client: redis.Redis) -> None:
    groups = sample_single_turn_groups(TinySampler(tiny_model, seed=5), groups=2, group_size=4,
                                       reward=even_first_token)
    cfg = learner_config(tmp_path, tiny_model, "torch_train", f"weights_transport={transport}")
    first = make_learner(cfg)
    first.train_step(make_batch(groups, 0))
    first.save_checkpoint(checkpoint_dir(cfg, 1))
    saved = _params(first)
    first.train_step(make_batch(groups, 1))  # step 2 is committed in Redis, then the trainer dies
    ledger = Ledger(redis_client, Keys.for_exp(cfg.exp_name))
    redis_client.set(ledger.keys.version, 2)

    cfg.resume_from_checkpoint = True
    second = make_learner(cfg)
    resume(cfg, second, ledger, version=2)
    assert all(torch.equal(saved[k], v) for k, v in _params(second).items())
    [(_, announced)] = redis_client.xrevrange(ledger.keys.weights, count=1)
    assert announced[b"version"] == b"2"
    if transport == "filesystem":
        assert announced[b"uri"].endswith(b"/weights/v2-resumed-from-1")
    else:  # the producers' copy is in Redis, complete and under its final key before the announcement
        assert announced[b"uri"] == b"redis-chunks:v2-resumed-from-1"
        assert redis_client.hget(ledger.keys.weights_blob("v2-resumed-from-1"), "manifest") is not None

    redis_client.set(ledger.keys.version, 0)  # Redis lost committed steps: refuse, do not guess
    with pytest.raises(RuntimeError, match="at step 1 but the ledger in Redis is at version 0"):
        resume(cfg, second, ledger, version=0)


def test_a_resume_path_that_is_not_a_checkpoint_is_a_config_error(tmp_path: Path, tiny_model: Path) -> None:
    cfg = learner_config(tmp_path, tiny_model, "torch_train", f"resume_from_checkpoint={tmp_path}")
    with pytest.raises(ConfigError, match="not a checkpoint dir"):
        resume(cfg, make_learner(cfg), None, version=0)  # type: ignore[arg-type]
