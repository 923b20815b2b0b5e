"""How ready is a built tiny model to read the map? Three probes of warm-started builds, build against build.

    .venv/bin/python benchmarks/build_readiness.py MODEL_DIR [MODEL_DIR ...] [--steps 25 50 100 200] [--name NAME]

Diagnostic (issue 16): every run of one seed's build stays map-blind for most of 15 minutes while other builds
leave that phase within 5-10, whatever the RL draw. RL can only reinforce the map-dependence a policy already
shows, so each build (the tokenizer, the initial weights and the format warm start, as `make run` makes them) is
probed on the same FrozenLake positions (`map_reading_probe`'s: 4096 to train on, 512 held out, the prompt of a
first turn ending in `<answer>`):
- **map dependence** of the build's own move distribution (renormalised over the four moves): the mutual
  information between the map and the move in nats (the mean KL from each position's distribution to their
  average), the share of positions whose likeliest move is the build's commonest one (1.0: one fixed move), that
  average distribution (`p_<move>`) and the held-out accuracy of the likeliest move (`as_built`); and the
  probability that the reply opens with a `<think>` (`p_think`, the warm start taught 0.5);
- **linear probe**: a logistic regression on the frozen last hidden state at the answer, trained to name a move
  that starts a shortest safe path; held-out accuracy says what the build's features already hold;
- **fine-tuning**: the whole build trained on the same target at the main job's learning rate (3e-4, AdamW,
  32 positions a step); held-out accuracy after each of `--steps` says how fast gradient descent finds map reading
  from this build.
The best board-blind answer (one fixed move) is printed beside them. Writes `benchmarks/results/<name>.{csv,txt}`.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
from pathlib import Path

import torch
from map_reading_probe import Position, encode, lake_positions, last_logits, shortest_move_loss
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from rollstream.shared.envs.frozen_lake import ACTIONS

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 32
LEARNING_RATE = 3e-4  # the shipped config's actor_train learning rate


def answer_states(model: torch.nn.Module, rows: list[list[int]], pad: int, action_ids: torch.Tensor,
                  think_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The move logits and the last hidden state at each row's final position (after `<answer>`), and the
    probability of opening the reply with `think_id` at the position before it, in batches."""
    logits, hidden, thinks = [], [], []
    for i in range(0, len(rows), 128):
        chunk = rows[i:i + 128]
        width = max(map(len, chunk))
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in chunk])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        row, last = torch.arange(len(chunk)), torch.tensor([len(r) - 1 for r in chunk])
        logits.append(out.logits[row, last][:, action_ids])
        hidden.append(out.hidden_states[-1][row, last])
        thinks.append(out.logits[row, last - 1].softmax(-1)[:, think_id])
    return torch.cat(logits), torch.cat(hidden), torch.cat(thinks)


def right_moves(positions: list[Position]) -> torch.Tensor:
    return torch.tensor([[a in moves for a in ACTIONS] for _, _, moves in positions])


def accuracy(logits: torch.Tensor, right: torch.Tensor) -> float:
    return right[torch.arange(len(right)), logits.argmax(-1)].float().mean().item()


def map_dependence(logits: torch.Tensor) -> dict[str, float]:
    logp = logits.log_softmax(-1)
    mean_p = logp.exp().mean(0)
    mutual_information = (logp.exp() * (logp - mean_p.log())).sum(-1).mean().item()
    picks = logits.argmax(-1)
    fixed_share = picks.bincount(minlength=len(ACTIONS)).max().item() / len(picks)
    return {"mutual_information": mutual_information, "fixed_move_share": fixed_share,
            **{f"p_{a}": p.item() for a, p in zip(ACTIONS, mean_p)}}


def linear_probe(train_x: torch.Tensor, train_right: torch.Tensor, held_x: torch.Tensor, held_right: torch.Tensor
                 ) -> float:
    """Held-out accuracy of a logistic regression on standardised frozen features."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, held_x = (train_x - mean) / std, (held_x - mean) / std
    torch.manual_seed(0)
    head = torch.nn.Linear(train_x.shape[1], len(ACTIONS))
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = shortest_move_loss(head(train_x), train_right) + 1e-3 * head.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return accuracy(head(held_x), held_right)


def probe_build(model_dir: str, train: list[Position], held_out: list[Position], steps: list[int]
                ) -> dict[str, float]:
    tokenizer: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    action_ids = torch.tensor([tokenizer.encode(a)[0] for a in ACTIONS])  # the first token of each move names it
    rows, held_rows = encode(tokenizer, train), encode(tokenizer, held_out)
    right, held_right = right_moves(train), right_moves(held_out)
    pad = tokenizer.pad_token_id
    model.eval()
    think_id = tokenizer.convert_tokens_to_ids("<think>")
    with torch.no_grad():
        _, train_x, _ = answer_states(model, rows, pad, action_ids, think_id)
        held_logits, held_x, thinks = answer_states(model, held_rows, pad, action_ids, think_id)
    result = {"p_think": thinks.mean().item(), **map_dependence(held_logits),
              "as_built": accuracy(held_logits, held_right),
              "linear_probe": linear_probe(train_x, right, held_x, held_right)}
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    rng = random.Random(0)  # every build sees the same batches
    for step in range(1, max(steps) + 1):
        batch = rng.sample(range(len(rows)), BATCH)
        loss = shortest_move_loss(last_logits(model, [rows[i] for i in batch], pad)[:, action_ids], right[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in steps:
            with torch.no_grad():
                result[f"finetuned_{step}"] = accuracy(last_logits(model, held_rows, pad)[:, action_ids], held_right)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="built model dirs (e.g. output/learning_runs/<exp>/seed7/tiny_model)")
    parser.add_argument("--steps", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="build_readiness", help="results file stem under benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(1)
    train, held_out = lake_positions(4096, rng), lake_positions(512, rng)
    blind = max(statistics.mean(a in moves for _, _, moves in held_out) for a in ACTIONS)
    results = {}
    for model_dir in args.models:
        results[model_dir] = probe_build(model_dir, train, held_out, sorted(args.steps))
        print(f"{model_dir}: " + ", ".join(f"{k} {v:.3g}" for k, v in results[model_dir].items()), flush=True)

    columns = list(next(iter(results.values())))
    lines = [f"build readiness on {len(held_out)} held-out FrozenLake positions (board-blind best: {blind:.3f})",
             "| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {d} | " + " | ".join(f"{r[c]:.3g}" for c in columns) + " |" for d, r in results.items()]
    print("\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.txt").write_text("\n".join(lines) + "\n")
    with (RESULTS / f"{args.name}.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", *columns])
        writer.writerows([d, *(f"{r[c]:.4g}" for c in columns)] for d, r in results.items())


if __name__ == "__main__":
    main()
