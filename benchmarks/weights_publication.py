"""Weight publication and reload latency per version, through both transports, against the bytes' own I/O cost.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/weights_publication.py [--versions 3] [--models tiny,0.5b]

What one version costs between the trainer's step and an env-worker serving it, phase by phase, with the real
code of each side:
- `publish`: the trainer's `save_pretrained_atomically` (safetensors + tokenizer into a staged directory, the
  digest over every file, the rename);
- `share` / `fetch` (`weights_transport: redis` only): the trainer copies the directory into Redis chunks, a
  producer downloads them into its cache (`shared/weights_transport.py`), on an embedded Redis with the main
  job's settings (AOF, `appendfsync always`);
- `load`: a transformers engine's `load_weights` (the digest checked again on the reader's side, the tensors
  read, names and shapes checked, copied into the live model).
Baseline in the same round: the same tensors written with safetensors' `save_file` and read back with
`load_file` (no digest, no tokenizer, no rename): what the bytes alone cost on this disk right now. Versions are
interleaved across transports; each cell is the median (min-max) over `--versions` versions.
Models: the main job's tiny model (fp32) and a random model of Qwen2.5-0.5B's shape (494M parameters, bf16, tied
embeddings, as the GPU config publishes). vLLM's in-process reload is not timed here (its engine takes two minutes
to start on this machine); tests/policy measure it for correctness.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redis.asyncio
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as transformers_logging

from rollstream.producer.policy.hf import HFPolicy
from rollstream.shared.config import RollstreamConfig
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import Keys
from rollstream.shared.messages import WeightsAnnouncement
from rollstream.shared.weights_io import save_pretrained_atomically
from rollstream.shared.weights_transport import fetch_weights, share_weights
from rollstream.tiny_model import build_tiny_model

RESULTS = Path(__file__).parent / "results"


@dataclass
class Case:
    model: str
    transport: str
    phases: dict[str, list[float]] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.phases.setdefault(phase, []).append(seconds)

    def total(self) -> list[float]:
        return [sum(p[i] for name, p in self.phases.items() if name != "raw bytes")
                for i in range(len(self.phases["publish"]))]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def qwen_05b_model() -> PreTrainedModel:
    """A random model of Qwen2.5-0.5B's shape: the bytes and tensor count of the real one, no download."""
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def raw_bytes(model: PreTrainedModel, work: Path) -> float:
    """safetensors' own write and read of the same tensors: the floor any publication pays."""
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = work / "raw.safetensors"
    start = time.perf_counter()
    save_file(state, str(path))
    load_file(str(path))
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


async def one_version(case: Case, version: int, model: PreTrainedModel, tokenizer: object, engine: HFPolicy,
                      work: Path, client: redis.Redis, aclient: redis.asyncio.Redis, keys: Keys,
                      chunk_bytes: int) -> None:
    final = work / case.model / f"v{version}-{case.transport}"
    seconds, digest = timed(lambda: save_pretrained_atomically(model, final, tokenizer=tokenizer))  # type: ignore[arg-type]
    case.add("publish", seconds)
    announcement = WeightsAnnouncement(version, final.resolve().as_uri(), str(digest))
    if case.transport == "redis":
        seconds, shared = timed(lambda: share_weights(client, keys, announcement, chunk_bytes))
        case.add("share", seconds)
        start = time.perf_counter()
        uri = await fetch_weights(aclient, keys, shared.uri, work / "cache")
        case.add("fetch", time.perf_counter() - start)
    else:
        uri = announcement.uri
    start = time.perf_counter()
    await engine.load_weights(version, uri, str(digest))
    case.add("load", time.perf_counter() - start)
    assert engine.version == version
    shutil.rmtree(final)  # what pruning does once no producer holds the version
    shutil.rmtree(work / "cache", ignore_errors=True)
    client.delete(keys.weights_blob(final.name))


async def run_model(name: str, model_dir: Path, model: PreTrainedModel, args: argparse.Namespace, work: Path,
                    client: redis.Redis, aclient: redis.asyncio.Redis) -> list[Case]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = HFPolicy(model_dir, dtype=next(model.parameters()).dtype)
    keys = Keys(f"bench-{name}")
    cases = [Case(name, "filesystem"), Case(name, "redis")]
    for version in range(1, args.versions + 1):
        for case in cases:  # interleaved: a slow moment of the machine hits both transports alike
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)  # a new version has new bytes
            await one_version(case, version, model, tokenizer, engine, work, client, aclient, keys,
                              int(args.chunk_mb * 2**20))
            case.add("raw bytes", raw_bytes(model, work))
            print(f"  {name} {case.transport} v{version}: " + ", ".join(
                f"{k} {v[-1]:.3f}s" for k, v in case.phases.items()), flush=True)
    await engine.close()
    return cases


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def report(cases: list[Case], sizes: dict[str, int]) -> None:
    print(f"\nper version, seconds, median (min-max); load average {loadavg()}")
    header = ["model", "MB", "transport", "publish", "share", "fetch", "load", "total", "raw bytes", "total / raw"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for c in cases:
        total, raw = c.total(), c.phases["raw bytes"]
        cells = [c.model, f"{sizes[c.model] / 2**20:.0f}", c.transport]
        cells += [spread(c.phases[p]) if p in c.phases else "-" for p in ("publish", "share", "fetch", "load")]
        cells += [spread(total), spread(raw), f"{statistics.median(t / r for t, r in zip(total, raw)):.1f}x"]
        print("| " + " | ".join(cells) + " |")


def write_results(cases: list[Case]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "weights_publication.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["model", "transport", "version", "phase", "seconds"])
        for c in cases:
            for phase, values in c.phases.items():
                for i, v in enumerate(values):
                    out.writerow([c.model, c.transport, i + 1, phase, f"{v:.4f}"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({c.model for c in cases})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [c for c in cases if c.model == model]
        phases = ["raw bytes", "publish", "share", "fetch", "load"]
        for i, c in enumerate(mine):
            bottom = 0.0
            for j, phase in enumerate(phases[1:]):
                if phase in c.phases:
                    v = statistics.median(c.phases[phase])
                    ax.bar(i, v, bottom=bottom, color=f"C{j}", label=phase if i == len(mine) - 1 else None)
                    bottom += v
            ax.scatter(i, statistics.median(c.phases["raw bytes"]), color="black", marker="_", s=400, zorder=3,
                       label="raw bytes" if i == 0 else None)
        ax.set_xticks(range(len(mine)), [c.transport for c in mine])
        ax.set_ylabel("seconds per version (median)")
        ax.set_title(model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "weights_publication.png", dpi=100)
    print(f"wrote {RESULTS / 'weights_publication.csv'} and {RESULTS / 'weights_publication.png'}")


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


async def main_async(args: argparse.Namespace) -> None:
    transformers_logging.disable_progress_bar()
    cases: list[Case] = []
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="weights-bench-") as tmp:
        work = Path(tmp)
        server = EmbeddedRedis(work / "redis").start()
        try:
            client = redis.Redis.from_url(server.url)
            aclient = redis.asyncio.Redis.from_url(server.url)
            tiny_dir = build_tiny_model(work / "tiny", tie_word_embeddings=False)
            for name in args.models.split(","):
                if name == "tiny":
                    model_dir = tiny_dir
                    model = Qwen2ForCausalLM.from_pretrained(tiny_dir).eval()
                else:  # the same tokenizer: its files are a few KB beside the weights
                    model = qwen_05b_model()
                    model_dir = work / "q05b"
                    model.save_pretrained(model_dir)
                    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(model_dir)
                sizes[name] = sum(p.numel() * p.element_size() for p in model.parameters())
                print(f"{name}: {sizes[name] / 2**20:.0f} MB of parameters", flush=True)
                cases += await run_model(name, model_dir, model, args, work, client, aclient)
                del model
            await aclient.aclose()
            client.close()
        finally:
            server.stop()
    report(cases, sizes)
    write_results(cases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--models", default="tiny,0.5b", help="comma-separated: tiny, 0.5b")
    parser.add_argument("--chunk-mb", type=float, default=RollstreamConfig().weights_chunk_mb,
                        help="weights_chunk_mb of the Redis transport (default: the config's)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
