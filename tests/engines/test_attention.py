"""The engine's attention on the CPU (specrl/engines/hf/attention.py): a matmul-softmax for a
few query columns after a cache, SDPA for everything else."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specrl.engines.hf import HFEngine
from specrl.engines.hf.attention import NAME, small_query_attention


class Heads(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def inputs(batch, heads, kv_heads, columns, keys, dim=32):
    torch.manual_seed(0)
    query = torch.randn(batch, heads, columns, dim)
    key, value = torch.randn(2, batch, kv_heads, keys + 8, dim)[:, :, :, :keys]  # cache views
    mask = torch.ones(batch, 1, columns, keys, dtype=torch.bool)
    mask[..., keys - columns :] = torch.ones(columns, columns, dtype=torch.bool).tril()
    mask[0, ..., :5] = False  # a left-padded row
    return query, key, value, mask


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("float_mask", [False, True])
def test_draft_columns_after_a_cache_match_sdpa(heads, kv_heads, float_mask):
    query, key, value, mask = inputs(3, heads, kv_heads, columns=5, keys=40)
    if float_mask:  # as the engine's tree masks: 0 where attended, the least float elsewhere
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = Heads(heads, kv_heads)
    with torch.no_grad():
        ours, _ = small_query_attention(module, query, key, value, mask, scaling=0.2)
        sdpa, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)
    assert ours.shape == sdpa.shape == (3, 5, heads, 32)
    torch.testing.assert_close(ours, sdpa, rtol=0, atol=1e-5)


def test_float64_stays_float64():
    # float64 runs compare trie and vanilla rollouts token for token (tests/test_realmodel.py)
    query, key, value, mask = (
        t.double() if t.is_floating_point() else t for t in inputs(2, 6, 2, 4, 30)
    )
    with torch.no_grad():
        ours, _ = small_query_attention(Heads(6, 2), query, key, value, mask)
        sdpa, _ = sdpa_attention_forward(Heads(6, 2), query, key, value, mask)
    torch.testing.assert_close(ours, sdpa, rtol=0, atol=1e-12)


def test_a_query_row_without_keys_stays_finite_and_leaves_the_others_alone():
    # a left-padded prompt position attends to nothing: -inf there would put NaN in the cache
    query, key, value, mask = inputs(2, 4, 4, columns=3, keys=20)
    mask[1, :, 0] = False
    with torch.no_grad():
        ours, _ = small_query_attention(Heads(4, 4), query, key, value, mask)
        sdpa, _ = sdpa_attention_forward(Heads(4, 4), query, key, value, mask)
    assert ours.isfinite().all()
    torch.testing.assert_close(ours[0], sdpa[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1, 1:], sdpa[1, 1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("columns", "keys", "grad"),
    [(1, 40, False), (12, 12, False), (16, 200, False), (5, 40, True)],
    ids=["one column", "prefill", "many pairs", "gradients"],
)
def test_plain_decoding_prefills_long_queries_and_training_keep_sdpas_arithmetic(
    columns, keys, grad
):
    query, key, value, mask = inputs(2, 4, 4, columns, keys)
    with torch.set_grad_enabled(grad):
        ours, _ = small_query_attention(Heads(4, 4), query, key, value, mask)
        sdpa, _ = sdpa_attention_forward(Heads(4, 4), query, key, value, mask)
    assert torch.equal(ours, sdpa)


def test_a_cpu_engine_sets_it_on_an_sdpa_model_and_leaves_eager_alone(tiny_policy_dir):
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    HFEngine(sdpa, [1], 0)
    assert sdpa.config._attn_implementation == NAME
    eager = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, attn_implementation="eager")
    HFEngine(eager, [1], 0)
    assert eager.config._attn_implementation == "eager"
