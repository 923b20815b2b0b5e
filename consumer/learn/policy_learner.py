"""The learner that trains a policy: advantages, PPO epochs over mini-batches, weight publication, checkpoints.

A train step reads top to bottom: advantages per trajectory -> padded token tensors -> (recomputed old and
reference logprobs) -> for each PPO epoch, for each shuffled mini-batch: micro-batches sized by a token budget,
forward, loss, backward; one optimizer step per mini-batch (`early_stop_kl` may end the step sooner). The update
is planned first (`plan_shards`: which rows each optimizer step trains on, split over the ranks) and then run
(`run_shard`), which only sees tensors and a strategy: in one process the plan has one shard; with several ranks
(`distributed`) rank 0 plans and every rank runs its own shard.

Old logprobs (the anchor of the PPO ratio), `old_logprobs`:
- "engine" (default): the inference engine's logprobs of the sampled tokens, i.e. the behaviour policy mu that
  really generated them. With async generation (r >= 1) mu is up to r versions older than the trainer's
  weights, so pi_theta / mu is the importance ratio that corrects for it; PPO clips it and the ratio cap
  truncates it for negative advantages. Recomputing old logprobs on the trainer instead would anchor the ratio
  at the trainer's current weights, make it exactly 1 on the first update and hide the staleness.
- "recompute": the trainer's own logprobs before the step's first update (the proximal policy of decoupled
  PPO): the clip then measures only this step's movement, and the staleness is corrected by a separate
  truncated importance weight min(pi_old / mu, ratio_cap) on every token. Useful when the engine's numerics
  differ from the trainer's (e.g. a bf16 engine against an fp32 trainer), at the cost of one extra forward.
Both compare raw (temperature 1) logprobs, which is what the producers record (`logprobs_mode` raw_logprobs).

Banned words (`actor_infer.generating_args.bad_words`): the engine samples from the model's distribution with the
banned tokens taken out, so that is the policy the loss differentiates and whose entropy it measures. Trained
through the full softmax instead, every push down on a sampled token lifted the banned one, which is never
sampled and so never pushed back: in a SimpleSokoban run the banned `<think>` went from 0.54 of the first reply
token's mass to 0.995 by step 50 and 1.000 by step 100, while the rest, the only part the engine samples from,
spread out (entropy 0.04 -> 2.7) into garbled replies, and the entropy the loss saw fell to 0.01. The values stay
the raw logprobs the anchors hold (the engine records raw ones), which is exact while the banned mass does not
move between the behaviour policy and the current one; `actor/banned_mass` shows it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.consumer.data.batch_stats import valid_action_rate
from rollstream.consumer.data.batcher import Batch
from rollstream.consumer.learn.advantages import AdvantageSettings, compute_advantages
from rollstream.consumer.learn.checkpoints import LearnerState, load_learner_state, save_checkpoint, strategy_dir
from rollstream.consumer.learn.entropy_control import EntropyControl
from rollstream.consumer.learn.fatal_moves import fatal_move_positions, success_scaled_coef
from rollstream.consumer.learn.format_likelihood import format_nll, format_positions, spelled_moves
from rollstream.consumer.learn.format_unlikelihood import (
    Piece,
    break_positions,
    reply_formats,
    spells_moves_whole,
    tokenizer_piece,
    unlikelihood,
)
from rollstream.consumer.learn.kl_anchor import needs_reference, step_kl_coef, unparsed_reply_kl_coef
from rollstream.consumer.learn.loss import (
    approx_kl,
    ban_logits,
    banned_sites,
    forward_kl,
    kl_k3,
    masked_sum,
    ppo_policy_loss,
    reply_offsets,
    response_positions,
    response_targets,
    scatter_response,
    token_entropy,
    token_logprobs,
    truncated_importance_weights,
)
from rollstream.consumer.learn.move_share import (
    MoveTokens,
    move_entropy,
    move_names,
    move_positions,
    move_unlikelihood,
    takes_move_share,
)
from rollstream.consumer.learn.no_effect_moves import no_effect_move_positions
from rollstream.consumer.learn.strategy import TrainStrategy, causal_lm_logits, minibatch_size
from rollstream.consumer.learn.tensors import Shard, TokenBatch, build_token_batch, plan_shards
from rollstream.shared import atomic
from rollstream.shared.bad_words import bad_word_ids
from rollstream.shared.config import OldLogprobs, RollstreamConfig, choices
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.schema import Trajectory

log = logging.getLogger(__name__)

OLD_LOGPROB_SOURCES = choices(OldLogprobs)
Adjust = Callable[["UpdateSettings"], "UpdateSettings"]
"""A change to a step's settings, for its loss only (`PolicyLearner.train_step`)."""
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""(input_ids, attention_mask, positions) -> logits; see `TrainStrategy.forward`."""


def reads_moves(blames_among_moves: bool, entropy_among_moves: bool, format_likelihood_coef: float) -> bool:
    """A term of the loss reads the mass of the tokens that begin a move at each valid reply's action token: the move
    terms' shares among moves, the entropy among moves, or p(any move) of the format's likelihood."""
    return blames_among_moves or entropy_among_moves or format_likelihood_coef > 0


@dataclass(frozen=True)
class UpdateSettings:
    clip_eps: float = 0.2
    """PPO clip range below 1 (`pg_clip`, or `pg_clip_low` with `use_pg_clip_range`)."""
    ratio_cap: float = 3.0
    """Truncation of the importance ratio (`is_ratio_cap`), see the module docstring."""
    old_logprobs: OldLogprobs = "engine"
    """engine | recompute."""
    kl_coef: float = 0.0
    """k3 KL penalty to the reference (initial) weights (`init_kl_coef`; a step's own with `kl_anchor_valid_rate`)."""
    entropy_coef: float = 0.0
    """Entropy bonus (`entropy_loss_coef`)."""
    ppo_epochs: int = 1
    minibatch_size: int = 8
    """Trajectories per optimizer step."""
    microbatch_rows: int = 8
    """Rows per micro-batch when there is no token budget."""
    max_tokens_per_microbatch: int = 0
    """Token budget (rows x longest row) of a micro-batch; 0 uses `microbatch_rows`."""
    logprob_rows: int | None = None
    """Rows per no-grad forward of the old and reference logprobs (`actor_train.infer_batch_size`); None uses
    `microbatch_rows`."""
    clip_eps_high: float | None = None
    """PPO clip range above 1 (`pg_clip_high` with `use_pg_clip_range`); None: the same as `clip_eps`."""
    skip_zero_advantage: bool = False
    """Run no forward or backward on rows whose gradient is exactly zero (see `rows_with_gradient`)."""
    early_stop_kl: float | None = None
    """A mini-batch whose approximate KL (before its update) exceeds this ends the train step untrained."""
    bad_words: tuple[tuple[int, ...], ...] = ()
    """Token ids of the words the engine may not sample (`bad_word_ids`): the loss trains the distribution it
    sampled from (see the module docstring)."""
    unparsed_kl_coef: float = 0.0
    """Coefficient of KL(reference || policy) at the positions of replies that did not parse
    (`kl_anchor_unparsed_replies`)."""
    format_unlikelihood_coef: float = 0.0
    """Coefficient of -log(1 - p) on each unparsed reply's format-breaking token (`format_unlikelihood`)."""
    fatal_move_unlikelihood_coef: float = 0.0
    """Coefficient of -log(1 - p) on the action token of each episode's fatal move (`fatal_moves`)."""
    no_effect_unlikelihood_coef: float = 0.0
    """Coefficient of -log(1 - p) on the action token of each move that changed nothing (`no_effect_moves`)."""
    move_tokens: MoveTokens | None = None
    """The tokens that begin a move, when a term below takes the moves' shares (`move_share`); None when none does."""
    blames_among_moves: bool = False
    """The two terms above take the blamed move's share of the moves' mass for p (`move_unlikelihood_among_moves`);
    False: p over the vocabulary."""
    entropy_among_moves: bool = False
    """The entropy bonus is the entropy of the moves' shares at each valid reply's action token
    (`entropy_among_moves`); False: the token entropy of every response position."""
    format_likelihood_coef: float = 0.0
    """Coefficient of -log p on each valid reply's format tokens and of -log p(any move) at its action token
    (`format_likelihood`)."""
    format_move_ids: torch.Tensor | None = None
    """The tokens p(any move) sums (`format_likelihood_moves: spelled`, the step's own); None: `move_tokens`'."""
    policy_loss_coef: float = 1.0
    """Coefficient of the PPO policy loss: 1 in training; 0 takes the policy gradient out of an update taken apart
    (`benchmarks/replay_update.py`)."""

    @property
    def has_kl_term(self) -> bool:
        """The loss has a KL penalty to the reference, so the step needs the reference's logprobs."""
        return self.kl_coef > 0

    @property
    def anchors_unparsed(self) -> bool:
        """The loss pulls the positions of unparsed replies to the reference (`unparsed_drift`): the rows that hold
        them have a gradient whatever their advantage."""
        return self.unparsed_kl_coef > 0

    @property
    def trains_unparsed(self) -> bool:
        """A term of the loss acts on unparsed replies whatever their advantage, so their rows have a gradient."""
        return self.anchors_unparsed or self.format_unlikelihood_coef > 0

    @property
    def has_entropy_term(self) -> bool:
        """The loss has an entropy bonus."""
        return self.entropy_coef != 0

    @property
    def zero_advantage_rows_have_no_gradient(self) -> bool:
        """A KL penalty, an entropy bonus or the format's likelihood gives every row a gradient, whatever its
        advantage."""
        return not self.has_kl_term and not self.has_entropy_term and self.format_likelihood_coef == 0

    def __post_init__(self) -> None:
        if self.old_logprobs not in OLD_LOGPROB_SOURCES:
            raise ValueError(f"old_logprobs={self.old_logprobs!r}: must be one of {', '.join(OLD_LOGPROB_SOURCES)}")
        if self.takes_moves and self.move_tokens is None:
            raise ValueError("a term takes the moves' shares or mass (move_unlikelihood_among_moves, "
                             "entropy_among_moves, format_likelihood_coef), but the settings hold no move tokens")

    @property
    def takes_moves(self) -> bool:
        """A term reads the mass of the tokens that begin a move at each valid reply's action token."""
        return reads_moves(self.blames_among_moves, self.entropy_among_moves, self.format_likelihood_coef)

    @classmethod
    def from_config(cls, cfg: RollstreamConfig, tokenizer: Any = None) -> UpdateSettings:
        """The config's settings; `tokenizer` (the trained model's) turns `bad_words` into token ids and finds the
        tokens that begin a move, and a config that bans words or takes a move's share among moves needs it."""
        args = cfg.actor_train.training_args
        low, high = cfg.pg_clip_range
        words = tuple(cfg.actor_infer.generating_args.bad_words)
        # entropy_among_moves comes with an entropy bonus: the config check refuses it without one
        blames, entropy = takes_move_share(cfg), cfg.entropy_among_moves
        takes_moves = reads_moves(blames, entropy, cfg.format_likelihood_coef)
        names = move_names(reply_formats(cfg.custom_envs)) if takes_moves else ()
        if takes_moves and not names:
            raise ValueError("move_unlikelihood_among_moves, entropy_among_moves or format_likelihood_coef: no env of "
                             "custom_envs replies in the built-in format, so there are no moves to read; drop the key")
        if (words or names) and tokenizer is None:
            raise ValueError("UpdateSettings.from_config: this config bans words (bad_words) or reads the moves "
                             "(move_unlikelihood_among_moves, entropy_among_moves, format_likelihood_coef); pass the "
                             "model's tokenizer so that the loss can find those tokens")
        banned = tuple(tuple(ids) for ids in bad_word_ids(tokenizer, words)) if words else ()
        moves = MoveTokens.of(tokenizer_piece(tokenizer), len(tokenizer), names) if names else None
        return cls(low, cfg.is_ratio_cap, cfg.old_logprobs, cfg.init_kl_coef, cfg.entropy_loss_coef,
                   cfg.ppo_epochs, minibatch_size(cfg), args.per_device_train_batch_size,
                   args.max_tokens_per_microbatch, cfg.actor_train.infer_batch_size, high, cfg.skip_zero_advantage,
                   cfg.early_stop_kl, banned, unparsed_reply_kl_coef(cfg), cfg.format_unlikelihood_coef,
                   cfg.fatal_move_unlikelihood_coef, cfg.no_effect_unlikelihood_coef, moves, blames, entropy,
                   cfg.format_likelihood_coef)


class PolicyLearner:
    """The `Learner` for `torch_train` and `deepspeed_train`: trains `strategy`'s model on each batch."""

    def __init__(self, cfg: RollstreamConfig, strategy: TrainStrategy) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.pretrain)
        self.settings = UpdateSettings.from_config(cfg, self.tokenizer)
        self.advantages = AdvantageSettings.from_config(cfg)
        self.weights_dir = Path(cfg.output_dir) / "weights"
        self.generator = torch.Generator().manual_seed(cfg.seed)
        """Shuffles mini-batches; its state is part of a checkpoint."""
        self.reference = load_reference(cfg, strategy.device) if needs_reference(cfg) else None
        self.entropy_control = EntropyControl.from_config(cfg)
        self.finds_breaks = cfg.format_unlikelihood_coef > 0 or cfg.format_break_ends_advantage
        """The format term blames the breaks, or the advantage ends at them."""
        finds = (self.finds_breaks or cfg.fatal_move_unlikelihood_coef > 0 or cfg.no_effect_unlikelihood_coef > 0
                 or self.settings.takes_moves)
        self.reply_formats = reply_formats(cfg.custom_envs) if finds else {}
        """Action names by env tag (the tags whose replies use the built-in format), for finding where an unparsed
        reply broke the format and where a move (fatal, one that changed nothing, any valid one) chose its action."""
        self.piece: Piece = tokenizer_piece(self.tokenizer)
        """A token's text; None for a special token (end-of-sequence ends a reply)."""
        self.whole_moves = spells_moves_whole(self.tokenizer, self.reply_formats)
        """Per tag: every move is one token, so an answer begun with any other token broke there (`format_break`)."""
        self.steps_done = 0

    def train_step(self, batch: Batch, adjust: Adjust | None = None) -> dict[str, float]:
        """Advantages, token tensors, PPO update; returns metrics namespaced loss/, actor/, adv/, time/. `adjust`
        changes the step's settings for its loss only, the mini-batches staying as the step's own settings plan
        them (a term taken out of an update, `benchmarks/replay_update.py`)."""
        start = time.monotonic()
        groups = [g.trajectories for g in batch.groups]
        trajs = [t for group in groups for t in group]
        advantages = compute_advantages(groups, self.advantages)
        breaks = self.marked_tokens(trajs, self.finds_breaks,
                                    lambda t: break_positions(t, self.piece, self.reply_formats[t.tag],
                                                              whole_moves=self.whole_moves[t.tag]))
        fatal = self.marked_tokens(trajs, self.settings.fatal_move_unlikelihood_coef > 0,
                                   lambda t: fatal_move_positions(t, self.piece))
        no_effect = self.marked_tokens(trajs, self.settings.no_effect_unlikelihood_coef > 0,
                                       lambda t: no_effect_move_positions(t, self.piece))
        # An update taken apart may add the format's likelihood to a run without it: its tokens are marked for it.
        keeps_format = (adjust(self.settings) if adjust else self.settings).format_likelihood_coef > 0
        moves = self.marked_tokens(trajs, self.settings.entropy_among_moves or keeps_format,
                                   lambda t: move_positions(t, self.piece))
        format_tokens = None if moves is None or not keeps_format else [
            format_positions(t, actions) if t.tag in self.reply_formats else [] for t, actions in zip(trajs, moves)]
        tokens = build_token_batch(trajs, advantages, whiten=self.cfg.whiten_advantages, clip=self.cfg.adv_clip,
                                   breaks=breaks, fatal=fatal, no_effect=no_effect, moves=moves,
                                   format_tokens=format_tokens,
                                   advantage_ends_at_breaks=self.cfg.format_break_ends_advantage)
        check_trainable(tokens, batch.step)
        metrics = advantage_stats(tokens)
        metrics["actor/zero_adv_rows"] = float(tokens.num_rows - int(rows_with_gradient(tokens).sum()))
        metrics["time/advantages_s"] = time.monotonic() - start
        # The terms that blame moves wait for the goal to be found (fatal_moves, no_effect_moves).
        settings = replace(self.settings, entropy_coef=self.entropy_control.bonus,
                           kl_coef=step_kl_coef(self.cfg, valid_action_rate(trajs)),
                           fatal_move_unlikelihood_coef=success_scaled_coef(self.cfg.fatal_move_unlikelihood_coef,
                                                                            trajs),
                           no_effect_unlikelihood_coef=success_scaled_coef(self.cfg.no_effect_unlikelihood_coef, trajs))
        if keeps_format and self.cfg.format_likelihood_moves == "spelled" and tokens.move_mask is not None:
            settings = replace(settings, format_move_ids=spelled_moves(tokens.input_ids, tokens.move_mask))
        metrics |= self.update(tokens, settings, adjust)
        metrics["actor/entropy_coef"] = settings.entropy_coef
        if fatal is not None:
            metrics["actor/fatal_move_coef"] = settings.fatal_move_unlikelihood_coef
        if no_effect is not None:
            metrics["actor/no_effect_coef"] = settings.no_effect_unlikelihood_coef
        metrics["actor/kl_coef"] = settings.kl_coef
        self.entropy_control.observe(metrics["loss/entropy"])
        self.steps_done += 1
        return metrics

    def marked_tokens(self, trajs: list[Trajectory], on: bool,
                      find: Callable[[Trajectory], list[int]]) -> list[list[int]] | None:
        """Each trajectory's token indices that a term marks (`find`; none for a tag whose replies are not in the
        built-in format); None when the term is off."""
        if not on:
            return None
        return [find(t) if t.tag in self.reply_formats else [] for t in trajs]

    def update(self, tokens: TokenBatch, settings: UpdateSettings, adjust: Adjust | None = None) -> dict[str, float]:
        """The PPO update on the whole batch with this step's settings (a multi-rank leader splits it over the
        ranks instead)."""
        return ppo_update(self.strategy, tokens, settings, self.generator, self.reference, adjust)

    def publish(self, version: int, suffix: str = "") -> WeightsAnnouncement:
        """Write `version` as a HF safetensors directory <output_dir>/weights/v<version><suffix>, atomically."""
        final = self.weights_dir / f"v{version}{suffix}"
        if final.exists():
            # Published by an earlier run that crashed before committing the step: the version was never
            # announced (announcing is part of the commit), so no producer loads it and it can be replaced.
            log.warning("replacing unannounced weights %s left by an interrupted run", final)
            shutil.rmtree(atomic.move_aside(final), ignore_errors=True)
        digest = self.strategy.publish_weights(final, self.tokenizer)
        return WeightsAnnouncement(version, final.resolve().as_uri(), digest)

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Model, optimizer, lr schedule, RNG and step count into `directory`, replaced atomically."""
        save_checkpoint(directory, self.save_strategy,
                        LearnerState(self.steps_done, self.generator, self.entropy_control.state()))

    def save_strategy(self, directory: Path) -> None:
        """The strategy's part of a checkpoint (a multi-rank leader has every rank write its part)."""
        self.strategy.save_checkpoint(directory)

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        self.strategy.load_checkpoint(strategy_dir(directory))
        state = load_learner_state(directory, self.generator)
        self.steps_done = state.steps_done
        if state.entropy_control is not None:
            self.entropy_control.restore(state.entropy_control)

    def close(self) -> None:
        self.reference = None
        self.strategy.close()


def check_trainable(tokens: TokenBatch, step: int) -> None:
    """Refuse batches the loss would silently mistrain on."""
    if tokens.num_response_tokens == 0:
        raise ValueError(f"batch of step {step} has no response tokens: a training strategy needs a policy that "
                         "records token ids (hf_infer or vllm), not the scripted one")
    # A policy that records no logprobs leaves 0.0 (probability 1) on every generated token; both old-logprob
    # modes compare against them, and exp(logp - 0) would read as a hugely stale behaviour policy.
    if bool((tokens.behaviour_logprobs[tokens.response_mask > 0] == 0).all()):
        raise ValueError(f"batch of step {step}: every generated token has engine logprob 0.0, so the policy did "
                         "not record logprobs; the importance ratio needs them")


def rows_with_gradient(tokens: TokenBatch, trains_unparsed: bool = False) -> torch.Tensor:
    """Which rows have a non-zero advantage on some response token, or a move the loss blames (with
    `trains_unparsed`: or a reply that did not parse), as a (B,) bool tensor.

    The policy-gradient term of every other row is exactly zero (a group whose members all scored the same), so
    without a KL penalty or an entropy bonus its forward and backward passes add nothing to the gradient."""
    rows = ((tokens.advantages != 0) & (tokens.response_mask > 0)).any(dim=1)
    for blamed in (tokens.fatal_mask, tokens.no_effect_mask):  # built only when their terms are on
        if blamed is not None:
            rows = rows | (blamed > 0).any(dim=1)
    return rows | unparsed_rows(tokens) if trains_unparsed else rows


def unparsed_rows(tokens: TokenBatch) -> torch.Tensor:
    """Which rows hold a reply that did not parse, as a (B,) bool tensor."""
    if tokens.unparsed_mask is None:
        return torch.zeros(tokens.num_rows, dtype=torch.bool)
    return (tokens.unparsed_mask > 0).any(dim=1)


def load_reference(cfg: RollstreamConfig, device: torch.device) -> Forward:
    """The initial weights (`pretrain`), frozen, for the KL penalty."""
    dtype = torch.bfloat16 if cfg.actor_train.model_args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(cfg.pretrain), dtype=dtype,
                                                 attn_implementation=cfg.actor_train.model_args.attn_implementation)
    torch.nn.Module.to(model, device)  # in place; typed oddly by transformers
    model.eval().requires_grad_(False)

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        return causal_lm_logits(model, model.get_output_embeddings(), input_ids, attention_mask, positions)

    return forward


def advantage_stats(tokens: TokenBatch) -> dict[str, float]:
    values = tokens.advantages[tokens.response_mask > 0]
    return {"adv/mean": float(values.mean()), "adv/std": float(values.std(correction=0)),
            "adv/min": float(values.min()), "adv/max": float(values.max())}


@torch.no_grad()
def frozen_logprobs(forward: Forward, shard: Shard, device: torch.device, pad: bool = False) -> torch.Tensor:
    """Logprobs of every target token of the shard under `forward`, micro-batch by micro-batch, as one (B, T - 1)
    tensor. With `pad`, idle forwards bring the count up to what every rank runs (ZeRO-3 gathers in forward)."""
    tokens = shard.tokens
    out = torch.zeros_like(tokens.response_mask)
    for rows in shard.logprob_microbatches:
        part = tokens.rows(rows).to(device)
        logprobs = response_logprobs(forward, part).logprobs  # bans change no value, only gradients
        out[rows, : logprobs.shape[1]] = logprobs.float().cpu()
    for _ in range(shard.num_logprob_microbatches - len(shard.logprob_microbatches) if pad else 0):
        idle_logits(forward, device)
    return out * tokens.response_mask


def idle_logits(forward: Forward, device: torch.device) -> torch.Tensor:
    """Logits of a two-token dummy row: the forward a rank with nothing left to do runs to match the others.
    It takes the same path as a real micro-batch (logits at chosen positions), so ZeRO-3 gathers the same modules."""
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    return forward(ids, torch.ones_like(ids), torch.tensor([[True, False]], device=device))


@dataclass
class ResponseLogprobs:
    """One micro-batch's forward, as the loss and the metrics need it."""

    logits: torch.Tensor
    """(N, V) where `part` has a response token to predict; with banned words, banned sites at the lowest float."""
    logprobs: torch.Tensor
    """(B, T - 1): each response token's raw logprob; with banned words, differentiated through the distribution
    without them."""
    banned_mass: torch.Tensor | None = None
    """(N,) the raw probability of the banned tokens at each response position; None without banned words."""


def response_logprobs(forward: Forward, part: TokenBatch, bad_words: tuple[tuple[int, ...], ...] = ()
                      ) -> ResponseLogprobs:
    """The response positions' logits and their tokens' logprobs; `bad_words` as in `UpdateSettings`."""
    logits = forward(part.input_ids, part.attention_mask, response_positions(part.response_mask))
    targets = response_targets(part.input_ids, part.response_mask)
    if not bad_words:
        return ResponseLogprobs(logits, scatter_response(token_logprobs(logits, targets), part.response_mask))
    banned = ban_logits(logits, banned_sites(targets, reply_offsets(part.response_mask), bad_words))
    log_normalizer = torch.logsumexp(banned, dim=-1)
    # log(1 - banned mass): the raw logprob is the unbanned one plus this; detached, it keeps the raw value and
    # the unbanned gradient (the module docstring). Each normalizer over the vocabulary is computed once.
    log_unbanned_share = (log_normalizer - torch.logsumexp(logits.float(), dim=-1)).detach()
    logprobs = token_logprobs(banned, targets, log_normalizer) + log_unbanned_share
    return ResponseLogprobs(banned, scatter_response(logprobs, part.response_mask), -torch.expm1(log_unbanned_share))


def microbatch_loss(forward: Forward, part: TokenBatch, settings: UpdateSettings, normalizer: float,
                    reference: Forward | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch, scaled so that summing over a mini-batch gives token means; and sums for metrics.
    `reference` runs here only for the anchor on unparsed replies (the KL penalty's logprobs come precomputed)."""
    mask = part.response_mask
    response = response_logprobs(forward, part, settings.bad_words)
    logits, logprobs = response.logits, response.logprobs
    # The ratio's anchor, and the off-policy weight where the anchor is not the behaviour policy.
    if settings.old_logprobs == "engine":
        old, weights = part.behaviour_logprobs, None
    else:
        assert part.old_logprobs is not None
        old = part.old_logprobs
        weights = truncated_importance_weights(old, part.behaviour_logprobs, settings.ratio_cap)
    pg = ppo_policy_loss(logprobs, old, part.advantages, clip_eps=settings.clip_eps,
                         clip_eps_high=settings.clip_eps_high, ratio_cap=settings.ratio_cap,
                         weights=weights)
    loss = settings.policy_loss_coef * masked_sum(pg.loss, mask) / normalizer
    sums = {"pg": masked_sum(pg.loss, mask).detach(), "clip": masked_sum(pg.clipped, mask),
            "truncated": masked_sum(pg.truncated, mask), "ratio": masked_sum(pg.ratio, mask),
            "approx_kl": masked_sum(approx_kl(logprobs.detach(), old), mask)}
    if weights is not None:
        sums["is_weight"] = masked_sum(weights, mask)
    if settings.has_kl_term:
        assert part.ref_logprobs is not None
        kl = masked_sum(kl_k3(logprobs, part.ref_logprobs), mask)
        loss = loss + settings.kl_coef * kl / normalizer
        sums["kl"] = kl.detach()
    if settings.anchors_unparsed and reference is not None:
        drift = unparsed_drift(logits, part, reference)
        if drift is not None:
            loss = loss + settings.unparsed_kl_coef * drift / normalizer
            sums["unparsed_kl"] = drift.detach()
    # Unlikelihood on the tokens each term blames (format_unlikelihood; fatal_moves and no_effect_moves blame a move).
    blamed_terms = ((settings.format_unlikelihood_coef, part.break_mask, "unlikelihood", "format_breaks", False),
                    (settings.fatal_move_unlikelihood_coef, part.fatal_mask, "fatal_unlikelihood", "fatal_moves",
                     True),
                    (settings.no_effect_unlikelihood_coef, part.no_effect_mask, "no_effect_unlikelihood",
                     "no_effect_moves", True))
    for coef, blamed, term, count, blames_a_move in blamed_terms:
        if coef > 0 and blamed is not None:
            if blames_a_move and settings.blames_among_moves:
                assert settings.move_tokens is not None  # __post_init__
                at = blamed[mask > 0] > 0  # the blamed rows of the response logits
                targets = response_targets(part.input_ids, mask)[at]
                away = move_unlikelihood(logits[at], targets, logprobs[blamed > 0], settings.move_tokens)
            else:
                away = unlikelihood(logprobs, blamed)
            loss = loss + coef * away / normalizer
            sums[term] = away.detach()
            sums[count] = blamed.sum()
    if settings.format_likelihood_coef > 0 and part.format_mask is not None and part.move_mask is not None:
        assert settings.move_tokens is not None  # __post_init__
        move_ids = settings.move_tokens.ids if settings.format_move_ids is None else settings.format_move_ids
        kept = format_nll(logits, logprobs, mask, part.format_mask, part.move_mask, move_ids)
        loss = loss + settings.format_likelihood_coef * kept / normalizer
        sums["format_likelihood"] = kept.detach()
    # The token entropy keeps its graph only when it is the loss's bonus.
    bonus_over_vocab = settings.has_entropy_term and not settings.entropy_among_moves
    with torch.set_grad_enabled(bonus_over_vocab and torch.is_grad_enabled()):
        entropy = token_entropy(logits).sum()  # the logits are the response positions' only
    if settings.entropy_among_moves and part.move_mask is not None:
        assert settings.move_tokens is not None  # __post_init__
        among_moves = move_entropy(logits[part.move_mask[mask > 0] > 0], settings.move_tokens).sum()
        if settings.has_entropy_term:
            loss = loss - settings.entropy_coef * among_moves / normalizer
        sums["move_entropy"] = among_moves.detach()
        sums["moves"] = part.move_mask.sum()
    elif bonus_over_vocab:
        loss = loss - settings.entropy_coef * entropy / normalizer
    sums["entropy"] = entropy.detach()
    if response.banned_mass is not None:
        sums["banned_mass"] = response.banned_mass.sum()
    sums["ratio_max"] = (pg.ratio * mask).max()
    return loss, sums


def unparsed_drift(logits: torch.Tensor, part: TokenBatch, reference: Forward) -> torch.Tensor | None:
    """The summed KL(reference || policy) over the positions of `part`'s replies that did not parse (`logits`: the
    policy's response logits, banned sites at the lowest float); None when every reply parsed. The reference runs on
    the rows that hold such a reply only, and its banned sites are banned as the policy's: both distributions are
    over what the engine samples from."""
    rows = unparsed_rows(part)
    if part.unparsed_mask is None or not bool(rows.any()):
        return None
    held = part.rows(rows.nonzero().squeeze(1))
    with torch.no_grad():
        ref_logits = reference(held.input_ids, held.attention_mask, response_positions(held.response_mask)).float()
    # The policy's logits rows (one per response position, row-major) of those rows: the reference's order
    response = part.response_mask > 0
    selected = response & rows[:, None]
    policy = logits[selected[response]]
    ref_logits = torch.where(policy == torch.finfo(policy.dtype).min, policy.detach(), ref_logits)
    anchored = (part.unparsed_mask > 0)[selected]
    return forward_kl(policy[anchored], ref_logits[anchored]).sum()


TALLY_KEYS = frozenset({"pg", "clip", "truncated", "ratio", "approx_kl", "is_weight", "kl", "unparsed_kl", "entropy",
                        "banned_mass", "unlikelihood", "format_breaks", "fatal_unlikelihood", "fatal_moves",
                        "no_effect_unlikelihood", "no_effect_moves", "move_entropy", "moves", "format_likelihood",
                        "tokens"})
"""Every sum a Tally may hold; ranks reduce them in this (sorted) order, whichever they saw."""


@dataclass
class Tally:
    """What the micro-batches and optimizer steps of one update add up to; token-weighted means at the end."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ratio_max: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    tokens_seen: int = 0
    """Every token the model ran forward and backward on, prompts included (for tokens_per_s)."""
    minibatch_kl_sums: list[tuple[float, float]] = field(default_factory=list)
    """Each mini-batch's (approximate KL sum, response tokens), as measured before its update; summed over the ranks
    with the rest at the end, so without `early_stop_kl` a step adds no collective of its own."""
    stopped_early: bool = False

    def add_microbatch(self, sums: dict[str, torch.Tensor], part: TokenBatch) -> None:
        for key, value in sums.items():
            if key == "ratio_max":
                self.ratio_max = max(self.ratio_max, float(value))
            else:
                self.sums[key] += float(value)
        self.sums["tokens"] += float(part.response_mask.sum())
        self.tokens_seen += int(part.attention_mask.sum())

    def add_step(self, lr: float, grad_norm: float) -> None:
        self.lrs.append(lr)
        self.grad_norms.append(grad_norm)

    def all_reduce(self, device: torch.device) -> None:
        """Sum the token sums of every rank (grad norms and lrs are global already), so metrics cover the batch."""
        keys = sorted(TALLY_KEYS)
        present = [1.0 if k in self.sums else 0.0 for k in keys]  # is_weight and kl exist only in some modes
        steps = [x for pair in self.minibatch_kl_sums for x in pair]  # as many mini-batches on every rank
        sums = torch.tensor([self.sums.get(k, 0.0) for k in keys] + [float(self.tokens_seen)] + steps,
                            dtype=torch.float64, device=device)
        most = torch.tensor(present + [self.ratio_max], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        totals = sums.tolist()
        self.sums = defaultdict(float, {k: v for k, v, p in zip(keys, totals, most[:-1]) if p > 0})
        self.tokens_seen = int(totals[len(keys)])
        reduced = totals[len(keys) + 1:]
        self.minibatch_kl_sums = list(zip(reduced[::2], reduced[1::2]))
        self.ratio_max = float(most[-1])

    def metrics(self, update_s: float) -> dict[str, float]:
        n = max(self.sums["tokens"], 1.0)
        out = {
            "loss/pg": self.sums["pg"] / n,
            "loss/kl": self.sums["kl"] / n,
            "loss/unparsed_kl": self.sums["unparsed_kl"] / n,
            "loss/entropy": self.sums["entropy"] / n,
            "actor/clip_frac": self.sums["clip"] / n,
            "actor/truncated_frac": self.sums["truncated"] / n,
            "actor/approx_kl": self.sums["approx_kl"] / n,
            "actor/ratio_mean": self.sums["ratio"] / n,
            "actor/ratio_max": self.ratio_max,
            "actor/grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else 0.0,
            "actor/optimizer_steps": float(len(self.grad_norms)),
            "actor/approx_kl_max": max((kl / n for kl, n in self.minibatch_kl_sums if n > 0), default=0.0),
            "actor/early_stopped": float(self.stopped_early),
            "actor/tokens_per_s": self.tokens_seen / update_s if update_s > 0 else 0.0,
        }
        if self.lrs:
            out["actor/lr"] = self.lrs[-1]
        if "is_weight" in self.sums:
            out["actor/is_weight_mean"] = self.sums["is_weight"] / n
        if "banned_mass" in self.sums:
            out["actor/banned_mass"] = self.sums["banned_mass"] / n
        if "unlikelihood" in self.sums:
            out["loss/format_unlikelihood"] = self.sums["unlikelihood"] / n
            out["actor/format_breaks"] = self.sums["format_breaks"]
        if "fatal_unlikelihood" in self.sums:
            out["loss/fatal_unlikelihood"] = self.sums["fatal_unlikelihood"] / n
            out["actor/fatal_moves"] = self.sums["fatal_moves"]
        if "no_effect_unlikelihood" in self.sums:
            out["loss/no_effect_unlikelihood"] = self.sums["no_effect_unlikelihood"] / n
            out["actor/no_effect_moves"] = self.sums["no_effect_moves"]
        if "format_likelihood" in self.sums:
            out["loss/format_likelihood"] = self.sums["format_likelihood"] / n
        if "move_entropy" in self.sums:
            out["loss/move_entropy"] = self.sums["move_entropy"] / max(self.sums["moves"], 1.0)
        return out


def minibatch_kl(kl_sum: float, tokens: float, device: torch.device) -> float:
    """One mini-batch's token-mean approximate KL over all ranks, so that every rank takes the same early stop."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        both = torch.tensor([kl_sum, tokens], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM)
        kl_sum, tokens = both.tolist()
    return kl_sum / tokens if tokens > 0 else 0.0


def ppo_update(strategy: TrainStrategy, tokens: TokenBatch, settings: UpdateSettings, generator: torch.Generator,
               reference: Forward | None = None, adjust: Adjust | None = None) -> dict[str, float]:
    """PPO epochs over shuffled mini-batches of `tokens`, one optimizer step per mini-batch; returns metrics.
    `adjust` changes the settings of the loss, not of the plan."""
    shard, = plan_update(tokens, settings, generator, world_size=1)
    return run_shard(strategy, shard, adjust(settings) if adjust else settings, reference)


def plan_update(tokens: TokenBatch, settings: UpdateSettings, generator: torch.Generator,
                world_size: int) -> list[Shard]:
    """Every rank's shard of one update: `settings.minibatch_size` rows per optimizer step over all ranks."""
    skip = settings.skip_zero_advantage and settings.zero_advantage_rows_have_no_gradient
    return plan_shards(tokens, world_size, epochs=settings.ppo_epochs, minibatch_size=settings.minibatch_size,
                       generator=generator, max_tokens=settings.max_tokens_per_microbatch,
                       max_rows=settings.microbatch_rows, logprob_rows=settings.logprob_rows,
                       trained=rows_with_gradient(tokens, settings.trains_unparsed) if skip else None)


def run_shard(strategy: TrainStrategy, shard: Shard, settings: UpdateSettings,
              reference: Forward | None = None) -> dict[str, float]:
    """Run this rank's part of an update; with several ranks every one calls this, with the same number of steps.
    Returns metrics over all ranks' tokens."""
    start = time.monotonic()
    tokens = shard.tokens
    # Old and reference logprobs come from the weights as they are before this step's first update. The reference
    # runs only on a step with a KL term: under the format anchor such a step is rare, and its forward over the
    # whole batch took a quarter of the main job's train time. It is whole on every rank, so skipping needs no
    # collective.
    if settings.old_logprobs == "recompute":
        tokens.old_logprobs = frozen_logprobs(strategy.forward, shard, strategy.device, pad=True)
    if reference is not None and settings.has_kl_term:
        tokens.ref_logprobs = frozen_logprobs(reference, shard, strategy.device)
    logprobs_done = time.monotonic()

    tally = Tally()
    for step in shard.steps:
        kl_before, tokens_before = tally.sums["approx_kl"], tally.sums["tokens"]
        # Every micro-batch's loss is divided by the mini-batch's token count: accumulated, a token mean.
        for rows in step.microbatches:
            part = tokens.rows(rows).to(strategy.device)
            loss, sums = microbatch_loss(strategy.forward, part, settings, step.normalizer, reference)
            strategy.backward(loss)
            tally.add_microbatch(sums, part)
        for _ in range(step.num_microbatches - len(step.microbatches)):
            # Zero weight, but a real backward: every parameter gets a (zero) gradient, so ZeRO's hooks fire.
            strategy.backward(idle_logits(strategy.forward, strategy.device).sum() * 0.0)
        kl_sum, kl_tokens = tally.sums["approx_kl"] - kl_before, tally.sums["tokens"] - tokens_before
        tally.minibatch_kl_sums.append((kl_sum, kl_tokens))
        limit = settings.early_stop_kl
        if limit is not None and minibatch_kl(kl_sum, kl_tokens, strategy.device) > limit:
            strategy.discard_gradients()
            tally.stopped_early = True
            break
        tally.add_step(strategy.lr, strategy.optimizer_step())
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        tally.all_reduce(strategy.device)
    update_s = time.monotonic() - logprobs_done
    return {"actor/lr": strategy.lr, **tally.metrics(update_s),
            "time/logprobs_s": logprobs_done - start, "time/update_s": update_s}
