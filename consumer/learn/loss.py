"""The policy-gradient loss and its parts, token by token. Pure torch functions.

Every per-token tensor is (B, T - 1), aligned on target tokens (see `tensors`). Logits are computed only
where a response token is predicted (N, V): most of a multi-turn trajectory is prompt, so the lm_head and the
softmax over the vocabulary would otherwise dominate the cost of a small model. Losses are summed over
response tokens and divided by a `normalizer` the caller chooses: the number of response tokens in the whole
mini-batch, so that gradient accumulation over micro-batches of any size gives exactly the token mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# exp() of a log-ratio beyond this overflows nothing and is clipped or truncated anyway; without the clamp a
# token whose policy moved far (or a garbage engine logprob) makes inf * 0 = NaN where the advantage is 0.
MAX_LOG_RATIO = 20.0


def response_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions whose logits predict a response token. Column j of the (B, T - 1) response mask
    is about token j + 1, which the logits at position j predict; the last position predicts nothing."""
    return torch.nn.functional.pad(response_mask > 0, (0, 1))


def response_targets(input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The response tokens of a (B, T) batch as (N,), in the row-major order of `response_positions`."""
    return input_ids[:, 1:][response_mask > 0]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   log_normalizer: torch.Tensor | None = None) -> torch.Tensor:
    """log p(target) for logits (..., V) and targets (...), in float32; `log_normalizer`, the logits' logsumexp
    (...), where the caller has it already.

    Gather minus logsumexp rather than a full log_softmax: one float tensor of the logits' size fewer.
    """
    logits = logits.float()
    if log_normalizer is None:
        log_normalizer = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_normalizer


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution of logits (..., V), as (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def forward_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || policy) of each next-token distribution, over the whole vocabulary, as (...).

    Its gradient on the policy's logits is policy - reference, so it moves a token the policy is sure of and the
    reference rejects. A penalty on the sampled token's logprob (k3, the policy gradient) cannot: through the
    softmax its gradient is scaled by 1 - p, which vanishes as the policy saturates on that token."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref = torch.log_softmax(ref_logits.float(), dim=-1)
    return torch.nn.functional.kl_div(logp, ref, log_target=True, reduction="none").sum(dim=-1)


def reply_offsets(response_mask: torch.Tensor) -> torch.Tensor:
    """Each response token's index within its reply (a run of response tokens in a row), as (N,) in the order of
    `response_targets`."""
    mask = response_mask > 0
    index = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    starts = mask & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1]
    run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return (index - run_start)[mask]


def banned_sites(targets: torch.Tensor, offsets: torch.Tensor,
                 words: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, tokens) into the (N, V) response logits where the engine could not sample: each bad word's last
    token right after the word's other tokens in the same reply (at every position for a one-token word), as
    vLLM bans them. `targets` and `offsets` are (N,), from `response_targets` and `reply_offsets`.

    A site whose sampled token is the banned one is left out: the ban was not in force when that token was
    sampled (a trajectory recorded under another config), and its logprob must stay finite."""
    positions, tokens = [], []
    for word in words:
        *head, last = word
        hit = (offsets >= len(head)) & (targets != last)
        for back, token in enumerate(reversed(head), start=1):
            # roll wraps around, but the offset test keeps every position whose head lies inside its own reply
            hit &= torch.roll(targets, back) == token
        where = hit.nonzero().squeeze(1)
        positions.append(where)
        tokens.append(torch.full_like(where, last))
    empty = torch.zeros(0, dtype=torch.long, device=targets.device)
    return torch.cat([empty, *positions]), torch.cat([empty, *tokens])


def ban_logits(logits: torch.Tensor, sites: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A float32 copy of logits (N, V) with the banned sites at the lowest float: probability 0, and no NaN where
    an entropy multiplies it by its logprob (as -inf would give)."""
    out = logits.float().clone()
    out[sites] = torch.finfo(out.dtype).min
    return out


def scatter_response(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response-token values (N,) laid out as (B, T - 1), zero elsewhere (differentiable in `values`)."""
    return torch.zeros(response_mask.shape, dtype=values.dtype, device=values.device).masked_scatter(
        response_mask > 0, values)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(values, mask) / mask.sum().clamp(min=1.0)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: exp(d) - d - 1 with d = ref - policy.

    Unbiased, always >= 0, and lower variance than the plain log-ratio.
    """
    d = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor
    """Per-token loss (B, T - 1), not yet masked or reduced."""
    ratio: torch.Tensor
    """pi_theta / pi_old per token."""
    clipped: torch.Tensor
    """1.0 where the PPO clip is active (the gradient of that token is zero)."""
    truncated: torch.Tensor
    """1.0 where the ratio cap bounds the loss of a negative advantage."""


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float,
    ratio_cap: float,
    clip_eps_high: float | None = None,
    weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO's clipped surrogate per token, with the ratio truncated at `ratio_cap` for negative advantages.

    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (`clip_eps_high` None: clip_eps). A wider upper
    bound is DAPO's clip-higher (Yu et al. 2025): a token the policy rarely samples can gain more probability
    from one positive advantage, which DAPO found to keep exploration alive where the symmetric clip let entropy
    collapse. It only matters where the clip is active (`actor/clip_frac`).

    The clip alone bounds the objective only on one side: for A < 0 the pessimistic max picks -A * ratio, which
    grows without bound when the current policy puts far more mass on a token than `old` did. That is exactly
    what happens when `old` is a stale behaviour policy (async generation), so the ratio is truncated at
    `ratio_cap` (dual-clip PPO, Ye et al. 2020): the loss is capped at -A * ratio_cap and the token's gradient
    is zero beyond it. `weights` multiply the per-token loss (e.g. truncated importance weights).
    """
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    cap = -advantages * ratio_cap
    truncate = (advantages < 0) & (loss > cap)
    loss = torch.where(truncate, cap, loss)
    if weights is not None:
        loss = loss * weights
    return PolicyLossOutput(
        loss=loss,
        ratio=ratio.detach(),
        clipped=(clipped > unclipped).float(),
        truncated=truncate.float(),
    )


def truncated_importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """min(pi_old / mu, cap) per token: the off-policy correction when `old` is the trainer's recomputed policy
    and mu the (older) policy that actually sampled the tokens (truncated IS, Ionides 2008; Yao et al. 2025)."""
    log_w = (old_logprobs - behaviour_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_w).clamp(max=cap).detach()


def approx_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(old || current) per token: how far the update moved the policy (a diagnostic)."""
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio) - 1.0 - log_ratio
