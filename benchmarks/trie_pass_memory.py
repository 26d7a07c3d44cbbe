"""Trie passes with glibc keeping freed memory (specrl's setting, specrl/host_memory.py) against
glibc's defaults, on SmolLM2-135M-Instruct: each setting in its own process, the two taking
turns. A process times, on the transformers engine with 2 threads, a prefill of 4 chat prompts
in the style of the documented chain_sum task (76-79 tokens) and passes over tries of 1, 15 and 60 random
nodes per prompt (branching one node in five), `--rounds` times after two untimed rounds, and
profiles three 60-node passes (the seconds of the calls that allocate [nodes, vocabulary]
tensors). glibc's defaults: `MALLOC_TRIM_THRESHOLD_=131072` (its default value) in the
environment, which makes specrl leave malloc alone.

    python benchmarks/trie_pass_memory.py --out FILE [--turns 2] [--rounds 5]

Run alone: it measures the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SYSTEM = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear "
    "and specific manner. Once you have thought about the reasoning process, provide the answer "
    "in the following format: <answer>answer here</answer>"
)
QUESTIONS = ("3 + 4 + 5", "7 - 2 + 9", "8 + 1", "6 + 3 - 2")
NODES = (1, 15, 60)
SETTINGS = {"kept": {}, "glibc": {"MALLOC_TRIM_THRESHOLD_": "131072"}}


def measure(rounds: int) -> dict:
    """This process's timings (run with --measure)."""
    import cProfile
    import pstats

    import torch
    from transformers import DynamicCache

    from specrl.engines import SamplingParams, TrieRequest
    from specrl.engines.hf import HFEngine
    from specrl.engines.hf.decode import left_pad
    from specrl.models import eos_token_ids, load_policy, resolve_model_path

    torch.set_num_threads(2)
    path = resolve_model_path("builtin:smollm2-135m-instruct")
    policy, tokenizer = load_policy(path, "float32")
    engine = HFEngine(policy.eval(), eos_token_ids(policy, tokenizer), tokenizer.pad_token_id)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"State the final answer to: {q} ="},
                ],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    rng = random.Random(0)

    def prefill() -> float:
        ids, attention = left_pad([p[:-1] for p in prompts], tokenizer.pad_token_id, engine.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        started = time.perf_counter()
        with torch.inference_mode():
            engine.forward("prefill", ids, attention, positions, DynamicCache(), keep=1)
        return time.perf_counter() - started

    def verify(nodes: int) -> float:
        requests = []
        for prompt in prompts:
            parents = [0] + [
                i if rng.random() < 0.8 else rng.randrange(1, i + 1) for i in range(1, nodes)
            ]
            tokens = [rng.randrange(1000, 20000) for _ in range(nodes)]
            requests.append(TrieRequest(prompt, parents, tokens, SamplingParams(1.0)))
        started = time.perf_counter()
        with torch.inference_mode():
            engine.verify_tries(requests, engine.new_prefixes())
        return time.perf_counter() - started

    for _ in range(2):
        prefill(), verify(NODES[-1])
    seconds: dict[str, list[float]] = {"prefill": [], **{f"pass_{n}": [] for n in NODES}}
    for _ in range(rounds):
        seconds["prefill"].append(prefill())
        for n in NODES:
            seconds[f"pass_{n}"].append(verify(n))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        verify(NODES[-1])
    profile.disable()
    calls = {
        name: round(stat[3], 3)
        for (_, _, name), stat in pstats.Stats(profile).stats.items()
        if name in ("<method 'to' of 'torch._C.TensorBase' objects>",
                    "<method 'index_select' of 'torch._C.TensorBase' objects>",
                    "<method 'log_softmax' of 'torch._C.TensorBase' objects>",
                    "<built-in method torch._C._nn.linear>")
    }  # fmt: skip
    return {
        "prompt_tokens": [len(p) for p in prompts],
        "median_s": {k: round(statistics.median(v), 4) for k, v in seconds.items()},
        "seconds": seconds,
        "three_60_node_passes_profiled_s": calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.rounds)))
        return
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    result = {"command": " ".join(sys.argv), "load_average_at_start": os.getloadavg(), "runs": []}
    for turn in range(args.turns):
        for setting, extra in SETTINGS.items():
            out = subprocess.run(
                [sys.executable, __file__, "--measure", "--rounds", str(args.rounds)],
                env=environment | extra, capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            run = {"turn": turn, "setting": setting, **json.loads(out.splitlines()[-1])}
            result["runs"].append(run)
            print(setting, run["median_s"], run["three_60_node_passes_profiled_s"])
    result["load_average_at_end"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
