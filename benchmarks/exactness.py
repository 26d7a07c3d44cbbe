"""Trie rollouts against vanilla's at fixed weights on a real model (SmolLM2-135M-Instruct by
default), and where their float32 arithmetic differs.

    python benchmarks/exactness.py --out benchmarks/cpu-hf-smollm2-exactness

1. `discrepancy`: the logits of the same response positions computed as decoding computes them
   (KV cache, one token per forward), as a trie pass does (tree mask, the response a branch of
   a trie) and by one full causal forward; the differences of their logits, of the hidden
   states the LM head reads, and of the logits with that head in float64.
2. `head_cost`: a decode forward (64 rows, 150 cached positions) against its LM head in float32
   and in float64.
3. `settings`: per sampling setting (and with LoRA adapters), trie rollouts against vanilla's
   at fixed weights: the flip rate per token and every flip's margin against the float error
   (tests/speculative/exactness.py says what is measured).

Writes results.json. Run alone (part 2 times forwards).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the tests package lives there
sys.path.insert(0, str(ROOT))

SETTINGS = {  # name → (temperature, top_p, top_k, LoRA adapters)
    "t1": (1.0, 1.0, 0, False),
    "t1-top_p0.9-top_k50": (1.0, 0.9, 50, False),
    "t1-lora": (1.0, 1.0, 0, True),
}


def discrepancy(model, prompts, length: int, seed: int) -> dict:
    """Logit differences between decoding, a trie pass and a full forward over the same sampled
    responses (see the module's docstring)."""
    from transformers import DynamicCache

    from specrl.engines.hf.engine import tree_inputs
    from specrl.speculative.tree import PromptTree

    head = model.get_output_embeddings()
    weight64 = head.weight.double()
    read = {}
    hook = head.register_forward_hook(lambda _m, inputs, _o: read.__setitem__("h", inputs[0]))
    torch.manual_seed(seed)
    pairs = {"decode-trie": [], "decode-full": [], "trie-full": []}
    with torch.inference_mode():
        for p in prompts:
            prompt = list(p.ids)
            ids = torch.tensor([prompt] * 2)
            sampled = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     max_new_tokens=length, min_new_tokens=length)  # fmt: skip
            response, other = (row[len(prompt) :].tolist() for row in sampled)
            cache = DynamicCache()
            model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
            decoded = []
            for token in [prompt[-1], *response[:-1]]:
                fed = torch.tensor([[token]])
                logits = model(input_ids=fed, past_key_values=cache, use_cache=True).logits
                decoded.append((logits[0, -1], read["h"][0, -1]))
            full = model(input_ids=torch.tensor([prompt + response[:-1]])).logits[0]
            full = [(full[i], read["h"][0, i]) for i in range(len(prompt) - 1, full.shape[0])]
            tree = PromptTree()
            tree.insert(other)
            tree.insert(response)
            ids, mask, positions, _ = tree_inputs(
                [(prompt, tree.parent[1:], tree.token[1:])], model.config.pad_token_id or 0
            )
            bias = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
            logits = model(input_ids=ids, attention_mask=bias[:, None], position_ids=positions)
            start, node, columns = ids.shape[1] - (len(tree.token) - 1), 0, []
            for token in response[:-1]:
                node = tree.children[node][token]
                columns.append(start + node - 1)
            columns = [start - 1, *columns]  # after the prompt, then after each node
            trie = [(logits.logits[0, c], read["h"][0, c]) for c in columns]
            paths = {"decode": decoded, "trie": trie, "full": full}
            for pair in pairs:
                a, b = (paths[name] for name in pair.split("-"))
                for (la, ha), (lb, hb) in zip(a, b, strict=False):
                    head64 = (ha.double() - hb.double()) @ weight64.T
                    pairs[pair].append(((la - lb).abs(), (ha - hb).abs().max(), head64.abs()))
    hook.remove()
    out = {}
    for pair, rows in pairs.items():
        logits = torch.stack([r[0] for r in rows])
        head64 = torch.stack([r[2] for r in rows])
        out[pair] = {
            "positions": len(rows),
            "logits_max": float(logits.max()),
            "logits_median": float(logits.median()),
            "hidden_max": float(max(r[1] for r in rows)),
            "logits_head64_max": float(head64.max()),
            "logits_head64_median": float(head64.median()),
        }
    return out


def head_cost(model, repeats: int = 10) -> dict:
    """Milliseconds of a decode forward of 64 rows over 150 cached positions, and of its LM head
    alone in float32 and in float64."""
    from transformers import DynamicCache

    weight = model.get_output_embeddings().weight
    weight64 = weight.double()
    hidden = torch.randn(64, weight.shape[1])
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.randint(0, weight.shape[0], (64, 150)), past_key_values=cache)
        fed = torch.randint(0, weight.shape[0], (64, 1))
        calls = {
            "decode_forward_ms": lambda: model(input_ids=fed, past_key_values=cache),
            "head_float32_ms": lambda: hidden @ weight.T,
            "head_float64_ms": lambda: hidden.double() @ weight64.T,
        }
        out = {}
        for name, call in calls.items():
            call()
            started = time.perf_counter()
            for _ in range(repeats):
                call()
            out[name] = (time.perf_counter() - started) / repeats * 1000
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    from specrl.engines import SamplingParams
    from specrl.engines.hf import HFEngine
    from specrl.models import eos_token_ids, load_policy, resolve_model_path
    from tests.speculative.exactness import (
        chat_prompts,
        compare_trie_with_vanilla,
        with_moved_adapters,
    )

    torch.set_num_threads(2)
    load = os.getloadavg()
    path = resolve_model_path(args.model)
    model, tokenizer = load_policy(path, "float32")
    prompts = chat_prompts(tokenizer, args.prompts, args.seed)
    differences = discrepancy(model.eval(), prompts[:4], args.max_tokens, args.seed)
    print(json.dumps(differences, indent=1))
    cost = head_cost(model)
    print(cost)
    results = {}
    for name in args.settings.split(","):
        temperature, top_p, top_k, lora = SETTINGS[name]
        model, tokenizer = load_policy(path, "float32")
        model = with_moved_adapters(model, args.seed) if lora else model.eval()
        prompts = chat_prompts(tokenizer, args.prompts, args.seed)
        engine = HFEngine(model, eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
        sampling = SamplingParams(temperature, top_p, top_k)
        started = time.perf_counter()
        comparison = compare_trie_with_vanilla(
            engine, prompts, args.n, sampling, args.max_tokens, args.rounds, args.seed
        )
        results[name] = {
            "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k},
            "lora": lora,
            "seconds": time.perf_counter() - started,
            **comparison.summary(),
        }
        summary = results[name]
        print(
            f"{name}: {summary['flipped_slots']} flips in {summary['tokens']} tokens "
            f"(rate {summary['flip_rate_per_token']:.2e}, agreement "
            f"{summary['token_agreement']:.4f}, reused {summary['reused_tokens']}), largest "
            f"margin / float error {summary['largest_margin_over_float_error']:.2f}"
        )
    out = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_at_start": load,
        "model": args.model,
        "prompts": args.prompts, "n": args.n, "rounds": args.rounds, "max_tokens": args.max_tokens,
        "discrepancy": differences,
        "head_cost": cost,
        "settings": results,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
