"""The two parts 0d1df2d rewrote, timed alone against their d934d1f versions (kept here for the
comparison): the decode tally of a 60-forward call of 256 rows attending 80 columns, and
`left_pad` of 256 sequences of 10-16 tokens. Both return the same values.

    python benchmarks/cpu-hf-decode-host-fewer-ops/parts.py
"""

import time

import numpy as np
import torch

from specrl.engines.accounting import causal_attended
from specrl.engines.hf.decode import left_pad

ATTENTION = torch.ones(256, 80, dtype=torch.long)
SEQUENCES = [list(range(2, 12 + i % 7)) for i in range(256)]


def tally_before() -> list[int]:
    sums = []
    for _ in range(60):
        fed, reads = ATTENTION[:, -1:].sum(1), ATTENTION.sum(1)
        pairs = causal_attended(fed, reads - fed)
        sums.append(torch.stack([fed.sum(), reads.sum(), pairs.sum()]))
    return torch.stack(sums).sum(0).tolist()


def tally_now() -> list[int]:
    rows = [torch.stack([ATTENTION[:, -1], ATTENTION.sum(1)]) for _ in range(60)]
    fed, reads = torch.cat(rows, 1)
    pairs = causal_attended(fed, reads - fed)
    return torch.stack([fed.sum(), reads.sum(), pairs.sum()]).tolist()


def left_pad_before(sequences, pad=0):
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq)
        attention[row, width - len(seq) :] = 1
    return ids, attention


def timed(call, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats * 1e3


assert tally_before() == tally_now()
pads = left_pad_before(SEQUENCES), left_pad(SEQUENCES, 0, torch.device("cpu"))
assert all(torch.equal(a, b) for a, b in zip(*pads, strict=True))
for _ in range(2):
    print(
        f"tally of a call: {timed(tally_before, 20):.2f} ms before, {timed(tally_now, 20):.2f} now"
    )
    before = timed(lambda: left_pad_before(SEQUENCES), 50)
    now = timed(lambda: left_pad(SEQUENCES, 0, torch.device("cpu")), 50)
    print(f"left_pad of 256 sequences: {before:.2f} ms before, {now:.2f} now")
print("numpy", np.__version__, "torch", torch.__version__)
