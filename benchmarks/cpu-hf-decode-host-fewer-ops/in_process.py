"""Vanilla `engine.generate` at the built-in task's shape (32 prompts x 8 slots, up to 72 tokens),
the engine's host milliseconds (wall less its forwards), d934d1f's decode.py (from a worktree at
/tmp/wt-old) and this checkout's taking turns in one process, one torch thread.

    python benchmarks/cpu-hf-decode-host-fewer-ops/in_process.py
"""

import importlib.util
import statistics
import sys
import time
from pathlib import Path

from specrl.engines import GenRequest, SamplingParams
from specrl.engines.hf import decode as new
from specrl.engines.hf import engine as engine_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from stage_host_work import builtin_engine

spec = importlib.util.spec_from_file_location(
    "decode_old", "/tmp/wt-old/specrl/engines/hf/decode.py"
)
old = importlib.util.module_from_spec(spec)
sys.modules["decode_old"] = old
spec.loader.exec_module(old)
engine, prompts = builtin_engine()
host = {"old": [], "new": []}
for call in range(16):
    turns = [("old", old), ("new", new)]
    for name, module in turns if call % 2 == 0 else turns[::-1]:
        engine_module.Decoder = module.Decoder
        requests = [
            GenRequest(p.ids, 72, SamplingParams(1.0), seed=1000 * call + 8 * i + s)
            for i, p in enumerate(prompts)
            for s in range(8)
        ]
        forward_s = engine.counts.seconds
        started = time.perf_counter()
        engine.generate(requests)
        wall = time.perf_counter() - started
        host[name].append(1000 * (wall - (engine.counts.seconds - forward_s)))
    print(call, {k: round(v[-1], 1) for k, v in host.items()}, flush=True)
for name, ms in host.items():
    print(name, "median host ms over calls 2-15:", round(statistics.median(ms[2:]), 1))
