"""Host work of stage calls: the stage's own (seconds of a call outside the engine's generate
and verify calls) and the engine's (those calls less their model forwards: the decode loop's
bookkeeping, sampling, the KV cache's upkeep), for a vanilla stage and a trie stage taking turns
on one engine, at the shape of `benchmarks/gpu/run.sh`'s default bench (32 prompts of the
built-in task x 4 slots, responses of up to 72 tokens, the built-in policy, no tree drafts as on
a graph engine) and with a budget under which no node pays (no trie pass: the trees' upkeep, the
budget and the hindsight walks alone). The weights stay fixed, so the tries fill up as in a
sharp policy's run. `--slots 8` is the default config's shape (256 sequences a call).

    python benchmarks/stage_host_work.py [--calls 12] [--slots 4]

Prints each call's host milliseconds per stage (its own, then the engine's), then the medians
over the calls after the first three (the tries' window filling). Run alone, from the checkout
(or worktree) to measure.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from specrl.config import SpecConfig, load_config
from specrl.config.rollout import TreeConfig
from specrl.data import load_prompts
from specrl.engines import SamplingParams
from specrl.engines.hf import HFEngine
from specrl.models import eos_token_ids, load_policy
from specrl.speculative.reuse.budget import TrieBudget
from specrl.speculative.stage import SpeculativeStage
from specrl.trainer import Trainer


class NothingPays(TrieBudget):
    """A budget under which no node is worth verifying."""

    @property
    def node_cost(self) -> float:
        return 1.0

    def token_cost(self, reuse: float) -> float:
        return 0.0


def builtin_engine() -> tuple[HFEngine, list]:
    """The built-in policy on the transformers engine, one torch thread, and the built-in task's
    first 32 training prompts (seed 1)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"trainer.output_dir={out}", "trainer.logger=[jsonl]"])
        model_dir = Trainer(cfg).run.model_dir
    policy, tokenizer = load_policy(model_dir, "float32")
    prompts = load_prompts(cfg.data, tokenizer, 1, print)[0][:32]
    engine = HFEngine(policy.eval(), eos_token_ids(policy, tokenizer), tokenizer.pad_token_id)
    return engine, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--slots", type=int, default=4)
    args = parser.parse_args()
    engine, prompts = builtin_engine()
    sampling = SamplingParams(1.0)
    trie = SpecConfig(reuse="trie", tree=TreeConfig(enabled=False))
    stages = {
        "vanilla": SpeculativeStage(engine, sampling, 72, SpecConfig(enabled=False)),
        "trie": SpeculativeStage(engine, sampling, 72, trie),
    }
    stages["trie"].reuse.budget = NothingPays()
    host: dict[str, list[tuple[float, float]]] = {name: [] for name in stages}
    for call in range(args.calls):
        for name, stage in stages.items():
            forward_s = engine.counts.seconds
            _, stats = stage(prompts, args.slots, (1, call, 0), call)
            engine_s = stats.gen_s + stats.verify_s
            engine_host_s = engine_s - (engine.counts.seconds - forward_s)
            host[name].append((1000 * (stats.rollout_s - engine_s), 1000 * engine_host_s))
        calls = (f"{n} {ms[-1][0]:.1f} + {ms[-1][1]:.1f} ms" for n, ms in host.items())
        print(f"call {call}: " + ", ".join(calls))
    for name, ms in host.items():
        stage_ms, engine_ms = (statistics.median(m[k] for m in ms[3:]) for k in (0, 1))
        print(
            f"{name}: median {stage_ms:.1f} ms the stage's, {engine_ms:.1f} ms the engine's, "
            f"over calls 3-{args.calls - 1}"
        )


if __name__ == "__main__":
    main()
