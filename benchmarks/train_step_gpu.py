"""The GPU config's trainer step on one GPU: time, tokens/s and peak memory of one PPO update on a batch shaped like
`configs/qwen2.5-0.5B_frozen_lake_gpu.yaml`'s, with that config's update settings, under both training strategies.

    PYTHONPATH=$PWD python benchmarks/train_step_gpu.py [--trajectories 1024] [--repeats 3] [--shape 0.5b]

What runs: the config is loaded as written, except `pretrain`, which points at a random model of Qwen2.5-0.5B's
shape (494M parameters, its 151,936-token vocabulary; no checkpoint can be downloaded here) saved beside the
tiny model's tokenizer (its learning rate, 1e-6, leaves the weights nearly the same from update to update). The batch is
`--trajectories` FrozenLake conversations built with the chat template as the env loop builds them (random valid
replies, half with a short think), as `train_step_throughput.py` builds them. For `torch_train` and
`deepspeed_train` (ZeRO stage from the config; one rank), each path:
- `response logits`: what the trainer does: the model computes no logits, its lm_head runs on the last hidden
  states of the positions that predict a response token only;
- `response logits, padding mask`: as the first, the model also given the batch's padding mask (the trainer
  before 2026-12-04; a right-padded batch needs only the causal mask);
- `full logits` (the baseline): logits at every position (151,936 per token), then the loss picks the same ones.
The phases alternate, `--repeats` times each; the table gives the median. Then `publish`: one weights version
written as the trainer writes it (`publish_weights`: safetensors, tokenizer, digest, rename), median of 3.
What it leaves out: generation (vLLM, which is not on the GPU machines lent here) and Redis. `--shape tiny` runs
the same on the main job's tiny model, to check the script on a CPU. Writes `benchmarks/results/train_step_gpu.csv`
(`--results` elsewhere).
"""

from __future__ import annotations

import argparse
import csv
import gc
import itertools
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml
from train_step_throughput import FullLogits, PaddingMask, frozen_lake_batch, timed_update
from transformers import AutoTokenizer
from weights_publication import qwen_05b_model

from rollstream.consumer.learn.policy_learner import UpdateSettings
from rollstream.consumer.learn.strategy import make_strategy
from rollstream.consumer.learn.tensors import TokenBatch
from rollstream.shared.config import load_config
from rollstream.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "qwen2.5-0.5B_frozen_lake_gpu.yaml"
RESULTS = REPO / "benchmarks" / "results" / "train_step_gpu.csv"
STRATEGIES = ("torch_train", "deepspeed_train")
PATHS = ("response logits", "response logits, padding mask", "full logits")


def build_model(work: Path, shape: str) -> Path:
    """The tiny model's tokenizer beside a model of `shape`; returns the directory."""
    tiny = build_tiny_model(work / "tiny", tie_word_embeddings=False)
    if shape == "tiny":
        return tiny
    out = work / "qwen2.5-0.5b-shaped"
    qwen_05b_model().save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def measure(strategy_name: str, model_dir: Path, config: Path, tokens: TokenBatch, repeats: int,
            work: Path) -> list[dict[str, object]]:
    """One row per path (median update seconds, tokens/s, peak GiB, loss) and one for `publish`."""
    raw = yaml.safe_load(config.read_text())
    if raw["actor_train"]["strategy_args"]["strategy_name"] != strategy_name:  # its strategy_config is the other's
        raw["actor_train"]["strategy_args"] = {"strategy_name": strategy_name}
    derived = work / f"{strategy_name}.yaml"
    derived.write_text(yaml.safe_dump(raw))
    cfg = load_config(derived, [f"pretrain={model_dir}", f"output_dir={work / 'out'}"])
    strategy = make_strategy(cfg)
    settings = UpdateSettings.from_config(cfg)
    total_tokens = int(tokens.attention_mask.sum())
    paths = {"response logits": strategy, "response logits, padding mask": PaddingMask(strategy),
             "full logits": FullLogits(strategy)}
    timed_update(strategy, tokens, settings)  # warm-up: allocator, kernels, the optimizer's state
    seconds: dict[str, list[float]] = {p: [] for p in PATHS}
    peaks: dict[str, list[float]] = {p: [] for p in PATHS}
    losses: dict[str, float] = {}
    for _, path in itertools.product(range(repeats), PATHS):
        if strategy.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(strategy.device)
        try:
            took, losses[path] = timed_update(paths[path], tokens, settings)
        except torch.cuda.OutOfMemoryError:
            took, losses[path] = float("inf"), float("nan")
            gc.collect()
            torch.cuda.empty_cache()
        seconds[path].append(took)
        peaks[path].append(peak_gib(strategy.device))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    publish = []
    for version in range(3):
        start = time.perf_counter()
        strategy.publish_weights(work / "weights" / f"{strategy_name}-v{version}", tokenizer)
        publish.append(time.perf_counter() - start)
    rows: list[dict[str, object]] = []
    for path in PATHS:
        median = statistics.median(seconds[path])
        rows.append({"strategy": strategy_name, "path": path, "seconds": median,
                     "tokens_per_s": total_tokens / median, "peak_gib": max(peaks[path]), "loss_pg": losses[path]})
    rows.append({"strategy": strategy_name, "path": "publish", "seconds": statistics.median(publish),
                 "tokens_per_s": float("nan"), "peak_gib": float("nan"), "loss_pg": float("nan")})
    strategy.close()
    del strategy, paths
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict[str, object]]) -> None:
    baseline = next(r["seconds"] for r in rows if r["path"] == "full logits")
    for r in rows:
        ratio = f"{baseline / r['seconds']:.2f}x" if r["path"] != "publish" else ""  # type: ignore[operator]
        print(f"| {r['strategy']:<15} | {r['path']:<30} | {r['seconds']:>8.2f} | {r['tokens_per_s']:>9,.0f} "
              f"| {ratio:>7} | {r['peak_gib']:>8.1f} | {r['loss_pg']:>8.3g} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=("0.5b", "tiny"), default="0.5b")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the CSV to write")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU)"
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, args.results.open("w", newline="") as f:
        work = Path(tmp)
        model_dir = build_model(work, args.shape)
        tokens = frozen_lake_batch(model_dir, args.trajectories)
        total = int(tokens.attention_mask.sum())
        print(f"{device}, torch {torch.__version__}; model: {args.shape}-shaped, random weights; "
              f"{args.trajectories} trajectories, {total:,} tokens, {tokens.num_response_tokens:,} of them generated; "
              f"config {args.config.name}; medians of {args.repeats}")
        print(f"| {'strategy':<15} | {'path':<30} | {'seconds':>8} | {'tokens/s':>9} | {'vs full':>7} "
              f"| {'peak GiB':>8} | {'loss/pg':>8} |")
        print(f"|{'-' * 17}|{'-' * 32}|{'-' * 10}|{'-' * 11}|{'-' * 9}|{'-' * 10}|{'-' * 10}|", flush=True)
        writer = csv.DictWriter(f, fieldnames=["device", "shape", "trajectories", "tokens", "strategy", "path",
                                               "seconds", "tokens_per_s", "peak_gib", "loss_pg"])
        writer.writeheader()
        for name in args.strategies.split(","):
            try:
                rows = measure(name, model_dir, args.config, tokens, args.repeats, work)
            except Exception:  # one strategy failing on a machine still reports the other
                traceback.print_exc()
                continue
            print_rows(rows)
            for r in rows:
                writer.writerow({"device": device, "shape": args.shape, "trajectories": args.trajectories,
                                 "tokens": total, **r})
            f.flush()
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
