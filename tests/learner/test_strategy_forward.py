"""The strategies' shared forward: a right-padded batch runs under the causal mask alone, and every real position's
logits are what the row alone gives."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollstream.consumer.learn.strategy import causal_lm_logits, model_padding_mask


def _padded(rows: list[list[int]], *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, cols], mask[i, cols] = torch.tensor(row), 1
    return ids, mask


def test_only_a_right_padded_batch_drops_its_padding_mask() -> None:
    right = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    assert model_padding_mask(right) is None
    assert model_padding_mask(torch.ones((2, 4), dtype=torch.long)) is None
    left = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert model_padding_mask(left) is left
    holed = torch.tensor([[1, 0, 1]])
    assert model_padding_mask(holed) is holed


def test_padded_rows_get_the_logits_each_row_gets_alone(tiny_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    rows = [[5, 9, 14, 3, 22, 7, 8, 31], [5, 9, 40], [12, 13, 14, 15, 16]]
    head = model.get_output_embeddings()
    with torch.no_grad():
        alone = [causal_lm_logits(model, head, torch.tensor([row]), torch.ones((1, len(row)), dtype=torch.long))[0]
                 for row in rows]
        for left in (False, True):
            ids, mask = _padded(rows, left=left)
            full = causal_lm_logits(model, head, ids, mask)
            picked = causal_lm_logits(model, head, ids, mask, positions=mask.bool())
            for i, row_alone in enumerate(alone):
                torch.testing.assert_close(full[i][mask[i].bool()], row_alone, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(picked, torch.cat(alone), atol=1e-5, rtol=1e-5)
