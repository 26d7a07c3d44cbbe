"""Attention of the transformers engine's forwards on the CPU: transformers' `sdpa` (PyTorch's
scaled_dot_product_attention), except where a decode forward feeds a few columns after a cache
(a token and its drafts): there a matmul and a softmax compute it.

On the CPU SDPA's flash kernel has a fast path for one query column and none for two to a
few: over a cache of 70 keys, 2-9 columns took it 1.9-2.8x as long as a matmul-softmax at the
built-in policy's heads, and 2.3-6.2x at SmolLM2's, whose query heads share KV heads (GQA), at
250-1000 keys 1.5-5.2x (`benchmarks/cpu-attention-draft-columns`). With more columns or keys
the flash kernel wins again; `uses_matmul` is the regime where the matmul measured faster.
Forwards of one column (plain decoding), prefills, trie passes and anything that records
gradients keep SDPA's arithmetic exactly. The function is registered with transformers'
`AttentionInterface` under `NAME` (and `sdpa`'s mask under the same name) and set on CPU
engines' models whose attention is `sdpa` (`use_small_query_attention`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "specrl_sdpa"
SMALL_QUERY = 1024  # most query columns x keys by matmul where each query head has its own KV
GROUPED_COLUMNS = 16  # most query columns by matmul where query heads share KV heads (GQA) ...
GROUPED_KEYS = 1024  # ... over at most this many keys


def uses_matmul(columns: int, keys: int, groups: int) -> bool:
    """Whether a forward of `columns` query columns over `keys` keys (a cache, then the fed
    columns), `groups` query heads per KV head, computes attention by matmul: where it measured
    faster than SDPA's flash kernel (benchmarks/cpu-attention-draft-columns)."""
    if not 1 < columns < keys:
        return False
    if groups > 1:
        return columns <= GROUPED_COLUMNS and keys <= GROUPED_KEYS
    return columns * keys <= SMALL_QUERY


def small_query_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, D]
    key: torch.Tensor,  # [B, H_kv, kv, D]
    value: torch.Tensor,  # [B, H_kv, kv, D]
    attention_mask: torch.Tensor | None,  # [B, 1, q, kv], True (or 0.0) where attended
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output [B, q, H, D], as transformers' attention functions return it."""
    if not (
        uses_matmul(query.shape[2], key.shape[2], query.shape[1] // key.shape[1])
        and query.device.type == "cpu"
        and attention_mask is not None
        and not dropout
        and not torch.is_grad_enabled()
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return matmul_attention(query, key, value, attention_mask, scaling), None


def matmul_attention(
    query: torch.Tensor,  # [B, H, q, D]
    key: torch.Tensor,  # [B, H_kv, kv, D]
    value: torch.Tensor,  # [B, H_kv, kv, D]
    mask: torch.Tensor,  # [B, 1, q, kv], bool (True where attended) or float (added)
    scaling: float | None = None,
) -> torch.Tensor:
    """softmax(query keys^T x scaling + mask) values → [B, q, H, D]."""
    batch, heads, columns, dim = query.shape
    groups = heads // key.shape[1]  # query heads per KV head, consecutive (as repeat_kv)
    # a KV head's query heads as rows of one matmul: no copy of the keys and values
    grouped = query.reshape(batch, key.shape[1], groups * columns, dim)
    mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).flatten(2, 3)
    scores = torch.matmul(grouped, key.transpose(2, 3)) * (scaling or dim**-0.5)
    if mask.dtype == torch.bool:  # the least float, not -inf: a row without keys stays finite
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    # at least float32 (as transformers' eager attention for half precisions), float64 kept
    precision = torch.promote_types(scores.dtype, torch.float32)
    weights = torch.softmax(scores, dim=-1, dtype=precision).to(value.dtype)
    output = torch.matmul(weights, value).reshape(batch, heads, columns, dim)
    return output.transpose(1, 2).contiguous()


AttentionInterface.register(NAME, small_query_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_small_query_attention(model: PreTrainedModel) -> None:
    """Set `small_query_attention` on `model` when its attention is `sdpa` on the CPU; any other
    implementation or device stays as it is."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    if on_cpu and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
