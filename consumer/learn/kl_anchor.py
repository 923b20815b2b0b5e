"""The format anchor (`kl_anchor_valid_rate`): a KL penalty to the warm start that engages only while a batch's
replies fail to parse.

A policy that loses its reply format has no way back on its own: when every member of every group fails the same
way, every group-relative advantage is zero and the only gradient left is the entropy bonus, which spreads the
policy further (measured on the main job, from a checkpoint whose closing tag was broken by hand: valid replies
0-0.3% for nine steps, entropy 0.01 -> 0.78). The warm start (`pretrain`) writes the format on every reply, so a KL
penalty to it pulls the format back (the same checkpoint with this anchor at 0.5: valid replies 0% at the first
anchored step, 48% ten steps later, 97% at step 30, greedy held-out 0.70; docs/learning.md). A fixed penalty would
also pull every action towards the warm start's uniformly random ones for the whole run; this one costs nothing
while the replies parse.

The gate by the batch's share lets a partial loss run: in a run on a slow machine one reply in seven was an empty
answer (`<answer></answer>`) from step 37 to the end, the gate at 0.5 never engaged, and neither the policy
gradient nor a k3 penalty on those replies' tokens moved them: the policy wrote the closing tag there at p = 0.996,
and a loss on a sampled token reaches the logits scaled by 1 - p (docs/learning.md). `kl_anchor_unparsed_replies`
pulls the positions of the replies that did not parse, and no other, with KL(pretrain || policy) over the whole
vocabulary (`loss.forward_kl`), whose gradient is policy - pretrain however sure the policy is.
"""

from __future__ import annotations

from rollstream.shared.config import RollstreamConfig


def step_kl_coef(cfg: RollstreamConfig, valid_rate: float) -> float:
    """The KL coefficient of a step whose batch has `valid_rate`: init_kl_coef, raised to kl_anchor_coef while the
    rate is below kl_anchor_valid_rate."""
    if cfg.kl_anchor_valid_rate is not None and valid_rate < cfg.kl_anchor_valid_rate:
        return max(cfg.init_kl_coef, cfg.kl_anchor_coef)
    return cfg.init_kl_coef


def unparsed_reply_kl_coef(cfg: RollstreamConfig) -> float:
    """The coefficient of the pull to pretrain at the positions of a reply that did not parse (KL over the whole
    vocabulary): kl_anchor_coef under kl_anchor_unparsed_replies, else 0."""
    return cfg.kl_anchor_coef if cfg.kl_anchor_unparsed_replies else 0.0


def needs_reference(cfg: RollstreamConfig) -> bool:
    """Whether the trainer loads the reference weights: for a fixed penalty, or for an anchor that may engage."""
    return cfg.init_kl_coef > 0 or cfg.kl_anchor_valid_rate is not None or cfg.kl_anchor_unparsed_replies
