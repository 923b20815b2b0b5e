"""Break a checkpoint's reply format by hand, to test what brings a lost or wobbling format back.

    .venv/bin/python benchmarks/format_break.py CHECKPOINT MODEL_DIR OUT --alpha 0.8 0.9 1.0

The format losses of the main job came in a burst of large steps that left a token in constant use (`R`, the first
token of `Right`) scored where the closing tag belongs (`<answer>DownR...`). For each alpha this adds alpha x the
`</answer>` row of `lm_head` to the `R` row of the checkpoint's policy and writes the result as
OUT/alpha<alpha>/step_0: a checkpoint a run resumes as its step 0 (`resume_from_checkpoint=OUT/alpha<a>/step_0
pretrain=MODEL_DIR tiny_model.build=false`). A larger alpha breaks more replies. It prints the share of sampled
replies that still parse, before and after, on FrozenLake 4x4 conversations sampled with `<think>` banned as the
main job samples them; the run's own first batches are the measure that counts (they come from its own states).
MODEL_DIR is the run's warm start (`<output_dir>/tiny_model`): its config and tokenizer.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from rollstream.consumer.learn.checkpoints import LEARNER_STATE_FILE, STRATEGY_DIR
from rollstream.consumer.learn.state_file import load_state, save_state
from rollstream.consumer.learn.strategy.torch_strategy import CHECKPOINT_FILE
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.tiny_model import format_valid_rate

LM_HEAD = "lm_head.weight"


def broken_state(state: dict[str, Any], wrong: int, closing: int, alpha: float) -> dict[str, Any]:
    """The strategy state with `alpha` x the closing tag's `lm_head` row added to the `wrong` token's row."""
    model = dict(state["model"])
    head = model[LM_HEAD].clone()
    head[wrong] += alpha * head[closing]
    model[LM_HEAD] = head
    return {**state, "model": model}


def valid_rate(state: dict[str, Any], model_dir: Path, prompts: int) -> float:
    """`format_valid_rate` of the policy in `state`, on FrozenLake 4x4 with `<think>` banned."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state["model"])
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
        return format_valid_rate(tmp, prompts, envs=[FrozenLakeEnv(size=4, is_slippery=False)], think_prob=0.0,
                                 bad_words=["<think>"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a torch_train checkpoint dir (.../checkpoints/step_<n>)")
    parser.add_argument("model_dir", type=Path, help="the run's warm start: config and tokenizer")
    parser.add_argument("out", type=Path)
    parser.add_argument("--alpha", type=float, nargs="+", required=True)
    parser.add_argument("--prompts", type=int, default=512, help="sampled replies per measurement")
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()

    state = load_state(args.checkpoint / STRATEGY_DIR / CHECKPOINT_FILE)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    wrong = tokenizer.encode("Right", add_special_tokens=False)[0]
    closing = tokenizer.convert_tokens_to_ids("</answer>")
    print(f"R = token {wrong} ({tokenizer.convert_ids_to_tokens(wrong)!r}), </answer> = token {closing}")
    print(f"alpha 0: valid replies {valid_rate(state, args.model_dir, args.prompts):.3f}")
    for alpha in args.alpha:
        broken = broken_state(state, wrong, closing, alpha)
        target = args.out / f"alpha{alpha:g}" / "step_0"
        (target / STRATEGY_DIR).mkdir(parents=True, exist_ok=True)
        save_state(broken, target / STRATEGY_DIR / CHECKPOINT_FILE)
        shutil.copy(args.checkpoint / LEARNER_STATE_FILE, target / LEARNER_STATE_FILE)
        print(f"alpha {alpha:g}: valid replies {valid_rate(broken, args.model_dir, args.prompts):.3f} -> {target}")


if __name__ == "__main__":
    main()
