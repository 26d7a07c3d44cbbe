"""The trie stage's own host work: seconds of a stage call outside the engine's generate and
verify calls, for a vanilla stage and a trie stage taking turns on one engine, at the shape of
`benchmarks/gpu/run.sh`'s default bench (32 prompts of the built-in task x 4 slots, responses of
up to 72 tokens, the built-in policy, no tree drafts as on a graph engine) and with a budget
under which no node pays (no trie pass: the trees' upkeep, the budget and the hindsight walks
alone). The weights stay fixed, so the tries fill up as in a sharp policy's run.

    python benchmarks/stage_host_work.py [--calls 12]

Prints each call's host milliseconds per stage, then the median over the calls after the first
three (the tries' window filling). Run alone, from the checkout (or worktree) to measure.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"trainer.output_dir={out}", "trainer.logger=[jsonl]"])
        model_dir = Trainer(cfg).run.model_dir
    policy, tokenizer = load_policy(model_dir, "float32")
    prompts = load_prompts(cfg.data, tokenizer, 1, print)[0][:32]
    engine = HFEngine(policy.eval(), eos_token_ids(policy, tokenizer), tokenizer.pad_token_id)
    sampling = SamplingParams(1.0)
    trie = SpecConfig(reuse="trie", tree=TreeConfig(enabled=False))
    stages = {
        "vanilla": SpeculativeStage(engine, sampling, 72, SpecConfig(enabled=False)),
        "trie": SpeculativeStage(engine, sampling, 72, trie),
    }
    stages["trie"].reuse.budget = NothingPays()
    host: dict[str, list[float]] = {name: [] for name in stages}
    for call in range(args.calls):
        for name, stage in stages.items():
            _, stats = stage(prompts, 4, (1, call, 0), call)
            host[name].append(1000 * (stats.rollout_s - stats.gen_s - stats.verify_s))
        print(f"call {call}: " + ", ".join(f"{n} {ms[-1]:.1f} ms" for n, ms in host.items()))
    for name, ms in host.items():
        print(f"{name}: median {statistics.median(ms[3:]):.1f} ms over calls 3-{args.calls - 1}")


if __name__ == "__main__":
    main()
