"""What a recorded rollout trace would cost elsewhere: a roofline price of the engine's forwards.

A forward costs a fixed overhead plus the larger of its compute time and its memory time:

    compute = 2 · P · positions + 4 · layers · heads · head_dim · attended   (FLOPs / peak)
    memory  = weight bytes + KV bytes per token · kv_reads                   (bytes / bandwidth)

for a model shape (any Hugging Face `config.json`: parameters P, layers, heads, KV heads, dtype)
on a device (peak FLOPs, memory bandwidth, overhead per forward, and the fractions of peak an
engine reaches). The trace is the `perf/*` counts a run logs per step (`engines.accounting`):
each step's forwards of a kind are priced at their mean size. Work a kind records without
forwards of its own (vLLM's prefills, scheduled into its decode steps) costs its compute only.

This is a projection, not a measurement: it knows the work and nothing of kernels, batching
limits, KV-cache capacity (preemption), communication, or how acceptance changes with the
policy and the response length.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrl.engines.accounting import KINDS, ForwardCounts
from specrl.errors import UserError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}

# the keys of their Hugging Face config.json that the cost model reads
MODEL_CONFIGS: dict[str, dict[str, object]] = {
    "qwen2.5-1.5b": {
        "num_hidden_layers": 28, "hidden_size": 1536, "intermediate_size": 8960,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype_bytes: int

    @classmethod
    def from_config(cls, name: str, config: Mapping[str, object]) -> ModelShape:
        """From a Hugging Face config (a decoder with gated MLPs: Llama, Qwen2, Mistral)."""
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
            return cls(
                name=name,
                layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                dtype_bytes=DTYPE_BYTES.get(dtype, 2),
            )
        except KeyError as err:
            raise UserError(f"model shape {name}: its config has no {err.args[0]!r}") from None

    @classmethod
    def named(cls, spec: str) -> ModelShape:
        """A name of MODEL_CONFIGS, or the path of a config.json (or of a model directory)."""
        if spec in MODEL_CONFIGS:
            return cls.from_config(spec, MODEL_CONFIGS[spec])
        path = Path(spec)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise UserError(
                f"model {spec!r}: neither {', '.join(MODEL_CONFIGS)} nor a config.json path"
            )
        return cls.from_config(path.parent.name or spec, json.loads(path.read_text()))

    @property
    def params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attention + mlp) + embeddings

    @property
    def flops_per_position(self) -> int:
        """Every weight but the input embedding's lookup multiplies and adds once per position."""
        return 2 * (self.params - (0 if self.tied else self.vocab * self.hidden))

    @property
    def flops_per_pair(self) -> int:
        """Q·K and the weighted sum of V for one query-key pair, over all layers and heads."""
        return 4 * self.layers * self.heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class Device:
    """A device as the cost model sees it. `compute_efficiency` and `memory_efficiency` are the
    fractions of peak an inference engine reaches; `overhead_s` what a forward costs besides
    (scheduling, launches), and `decode_overhead_s` what a decode forward does where that
    differs (an engine that replays decode forwards as CUDA graphs and runs its other forwards
    eagerly; None: the same); `capture_s` what capturing one of those graphs costs, once per
    shape the engine meets (0: none captured, or not known). On a GPU compute and memory
    traffic overlap (a forward takes the larger); on a CPU they add up (`overlap=False`)."""

    name: str
    peak_flops: float
    bandwidth: float  # bytes / s
    overhead_s: float
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    source: str = ""
    overlap: bool = True
    decode_overhead_s: float | None = None
    capture_s: float = 0.0

    @classmethod
    def named(cls, spec: str) -> Device:
        """A name of DEVICES, or `name=...,flops=...,bandwidth=...,overhead_ms=...` (flops in
        FLOP/s, bandwidth in bytes/s; optional compute_efficiency, memory_efficiency)."""
        if spec.lower() in DEVICES:
            return DEVICES[spec.lower()]
        fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
        try:
            return cls(
                name=fields.get("name", "custom"),
                peak_flops=float(fields["flops"]),
                bandwidth=float(fields["bandwidth"]),
                overhead_s=float(fields.get("overhead_ms", 2.0)) / 1e3,
                compute_efficiency=float(fields.get("compute_efficiency", 0.6)),
                memory_efficiency=float(fields.get("memory_efficiency", 0.8)),
                source="given on the command line",
            )
        except (KeyError, ValueError):
            raise UserError(
                f"device {spec!r}: use {', '.join(DEVICES)} or name=...,flops=9.9e14,"
                "bandwidth=3.35e12,overhead_ms=2"
            ) from None

    def forward_s(self, flops: float, memory_bytes: float, kind: str) -> float:
        """The seconds of one forward of `kind` (accounting's KINDS)."""
        compute = flops / (self.peak_flops * self.compute_efficiency)
        memory = memory_bytes / (self.bandwidth * self.memory_efficiency)
        overhead = self.overhead_s
        if kind == "decode" and self.decode_overhead_s is not None:
            overhead = self.decode_overhead_s
        return overhead + (max(compute, memory) if self.overlap else compute + memory)


_OVERHEAD = (
    "overhead 2 ms per forward: an assumption for an engine with CUDA graphs (vLLM, SGLang), "
    "not a measurement"
)
DEVICES = {
    "h100": Device(
        "NVIDIA H100 SXM5 80GB", 989e12, 3.35e12, 2e-3,
        source="NVIDIA H100 datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3; " + _OVERHEAD,
    ),
    "h200": Device(
        "NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 2e-3,
        source="NVIDIA H200 datasheet: 989 TFLOPS dense BF16, 4.8 TB/s HBM3e; " + _OVERHEAD,
    ),
}  # fmt: skip


def step_seconds(counts: ForwardCounts, model: ModelShape, device: Device) -> float:
    """The price of one step's forwards: each kind's forwards at their mean size; work of a
    kind without forwards of its own at its compute alone; the CUDA graphs captured."""
    total = counts.decode_captures * device.capture_s
    for kind in KINDS:
        forwards = getattr(counts, f"{kind}_forwards")
        positions = getattr(counts, f"{kind}_positions")
        flops = model.flops_per_position * positions + model.flops_per_pair * getattr(
            counts, f"{kind}_attended"
        )
        if forwards == 0:
            total += flops / (device.peak_flops * device.compute_efficiency)
            continue
        kv = model.kv_bytes_per_token * getattr(counts, f"{kind}_kv_reads")
        memory = model.weight_bytes + kv / forwards
        total += forwards * device.forward_s(flops / forwards, memory, kind)
    return total


def stretched(counts: ForwardCounts, factor: float) -> ForwardCounts:
    """The step with responses `factor` times longer, prompts unchanged: decode forwards,
    positions and drafts scale with the length, KV reads and attended pairs with its square
    (responses much longer than prompts); prefills stay; verification passes (whole responses)
    scale as decoding's work but keep their number of forwards."""
    scaled = {}
    for kind in ("decode", "verify"):
        linear = ["rows", "positions"] + (
            ["forwards", "draft_positions"] if kind == "decode" else []
        )
        for quantity in linear:
            name = f"{kind}_{quantity}"
            scaled[name] = round(getattr(counts, name) * factor)
        for quantity in ("kv_reads", "attended"):
            name = f"{kind}_{quantity}"
            scaled[name] = round(getattr(counts, name) * factor**2)
    return replace(counts, **scaled)


def fit_device(
    calls: Iterable[tuple[ForwardCounts, float]],
    model: ModelShape,
    name: str,
    graph_decoding: bool = False,
) -> Device:
    """This machine as a `Device`, from timed calls (counts, seconds) of varied sizes: least
    squares of seconds = overhead · forwards + FLOPs / throughput + bytes / bandwidth, the
    bytes those of the weights and of the KV entries read (a CPU: compute and memory add up).
    With `graph_decoding` (the engine replays its decode forwards as CUDA graphs) decode
    forwards get an overhead of their own."""
    features, seconds = [], []
    for counts, measured in calls:
        forwards = [getattr(counts, f"{kind}_forwards") for kind in KINDS]
        flops = sum(
            model.flops_per_position * getattr(counts, f"{kind}_positions")
            + model.flops_per_pair * getattr(counts, f"{kind}_attended")
            for kind in KINDS
        )
        kv = sum(getattr(counts, f"{kind}_kv_reads") for kind in KINDS)
        decode = counts.decode_forwards
        per_forward = [decode, sum(forwards) - decode] if graph_decoding else [sum(forwards)]
        memory = model.weight_bytes * sum(forwards) + model.kv_bytes_per_token * kv
        features.append([*per_forward, flops, memory])
        seconds.append(measured)
    a = np.array(features, float)
    scale = np.linalg.norm(a, axis=0)  # columns of forwards, FLOPs and bytes: 1 to 1e12
    scale[scale == 0] = 1.0
    fit = np.linalg.lstsq(a / scale, seconds, None)[0] / scale
    *overheads, per_flop, per_byte = (float(c) for c in fit)
    return Device(
        name, 1 / max(per_flop, 1e-18), 1 / max(per_byte, 1e-18), max(overheads[-1], 0.0),
        1.0, 1.0, source="fitted to timed calls of the engine on this machine", overlap=False,
        decode_overhead_s=max(overheads[0], 0.0) if graph_decoding else None,
    )  # fmt: skip
