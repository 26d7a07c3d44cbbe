"""The torch stand-in for vLLM's expand kernel (specrl/engines/vllm/cpu_kernels.py); no vLLM
needed."""

import torch

from specrl.engines.vllm.cpu_kernels import expand


def test_expand_spreads_each_requests_value_over_its_draft_tokens_in_any_dtype():
    # three requests with 2, 0 and 3 draft tokens; temperature 0 (greedy) is replaced by 1
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    temperature = torch.tensor([0.7, 1.3, 0.0])
    out = torch.empty(5)
    expand(out, temperature, cu, 0, 1)
    assert out.tolist() == torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0]).tolist()
    top_k = torch.tensor([4, 0, 9])
    out = torch.empty(5, dtype=torch.int64)
    expand(out, top_k, cu, 0, 0)
    assert out.tolist() == [4, 4, 9, 9, 9]
