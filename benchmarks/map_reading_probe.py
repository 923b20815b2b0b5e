"""Can the tiny model read the board through its tokenizer? A supervised probe, variant against variant.

    .venv/bin/python benchmarks/map_reading_probe.py [--env frozen_lake|sokoban] [--seeds 3] [--steps 300]

Diagnostic only: the main job never trains on demonstrations. For each seed and each variant, a fresh random-init
model learns by supervised training on one turn's prompt to name the first move of a shortest solution:
- frozen_lake: the player on a random reachable cell of a random 4x4 map; the variants are the tokenizer (the
  byte-level BPE merged freely, as built, and cell-wise: one token per grid cell) at the main job's model sizes.
- sokoban: a SimpleSokoban room (6x6, one box) as generated, or a few moves along a shortest solution; the
  variants are the model's size (the main job's, and one twice as wide and deep) with the tokenizer as built.
It prints held-out accuracy on 512 unseen positions (a move counts when it starts a shortest solution) beside
the best board-blind answer (one fixed move), and writes `benchmarks/results/<probe>.{csv,txt}`. Interleaved:
seed by seed, every variant on the same data.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from rollstream.shared.config import TinyModelConfig
from rollstream.shared.envs import sokoban
from rollstream.shared.envs.frozen_lake import ACTIONS as LAKE_ACTIONS
from rollstream.shared.envs.frozen_lake import MOVES, FrozenLakeEnv, moved, optimal_actions
from rollstream.shared.envs.text import turn_prompt
from rollstream.tiny_model import corpus_envs, env_texts, tiny_config, train_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
Position = tuple[str, str, set[str]]
"""(system prompt, user prompt, the moves that start a shortest solution)."""


@dataclass(frozen=True)
class Variant:
    cell_wise: bool
    hidden_size: int
    layers: int


_TINY = TinyModelConfig()
VARIANTS = {
    "frozen_lake": {"merged freely": Variant(False, _TINY.hidden_size, _TINY.layers),
                    "cell-wise": Variant(True, _TINY.hidden_size, _TINY.layers)},
    "sokoban": {f"main job's model ({_TINY.hidden_size} wide, {_TINY.layers} layers)":
                Variant(False, _TINY.hidden_size, _TINY.layers),
                f"{2 * _TINY.hidden_size} wide, {2 * _TINY.layers} layers":
                Variant(False, 2 * _TINY.hidden_size, 2 * _TINY.layers)},
}


def shortest_moves(desc: list[str], cell: tuple[int, int]) -> set[str]:
    """The moves from `cell` that start a shortest hole-free path to the goal."""
    best = len(optimal_actions(desc, cell))
    moves = set()
    for action in MOVES:
        nxt = moved(desc, cell, action)
        try:
            if len(optimal_actions(desc, nxt)) == best - 1:
                moves.add(action)
        except ValueError:  # a hole
            pass
    return moves


def lake_positions(n: int, rng: random.Random) -> list[Position]:
    """n random (map, reachable cell) pairs."""
    env, out = FrozenLakeEnv(size=4, p=0.8), list[Position]()
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


def sokoban_moves(room: sokoban.Room) -> tuple[set[str], int]:
    """The moves that start a shortest solution of `room`, and its length."""
    best = sokoban.solve(room)
    if best is None:
        raise ValueError("unsolvable room")
    moves = set()
    for action in sokoban.ACTIONS:
        after = sokoban.move(room, action)
        rest = sokoban.solve(after) if after != room else None
        if rest is not None and len(rest) == len(best) - 1:
            moves.add(action)
    return moves, len(best)


def sokoban_positions(n: int, rng: random.Random) -> list[Position]:
    """n SimpleSokoban rooms as generated, or 1-3 moves along a shortest solution (as an episode's later turns),
    keeping those still solvable within the episode's 10 moves."""
    env, out = sokoban.SokobanEnv(dim_room=(6, 6), num_boxes=1, search_depth=30), list[Position]()
    while len(out) < n:
        env.reset(seed=rng.randrange(2**31))
        room, turn = env.room, 1
        for _ in range(rng.choice((0, 0, 1, 2, 3))):
            plan = sokoban.solve(room)
            if not plan or len(plan) < 2:
                break
            room, turn = sokoban.move(room, plan[0]), turn + 1
        moves, length = sokoban_moves(room)
        if length > 11 - turn:
            continue
        env._room = room
        out.append((env.system_prompt(), turn_prompt(turn, env.render_text(), 11 - turn, 48), moves))
    return out


POSITIONS = {"frozen_lake": (lake_positions, LAKE_ACTIONS), "sokoban": (sokoban_positions, sokoban.ACTIONS)}


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


def shortest_move_loss(logits: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Every shortest move is a right answer: maximise their total probability."""
    return -(torch.logsumexp(logits.masked_fill(~right, -1e9), -1) - torch.logsumexp(logits, -1)).mean()


def probe(variant: Variant, actions: tuple[str, ...], seed: int, steps: int, train: list[Position],
          held_out: list[Position]) -> dict[str, float]:
    tokenizer = train_tokenizer(env_texts(corpus_envs(), 200, seed), 1024, cell_wise=variant.cell_wise)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(tokenizer, tie_word_embeddings=False, hidden_size=variant.hidden_size,
                                         layers=variant.layers, intermediate_size=2 * variant.hidden_size,
                                         max_position_embeddings=4096))
    first = {a: tokenizer.encode(a)[0] for a in actions}  # the first token of each move names it
    action_ids = torch.tensor([first[a] for a in actions])
    rows, held_rows = encode(tokenizer, train), encode(tokenizer, held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng, start = random.Random(seed), time.monotonic()
    for _ in range(steps):
        batch = rng.sample(range(len(rows)), 32)
        logits = last_logits(model, [rows[i] for i in batch], tokenizer.pad_token_id)[:, action_ids]
        right = torch.tensor([[a in train[i][2] for a in actions] for i in batch])
        loss = shortest_move_loss(logits, right)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        picks = last_logits(model, held_rows, tokenizer.pad_token_id)[:, action_ids].argmax(-1)
    accuracy = statistics.mean(actions[int(p)] in moves for p, (_, _, moves) in zip(picks, held_out))
    return {"accuracy": accuracy, "seconds": time.monotonic() - start, "prompt_tokens": statistics.mean(map(len, rows))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=sorted(VARIANTS), default="frozen_lake")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants, (positions, actions) = VARIANTS[args.env], POSITIONS[args.env]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    blind: list[float] = []
    for seed in range(1, args.seeds + 1):
        rng = random.Random(seed)
        train, held_out = positions(4096, rng), positions(512, rng)
        blind.append(max(statistics.mean(a in moves for _, _, moves in held_out) for a in actions))
        for name, variant in variants.items():
            results[name].append(probe(variant, actions, seed, args.steps, train, held_out))
            print(f"seed {seed}, {name}: {results[name][-1]}", flush=True)

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"

    lines = [f"{args.env} reading probe: {args.seeds} seeds x {args.steps} steps of 32, held-out accuracy "
             "min / median / max", "| variant | held-out accuracy | prompt tokens | seconds |", "|---|---|---|---|"]
    for name, rs in results.items():
        tokens = statistics.mean(r["prompt_tokens"] for r in rs)
        lines.append(f"| {name} | {spread([r['accuracy'] for r in rs])} | {tokens:.0f} | "
                     f"{spread([r['seconds'] for r in rs])} |")
    lines.append(f"| board-blind (best fixed move) | {spread(blind)} | | |")
    print("\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "map_reading_probe" if args.env == "frozen_lake" else f"{args.env}_reading_probe"
    (RESULTS / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    with (RESULTS / f"{stem}.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["variant", "seed", "accuracy", "seconds", "prompt_tokens"])
        for name, rs in results.items():
            writer.writerows([name, seed, round(r["accuracy"], 4), round(r["seconds"], 1), round(r["prompt_tokens"], 1)]
                             for seed, r in enumerate(rs, 1))


if __name__ == "__main__":
    main()
