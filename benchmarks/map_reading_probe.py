"""Can the tiny model read a FrozenLake map through its tokenizer? A supervised probe, tokenizer against tokenizer.

    .venv/bin/python benchmarks/map_reading_probe.py [--seeds 3] [--steps 300]

Diagnostic only: the main job never trains on demonstrations. For each seed and each tokenizer (the byte-level
BPE merged freely, as built before, and cell-wise: one token per grid cell), a fresh random-init tiny model of
the main job's sizes learns by supervised training on one turn's prompt (the player on a random reachable cell
of a random 4x4 map) to name the first move of a shortest path. It prints held-out accuracy on 512 unseen
positions (a move counts when it is one of the shortest-path moves) beside the best map-blind answer (one
fixed move), and writes `benchmarks/results/map_reading_probe.{csv,txt}`. Interleaved: seed by seed, both
tokenizers on the same data.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from rollstream.shared.config import TinyModelConfig
from rollstream.shared.envs.frozen_lake import _MOVES, ACTIONS, FrozenLakeEnv, optimal_actions
from rollstream.shared.envs.text import turn_prompt
from rollstream.tiny_model import corpus_envs, env_texts, tiny_config, train_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
TOKENIZERS = {"merged freely": False, "cell-wise": True}


def shortest_moves(desc: list[str], cell: tuple[int, int]) -> set[str]:
    """The moves from `cell` that start a shortest hole-free path to the goal."""
    best = len(optimal_actions(desc, cell))
    moves = set()
    for action, (dr, dc) in _MOVES.items():
        nxt = (min(max(cell[0] + dr, 0), len(desc) - 1), min(max(cell[1] + dc, 0), len(desc) - 1))
        try:
            if len(optimal_actions(desc, nxt)) == best - 1:
                moves.add(action)
        except ValueError:  # a hole
            pass
    return moves


def positions(n: int, rng: random.Random) -> list[tuple[str, str, set[str]]]:
    """(system prompt, user prompt, shortest moves) for n random (map, reachable cell) pairs."""
    env, out = FrozenLakeEnv(size=4, p=0.8), []
    while len(out) < n:
        env.reset(seed=rng.randrange(2**31))
        cell = (rng.randrange(4), rng.randrange(4))
        if env.desc[cell[0]][cell[1]] in "HG":
            continue
        try:
            moves = shortest_moves(env.desc, cell)
        except ValueError:  # the goal is not reachable from here
            continue
        env._lake.s = cell[0] * 4 + cell[1]  # type: ignore[union-attr]
        out.append((env.system_prompt(), turn_prompt(1, env.render_text(), 10, 48), moves))
    return out


def encode(tokenizer: PreTrainedTokenizerFast, data: list[tuple[str, str, set[str]]]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            + tokenizer.convert_tokens_to_ids(["<answer>"]) for system, user, _ in data]


def last_logits(model: Qwen2ForCausalLM, rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    logits = model(input_ids=ids, attention_mask=mask).logits
    return logits[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])]


def probe(cell_wise: bool, seed: int, steps: int, train: list, held_out: list) -> dict[str, float]:
    tokenizer = train_tokenizer(env_texts(corpus_envs(), 200, seed), 1024, cell_wise=cell_wise)
    sizes = TinyModelConfig()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(tokenizer, tie_word_embeddings=False, hidden_size=sizes.hidden_size,
                                         layers=sizes.layers, intermediate_size=256, max_position_embeddings=4096))
    first = {a: tokenizer.encode(a)[0] for a in ACTIONS}  # the first token of each move names it
    action_ids = torch.tensor([first[a] for a in ACTIONS])
    rows, held_rows = encode(tokenizer, train), encode(tokenizer, held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng, start = random.Random(seed), time.monotonic()
    for _ in range(steps):
        batch = rng.sample(range(len(rows)), 32)
        logits = last_logits(model, [rows[i] for i in batch], tokenizer.pad_token_id)[:, action_ids]
        # Every shortest move is a right answer: maximise their total probability.
        right = torch.tensor([[a in train[i][2] for a in ACTIONS] for i in batch])
        loss = -(torch.logsumexp(logits.masked_fill(~right, -1e9), -1) - torch.logsumexp(logits, -1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        picks = last_logits(model, held_rows, tokenizer.pad_token_id)[:, action_ids].argmax(-1)
    accuracy = statistics.mean(ACTIONS[int(p)] in moves for p, (_, _, moves) in zip(picks, held_out))
    return {"accuracy": accuracy, "seconds": time.monotonic() - start, "prompt_tokens": statistics.mean(map(len, rows))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in TOKENIZERS}
    blind: list[float] = []
    for seed in range(1, args.seeds + 1):
        rng = random.Random(seed)
        train, held_out = positions(4096, rng), positions(512, rng)
        blind.append(max(statistics.mean(a in moves for _, _, moves in held_out) for a in ACTIONS))
        for name, cell_wise in TOKENIZERS.items():
            results[name].append(probe(cell_wise, seed, args.steps, train, held_out))
            print(f"seed {seed}, {name}: {results[name][-1]}", flush=True)

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"

    lines = [f"map-reading probe: {args.seeds} seeds x {args.steps} steps of 32, held-out accuracy min / median / max",
             "| tokenizer | held-out accuracy | prompt tokens | seconds |", "|---|---|---|---|"]
    for name, rs in results.items():
        tokens = statistics.mean(r["prompt_tokens"] for r in rs)
        lines.append(f"| {name} | {spread([r['accuracy'] for r in rs])} | {tokens:.0f} | "
                     f"{spread([r['seconds'] for r in rs])} |")
    lines.append(f"| map-blind (best fixed move) | {spread(blind)} | | |")
    print("\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "map_reading_probe.txt").write_text("\n".join(lines) + "\n")
    with (RESULTS / "map_reading_probe.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["tokenizer", "seed", "accuracy", "seconds", "prompt_tokens"])
        for name, rs in results.items():
            writer.writerows([name, seed, round(r["accuracy"], 4), round(r["seconds"], 1), round(r["prompt_tokens"], 1)]
                             for seed, r in enumerate(rs, 1))


if __name__ == "__main__":
    main()
