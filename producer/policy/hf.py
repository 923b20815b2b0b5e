"""The transformers backend, for machines without vLLM: one model per worker, requests batched dynamically.

Every env of the worker calls `generate` concurrently. Requests queue up; a server task takes whatever arrived
within `batch_wait_s` of the first one (up to `max_batch_size`), runs them as one left-padded batch with a KV
cache in a thread (the event loop keeps stepping envs meanwhile) and resolves their futures. The decode loop is
written out rather than calling `model.generate` because each row keeps its own sampling parameters and seed
(validation at temperature 0 can share a batch with training) and the raw logprob of every sampled token is
recorded, the same quantity vLLM returns with logprobs_mode "raw_logprobs".
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.producer.policy.base import GenerateRequest, Generation, SamplingParams
from rollstream.producer.policy.conversation import request_prompt_ids
from rollstream.shared.bad_words import bad_word_ids
from rollstream.shared.weights_io import load_safetensors_dir, verify_digest, weights_path_from_uri


@dataclass
class _Pending:
    request: GenerateRequest
    future: asyncio.Future[Generation] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def _fail(batch: list[_Pending], error: BaseException) -> None:
    for p in batch:
        if not p.future.done():
            p.future.set_exception(error)


def _filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p per row (rows at temperature 0 are handled by the caller)."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype)
    logits = logits / temps[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1])[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params])[:, None]
    drop = rank >= top_k
    # top-p keeps the smallest prefix whose mass reaches p: drop a token once the mass *before* it is >= p.
    probs = sorted_logits.masked_fill(drop, -torch.inf).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)[:, None]
    drop |= mass_before >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _ban_bad_words(logits: torch.Tensor, bad_words: list[list[list[int]]], generated: list[list[int]]) -> None:
    """In place: -inf on the last token of each row's bad words whose other tokens that row generated last."""
    for row, (words, past) in enumerate(zip(bad_words, generated)):
        for word in words:
            head = word[:-1]
            if len(past) >= len(head) and past[len(past) - len(head):] == head:
                logits[row, word[-1]] = -torch.inf


class HFPolicy:
    """A Policy backed by a transformers causal LM; batches the concurrent requests of one worker's envs."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        version: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_batch_size: int = 64,
        batch_wait_s: float = 0.005,
        seed: int = 0,
    ) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        torch.nn.Module.to(self.model, device)  # in place; typed oddly by transformers
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.batch_sizes: Counter[int] = Counter()
        """How many batches of each size ran: lets tests and benchmarks see that requests were batched."""
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.stop_ids = {int(t) for t in [*eos_ids, self.tokenizer.eos_token_id] if t is not None}
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.stop_ids))
        self._generator = torch.Generator().manual_seed(seed)
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}
        self._version = version
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._server: asyncio.Task[None] | None = None
        # Held while a batch runs or weights load: a reload waits for the running batch and queued requests
        # wait for the reload, so every Generation comes from exactly one version.
        self._model_lock = asyncio.Lock()

    @property
    def version(self) -> int:
        return self._version

    @property
    def generating(self) -> bool:
        """A batch is on the model now."""
        return self._model_lock.locked()

    def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        return request_prompt_ids(self.tokenizer, request)

    def _bad_word_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """bad_word_ids, tokenized once per set of words rather than at every batch."""
        if words not in self._bad_words:
            self._bad_words[words] = bad_word_ids(self.tokenizer, words)
        return self._bad_words[words]

    async def generate(self, request: GenerateRequest) -> Generation:
        if self._server is None or self._server.done():
            self._server = asyncio.create_task(self._serve(), name="hf-policy-batcher")
        pending = _Pending(request)
        await self._queue.put(pending)
        return await pending.future

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            try:
                deadline = loop.time() + self.batch_wait_s
                while len(batch) < self.max_batch_size and (left := deadline - loop.time()) > 0:
                    try:
                        batch.append(await asyncio.wait_for(self._queue.get(), left))
                    except TimeoutError:
                        break
                async with self._model_lock:
                    results = await asyncio.to_thread(self._generate_batch, [p.request for p in batch])
            except asyncio.CancelledError:
                _fail(batch, RuntimeError("policy closed"))
                raise
            except Exception as e:  # a bad request fails its batch, never the server
                _fail(batch, e)
                continue
            self.batch_sizes[len(batch)] += 1
            for p, result in zip(batch, results):
                if not p.future.done():  # the caller may have been cancelled meanwhile
                    p.future.set_result(result)

    @torch.no_grad()
    def _generate_batch(self, requests: list[GenerateRequest]) -> list[Generation]:
        params = [r.sampling for r in requests]
        prompts = [self.prompt_token_ids(r) for r in requests]
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else self._generator for p in params]
        bad_words = [self._bad_word_ids(p.bad_words) for p in params]
        greedy = torch.tensor([p.temperature <= 0 for p in params])
        limits = torch.tensor([p.max_tokens for p in params])
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        done = limits <= 0
        next_pos = positions[:, -1]
        for _ in range(int(limits.max().item())):
            logits = out.logits[:, -1].float().cpu()
            raw = logits.log_softmax(-1)  # before the bans and filters: the policy's own logprob, as vLLM's raw
            _ban_bad_words(logits, bad_words, tokens)
            probs = _filter_logits(logits, params).softmax(-1)
            # Inverse-CDF sampling with one uniform per row from that row's generator: seeded rows reproduce.
            u = torch.cat([torch.rand(1, generator=g) for g in generators])
            cdf = probs.cumsum(-1)
            sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp(max=probs.shape[-1] - 1)
            chosen = torch.where(greedy, logits.argmax(-1), sampled)
            for i in torch.nonzero(~done).flatten().tolist():
                tok = int(chosen[i])
                tokens[i].append(tok)
                logprobs[i].append(float(raw[i, tok]))
                if tok in self.stop_ids or len(tokens[i]) >= limits[i]:
                    done[i] = True
            if bool(done.all()):
                break
            # Finished rows keep decoding a pad token: cheaper than reshaping the cache, and their output is unused.
            feed = torch.where(done, self.pad_id, chosen)[:, None].to(self.device)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            next_pos = next_pos + 1
            out = self.model(
                input_ids=feed,
                attention_mask=mask,
                position_ids=next_pos[:, None],
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return [self._to_generation(t, lp) for t, lp in zip(tokens, logprobs)]

    def _to_generation(self, tokens: list[int], logprobs: list[float]) -> Generation:
        stopped = bool(tokens) and tokens[-1] in self.stop_ids
        return Generation(
            text=str(self.tokenizer.decode(tokens, skip_special_tokens=True)),
            token_ids=np.asarray(tokens, np.int32),
            logprobs=np.asarray(logprobs, np.float32),
            finish_reason="stop" if stopped else "length",
            version=self._version,
        )

    async def load_weights(self, version: int, uri: str, digest: str) -> None:
        """Check the digest, then swap the weights in between two batches."""
        path = weights_path_from_uri(uri)
        await asyncio.to_thread(verify_digest, path, digest)
        state = await asyncio.to_thread(load_safetensors_dir, path)
        async with self._model_lock:
            await asyncio.to_thread(self._load_state, state)
            self._version = version

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy `state` into the model after checking every name and shape, so a bad checkpoint loads nothing."""
        own = self.model.state_dict()
        # A tied output layer is the input embedding itself: the checkpoint rightly omits it.
        embedding = self.model.get_input_embeddings().weight
        tied = {n for n, p in self.model.named_parameters(remove_duplicate=False) if p is embedding}
        missing = sorted(set(own) - set(state) - tied)
        unexpected = sorted(set(state) - set(own))
        reshaped = sorted(n for n in set(state) & set(own) if state[n].shape != own[n].shape)
        if missing or unexpected or reshaped:
            raise ValueError(
                f"weights do not fit the model: missing {missing}, unexpected {unexpected}, wrong shape {reshaped}"
            )
        self.model.load_state_dict(state, strict=False)

    async def close(self) -> None:
        if self._server is not None:
            self._server.cancel()
            await asyncio.gather(self._server, return_exceptions=True)
            self._server = None
        while not self._queue.empty():
            _fail([self._queue.get_nowait()], RuntimeError("policy closed"))
