"""One SmolLM2 engine: decode ms per forward of a speculative step's plain decoding with and
without a drafter (tree drafts on/off), no history (the drafter proposes nothing but its
trees fill as responses finish)."""

import time

import torch

from specrl.config import SpecConfig, TreeConfig
from specrl.engines import SamplingParams
from specrl.engines.hf import HFEngine
from specrl.models import load_policy, resolve_model_path
from specrl.speculative.stage import SpeculativeStage
from specrl.types import Example, Prompt

torch.set_num_threads(2)
model, tok = load_policy(resolve_model_path("builtin:smollm2-135m-instruct"), "float32")
engine = HFEngine(model.eval(), [tok.eos_token_id], tok.pad_token_id)
prompts = [
    Prompt(tuple(1 + (i * 7 + j) % 4000 for j in range(100)), Example(f"p{i}", "", "t"))
    for i in range(4)
]
for rep in range(3):
    for tree in (False, True):
        cfg = SpecConfig(reuse="trie", tree=TreeConfig(enabled=tree))
        stage = SpeculativeStage(engine, SamplingParams(1.0), 48, cfg)
        m0 = engine.counts.metrics()
        t = time.perf_counter()
        with torch.inference_mode():
            stage(prompts, 8, (rep, 0, 0), 0)
        m = engine.counts.metrics()
        f = m["perf/decode/forwards"] - m0.get("perf/decode/forwards", 0)
        s = m["timing_s/forward/decode"] - m0.get("timing_s/forward/decode", 0)
        seconds = time.perf_counter() - t
        print(
            f"rep {rep} tree drafts {tree}: {1000 * s / f:.1f} ms per decode forward ({f:.0f}),"
            f" step {seconds:.1f} s",
            flush=True,
        )
