"""The token-level loss pieces, including the truncated importance ratio."""

from __future__ import annotations

import math

import pytest
import torch

from rollstream.consumer.learn.loss import (
    approx_kl,
    ban_logits,
    banned_sites,
    forward_kl,
    kl_k3,
    ppo_policy_loss,
    reply_offsets,
    response_positions,
    response_targets,
    scatter_response,
    token_entropy,
    token_logprobs,
    truncated_importance_weights,
)


def loss_and_grad(ratio: float, advantage: float, *, clip_eps: float = 0.2, ratio_cap: float = 3.0,
                  clip_eps_high: float | None = None):
    """Per-token loss and its gradient with respect to the current logprob, for one token."""
    logprob = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = ppo_policy_loss(logprob, torch.zeros(1, 1), torch.tensor([[advantage]]), clip_eps=clip_eps,
                          ratio_cap=ratio_cap, clip_eps_high=clip_eps_high)
    out.loss.sum().backward()
    assert logprob.grad is not None
    return float(out.loss.detach()), float(logprob.grad), out


def test_on_policy_ratio_is_one_and_the_gradient_is_minus_the_advantage() -> None:
    loss, grad, out = loss_and_grad(1.0, 2.0)
    assert loss == pytest.approx(-2.0) and grad == pytest.approx(-2.0)
    assert float(out.clipped) == 0.0 and float(out.truncated) == 0.0


@pytest.mark.parametrize(("ratio", "advantage", "expected_loss", "has_grad"), [
    (1.5, 1.0, -1.2, False),   # positive advantage, ratio above 1 + eps: clipped
    (0.9, 1.0, -0.9, True),    # inside the clip range
    (0.5, -1.0, 0.8, False),   # negative advantage, ratio below 1 - eps: clipped
    (2.0, -1.0, 2.0, True),    # negative advantage, ratio above 1 + eps: the clip does not bound it...
    (5.0, -1.0, 3.0, False),   # ...the ratio cap does: truncated at 3
    (5.0, 1.0, -1.2, False),   # the cap never touches positive advantages
])
def test_clip_and_truncation(ratio: float, advantage: float, expected_loss: float, has_grad: bool) -> None:
    loss, grad, _ = loss_and_grad(ratio, advantage)
    assert loss == pytest.approx(expected_loss)
    assert (abs(grad) > 0) == has_grad


@pytest.mark.parametrize(("ratio", "advantage", "expected_loss", "has_grad"), [
    (1.25, 1.0, -1.25, True),  # above 1 + low, below 1 + high: still learning
    (1.5, 1.0, -1.28, False),  # above 1 + high: clipped there
    (0.5, -1.0, 0.8, False),   # the lower bound is unchanged
])
def test_clip_higher(ratio: float, advantage: float, expected_loss: float, has_grad: bool) -> None:
    loss, grad, _ = loss_and_grad(ratio, advantage, clip_eps=0.2, clip_eps_high=0.28)
    assert loss == pytest.approx(expected_loss)
    assert (abs(grad) > 0) == has_grad


def test_truncation_is_reported() -> None:
    _, _, out = loss_and_grad(5.0, -1.0)
    assert float(out.truncated) == 1.0


def test_a_huge_log_ratio_with_zero_advantage_is_not_nan() -> None:
    out = ppo_policy_loss(torch.tensor([[500.0]]), torch.tensor([[0.0]]), torch.tensor([[0.0]]), clip_eps=0.2,
                          ratio_cap=3.0)
    assert float(out.loss) == 0.0


def test_truncated_importance_weights() -> None:
    old = torch.tensor([[math.log(0.5), 0.0, math.log(8.0)]])
    w = truncated_importance_weights(old, torch.zeros(1, 3), cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 3.0]]))


def test_weights_scale_the_token_loss() -> None:
    out = ppo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), clip_eps=0.2, ratio_cap=3.0,
                          weights=torch.tensor([[0.5, 2.0]]))
    torch.testing.assert_close(out.loss, torch.tensor([[-0.5, -2.0]]))


def test_k3_kl() -> None:
    same = torch.tensor([[-1.0, -2.0]])
    assert float(kl_k3(same, same).abs().sum()) == 0.0
    d = math.log(2.0)  # ref - policy
    value = kl_k3(torch.tensor([[0.0]]), torch.tensor([[d]]))
    assert float(value) == pytest.approx(2.0 - d - 1.0)
    assert float(approx_kl(torch.tensor([[d]]), torch.tensor([[0.0]]))) == pytest.approx(2.0 - d - 1.0)


def test_forward_kl_moves_a_token_the_policy_is_sure_of_where_k3_cannot() -> None:
    """A policy saturated on a token the reference rejects (an empty answer's closing tag where an action belongs):
    k3 on the sampled token barely moves the logits (its gradient is scaled by 1 - p), KL(reference || policy) moves
    them by policy - reference."""
    ref_logits = torch.tensor([0.0, 0.0, 0.0, -10.0])  # three actions; the closing tag unlikely

    def logits() -> torch.Tensor:
        return torch.tensor([0.0, 0.0, 0.0, 12.0], requires_grad=True)  # the closing tag at p = 0.99998

    same = torch.log_softmax(ref_logits, -1)
    assert float(forward_kl(same, same)) == pytest.approx(0.0, abs=1e-6)
    saturated = logits()
    kl_k3(torch.log_softmax(saturated, -1)[3], torch.log_softmax(ref_logits, -1)[3]).backward()
    pulled = logits()
    value = forward_kl(pulled, ref_logits)
    value.backward()
    policy, reference = torch.softmax(pulled.detach(), -1), torch.softmax(ref_logits, -1)
    assert float(value.detach()) == pytest.approx(float((reference * (reference.log() - policy.log())).sum()), rel=1e-5)
    torch.testing.assert_close(pulled.grad, policy - reference)
    assert float(pulled.grad[3]) > 0.99 and float(saturated.grad.abs().max()) < 1e-3


def test_token_logprobs_and_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, targets), expected)
    torch.testing.assert_close(token_entropy(torch.zeros(3, 7)), torch.full((3,), math.log(7)))


def test_response_positions_pick_the_logits_that_predict_response_tokens() -> None:
    """Logits taken only at `response_positions` give, scattered back, exactly the full batch's target logprobs
    on the response tokens (column j of the mask is about token j + 1, predicted at position j)."""
    torch.manual_seed(0)
    full_logits = torch.randn(2, 6, 7, requires_grad=True)
    ids = torch.randint(0, 7, (2, 6))
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 1, 1]], dtype=torch.float32)
    positions = response_positions(mask)
    assert positions.tolist() == [[False, True, True, False, True, False], [False, False, False, True, True, False]]
    picked = scatter_response(token_logprobs(full_logits[positions], response_targets(ids, mask)), mask)
    everywhere = token_logprobs(full_logits[:, :-1], ids[:, 1:]) * mask
    torch.testing.assert_close(picked, everywhere)
    picked.sum().backward()  # the scatter keeps the graph
    assert full_logits.grad is not None and float(full_logits.grad[0, 0].abs().sum()) == 0.0


def test_reply_offsets_restart_at_each_reply() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 1]])
    assert reply_offsets(mask).tolist() == [0, 1, 0, 1, 2, 0, 1, 0]


def test_banned_sites_as_vllm_bans_them() -> None:
    """A one-token word is banned everywhere but where it was sampled; a two-token word's last token right after
    its first one in the same reply, and not at the start of the next reply after a reply that ended on it."""
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]])
    targets = torch.tensor([5, 7, 5, 5, 9])  # replies [5, 7, 5] and [5, 9]
    offsets = reply_offsets(mask)
    positions, tokens = banned_sites(targets, offsets, [[7]])
    assert list(zip(positions.tolist(), tokens.tolist())) == [(0, 7), (2, 7), (3, 7), (4, 7)]
    positions, tokens = banned_sites(targets, offsets, [[5, 8], [5, 9]])
    # [5, 8]: after each 5 within its reply (positions 1 and 4); the 5 ending reply one bans nothing in reply two.
    # [5, 9]: after the 5 at position 0 (position 1); position 4 sampled the 9 and is left out.
    assert sorted(zip(positions.tolist(), tokens.tolist())) == [(1, 8), (1, 9), (4, 8)]
    assert banned_sites(targets, offsets, [])[0].numel() == 0


def test_banned_logits_give_the_sampled_distribution_without_nan() -> None:
    logits = torch.randn(3, 6, requires_grad=True)
    targets = torch.tensor([0, 1, 2])
    banned = ban_logits(logits, (torch.tensor([0, 1, 2]), torch.tensor([5, 5, 5])))
    logprobs = token_logprobs(banned, targets)
    allowed = torch.log_softmax(logits[:, :5].detach(), -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(logprobs.detach(), allowed)
    entropy = token_entropy(banned)
    torch.testing.assert_close(entropy.detach(), token_entropy(logits[:, :5].detach()))
    (logprobs.sum() + entropy.sum()).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad[:, 5].abs().sum() == 0  # the banned token is outside the policy
