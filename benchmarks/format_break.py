"""Break a checkpoint's reply format by hand, to test what brings a lost or wobbling format back.

    .venv/bin/python benchmarks/format_break.py CHECKPOINT MODEL_DIR OUT --alpha 0.8 0.9 1.0
    .venv/bin/python benchmarks/format_break.py CHECKPOINT MODEL_DIR OUT --after Down --nats 8 10
    .venv/bin/python benchmarks/format_break.py CHECKPOINT MODEL_DIR OUT --weights RUN/weights/v180

The format losses of the main job came in a burst of large steps that left a token in constant use (`R`, the first
token of `Right`) scored where the closing tag belongs (`<answer>DownR...`). For each alpha this adds alpha x the
`</answer>` row of `lm_head` to the `R` row of the checkpoint's policy and writes the result as
OUT/alpha<alpha>/step_0: a checkpoint a run resumes as its step 0 (`resume_from_checkpoint=OUT/alpha<a>/step_0
pretrain=MODEL_DIR tiny_model.build=false`). A larger alpha breaks more replies. It prints the share of sampled
replies that still parse, before and after, on FrozenLake 4x4 conversations sampled with `<think>` banned as the
main job samples them; the run's own first batches are the measure that counts (they come from its own states).
MODEL_DIR is the run's warm start (`<output_dir>/tiny_model`): its config and tokenizer.

That break leaves the wrong token undecided and heals in two steps; the partial losses that lasted were saturated
in some states only (`<answer>Down<answer>Down...`: the second `<answer>` at p = 0.990 where `Down` was written).
`--after Down --nats N` makes that one: it raises the `<answer>` row of `lm_head` along the mean last hidden state
of the positions where `</answer>` follows `<answer>Down` (in conversations built as in the warm start), so that
its logit there grows by about N; written as OUT/after<action>-nats<N>/step_0.

`--weights RUN/weights/v<n>` breaks nothing: it puts a version the run published (the trainer keeps the last few)
into the checkpoint's optimizer state, as OUT/v<n>/step_0, so a real loss that began after the run's last
checkpoint can be resumed (the optimizer's moments are the checkpoint's, a few steps older than the weights).
"""

from __future__ import annotations

import argparse
import random
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
from rollstream.producer.policy.conversation import ChatTemplateDeltas
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.weights_io import load_safetensors_dir
from rollstream.tiny_model import format_valid_rate, random_valid_conversation

LM_HEAD = "lm_head.weight"


def broken_state(state: dict[str, Any], wrong: int, closing: int, alpha: float) -> dict[str, Any]:
    """The strategy state with `alpha` x the closing tag's `lm_head` row added to the `wrong` token's row."""
    model = dict(state["model"])
    head = model[LM_HEAD].clone()
    head[wrong] += alpha * head[closing]
    model[LM_HEAD] = head
    return {**state, "model": model}


def saturated_break_state(state: dict[str, Any], model_dir: Path, action: str, nats: float,
                          conversations: int = 256) -> dict[str, Any]:
    """The strategy state with `<answer>`'s `lm_head` row raised by about `nats` where `</answer>` follows
    `<answer>` + `action`: along the mean last hidden state of those positions."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state["model"])
    opening, closing = (tokenizer.convert_tokens_to_ids(t) for t in ("<answer>", "</answer>"))
    rng, deltas = random.Random(0), ChatTemplateDeltas(tokenizer)
    envs = [FrozenLakeEnv(size=4, is_slippery=False)]
    wanted = [opening, *tokenizer.encode(action, add_special_tokens=False), closing]
    hidden = []
    with torch.no_grad():
        for _ in range(conversations):
            conv, _ = random_valid_conversation(rng, envs, deltas, max_turns=10, think_prob=0.0)
            ids = conv.input_ids
            ends = [k + len(wanted) - 2 for k in range(len(ids) - len(wanted) + 1) if ids[k:k + len(wanted)] == wanted]
            if ends:
                states = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
                hidden.extend(states[k] for k in ends)
    mean = torch.stack(hidden).mean(dim=0)
    model_state = dict(state["model"])
    head = model_state[LM_HEAD].clone()
    head[opening] += nats * mean / mean.dot(mean)
    model_state[LM_HEAD] = head
    return {**state, "model": model_state}


def write_checkpoint(state: dict[str, Any], checkpoint: Path, target: Path) -> None:
    """`state` as a checkpoint a run resumes as its step 0, with `checkpoint`'s learner state."""
    (target / STRATEGY_DIR).mkdir(parents=True, exist_ok=True)
    save_state(state, target / STRATEGY_DIR / CHECKPOINT_FILE)
    shutil.copy(checkpoint / LEARNER_STATE_FILE, target / LEARNER_STATE_FILE)


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
    parser.add_argument("--alpha", type=float, nargs="+", default=[])
    parser.add_argument("--after", help="the saturated break: `<answer>` written where `</answer>` follows this "
                                        "action")
    parser.add_argument("--nats", type=float, nargs="+", default=[], help="with --after: how far to raise it")
    parser.add_argument("--weights", type=Path, help="a published version to resume instead of the checkpoint's")
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
        write_checkpoint(broken, args.checkpoint, target)
        print(f"alpha {alpha:g}: valid replies {valid_rate(broken, args.model_dir, args.prompts):.3f} -> {target}")
    if args.weights is not None:
        published = {**state, "model": load_safetensors_dir(args.weights)}
        if published["model"].keys() != state["model"].keys():
            raise SystemExit(f"{args.weights} holds other tensors than the checkpoint's model")
        target = args.out / args.weights.name / "step_0"
        write_checkpoint(published, args.checkpoint, target)
        print(f"{args.weights.name}: valid replies {valid_rate(published, args.model_dir, args.prompts):.3f} "
              f"-> {target}")
    for nats in args.nats if args.after else []:
        broken = saturated_break_state(state, args.model_dir, args.after, nats)
        target = args.out / f"after{args.after}-nats{nats:g}" / "step_0"
        write_checkpoint(broken, args.checkpoint, target)
        print(f"after {args.after}, {nats:g} nats: valid replies {valid_rate(broken, args.model_dir, args.prompts):.3f}"
              f" -> {target}")


if __name__ == "__main__":
    main()
