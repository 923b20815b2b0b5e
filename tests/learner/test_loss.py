"""The token-level loss pieces, including the truncated importance ratio."""

from __future__ import annotations

import math

import pytest
import torch

from rollstream.consumer.learn.loss import (
    approx_kl,
    kl_k3,
    ppo_policy_loss,
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
