"""Plain decoding at static shapes (`rollout.static_decode`): the KV cache allocated once, batch
sizes in buckets, and on CUDA each bucket's decode forward captured once as a CUDA graph and
replayed.

The eager decode loop (decode.py) narrows its KV cache as rows finish and drops the columns no
row attends to, so its forwards change shape as they go; on a GPU a small model's decode forward
is then bound by the host launching its kernels one by one. Here a decode call's KV lives in an
`Arena`: buffers [rows, kv heads, columns, head dim] per layer, `rows` the largest batch so far
rounded up to a power of two and `columns` the most any call has needed (widest context plus
largest token budget) rounded up to `COLUMN_BUCKET`: one arena, replaced by a larger one when a
call needs more. A forward feeds the live rows padded to the next power of two (idle rows feed
the pad token at position 0 and attend to column 0; their outputs are dropped), writes its new KV
column in place (every row writes the same column: contexts are left-padded) and attends through
a 4-D mask over all the arena's columns. Columns not written in this call are masked; the buffers
start zeroed and hold only KV computed since, so what a masked column holds is finite and weighs
exactly 0. Finished rows leave as in the eager cache (the last live rows move into their places).
On CUDA the forward of each bucket is captured after two warm-up runs on a side stream (the
runs write the same KV the step writes) and replayed for every later forward of that bucket, in
this call and in later calls. Drafts (token trees, stored drafts verified in decoding) change a
forward's width every step: those calls keep the eager loop.

The tokens are the eager loop's: the same uniforms and logits over the same attended columns,
the masked ones adding exact zeros (float sums over a wider row may round differently in the last
bits). tests/engines/test_static_decode.py compares the two paths on the CPU, and the graph path
with the eager loop on a GPU (marker gpu). On an H200 a plain decode forward of the 25M toy
policy took 1.4-1.9 ms as a graph, 8.3-8.7 ms eager (benchmarks/gpu-h200-hf-static-decode).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specrl.engines.accounting import ForwardCounts
from specrl.engines.hf.kv_cache import DecodeCache, layers_kv
from specrl.models import planless_attention

COLUMN_BUCKET = 64


def bucket(rows: int) -> int:
    """The power of two at or above `rows`."""
    return 1 << max(rows - 1, 0).bit_length()


class Arena:
    """The KV buffers, static inputs and captured graphs of one decode shape."""

    def __init__(self, like: list[torch.Tensor], rows: int, columns: int) -> None:
        first = like[0]
        self.rows, self.columns, self.device = rows, columns, first.device
        self.kv = [t.new_zeros(rows, t.shape[1], columns, t.shape[3]) for t in like]
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.bias = first.new_zeros(rows, 1, 1, columns)
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)  # the fed column
        self.cache = StaticKV(self)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def fits(self, like: list[torch.Tensor], rows: int, columns: int) -> bool:
        """Whether it holds KV like `like` for `rows` rows and `columns` columns (or more)."""
        return (
            len(like) == len(self.kv)
            and all(a.shape[1::2] == t.shape[1::2] for a, t in zip(self.kv, like, strict=True))
            and rows <= self.rows
            and columns <= self.columns
            and like[0].dtype == self.kv[0].dtype
            and like[0].device == self.device
        )

    def logits(self, model: PreTrainedModel, rows: int) -> torch.Tensor:
        """The forward of the first `rows` rows of the static inputs: logits [rows, 1, V] (on
        CUDA a graph's output, valid until its next replay)."""
        if self.pool is None:
            return self._run(model, rows)
        if rows not in self.graphs:
            self.graphs[rows] = self._capture(model, rows)
        graph, logits = self.graphs[rows]
        graph.replay()
        return logits

    def _run(self, model: PreTrainedModel, rows: int) -> torch.Tensor:
        with planless_attention():
            return model(
                input_ids=self.ids[:rows],
                attention_mask=self.bias[:rows],
                position_ids=self.positions[:rows],
                past_key_values=self.cache,
                use_cache=True,
            ).logits

    def _capture(
        self, model: PreTrainedModel, rows: int
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: kernels chosen, workspaces allocated
                self._run(model, rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._run(model, rows)
        return graph, logits


class StaticKV(DecodeCache):
    """The decode loop's cache over an arena: rows leave by moving, columns never move."""

    def __init__(self, arena: Arena) -> None:
        DynamicCache.__init__(self)
        self.arena = arena
        self.layers = [
            _ArenaLayer(arena, arena.kv[j], arena.kv[j + 1]) for j in range(0, len(arena.kv), 2)
        ]

    def keep_rows(self, keep: torch.Tensor) -> None:
        moved = (keep != torch.arange(len(keep), device=keep.device)).nonzero().squeeze(1)
        source = keep[moved]
        for buffer in self.arena.kv:
            buffer.index_copy_(0, moved, buffer.index_select(0, source))

    def drop_padding(self, attention: torch.Tensor) -> torch.Tensor:
        return attention  # the columns stay: the forwards keep their shape

    def compact(self, attention: torch.Tensor) -> torch.Tensor:
        raise TypeError("static decoding feeds no drafts: nothing to compact")


class _ArenaLayer(DynamicLayer):
    """One layer of an arena: an update writes the fed column of the fed rows in place and
    attends over all their columns."""

    def __init__(self, arena: Arena, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.arena = arena
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = key_states.shape[0]
        keys, values = self.keys[:rows], self.values[:rows]
        keys.index_copy_(2, self.arena.column, key_states)
        values.index_copy_(2, self.arena.column, value_states)
        return keys, values


class StaticDecode:
    """The engine's static-shape decode forwards: `adopt` moves a prefilled cache into an arena,
    calling it runs a decode forward there (the eager `forward`'s signature and counting)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, counts: ForwardCounts) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.counts = counts
        self.arena: Arena | None = None  # one, grown to the largest call: memory stays bounded

    def adopt(self, cache: DecodeCache, attention: torch.Tensor, max_new_tokens: int) -> StaticKV:
        """The arena cache holding `cache`'s KV (attention [B, W]), with room for
        `max_new_tokens` more columns."""
        kv = layers_kv(cache)
        rows, width = attention.shape
        columns = -(-(width + max_new_tokens) // COLUMN_BUCKET) * COLUMN_BUCKET
        arena = self.arena
        if arena is None or not arena.fits(kv, bucket(rows), columns):
            size = (bucket(rows), columns)
            if arena is not None and arena.fits(kv, 0, 0):  # the same model: grow it
                size = (max(size[0], arena.rows), max(columns, arena.columns))
            arena = self.arena = Arena(kv, *size)
        for buffer, t in zip(arena.kv, kv, strict=True):
            buffer[:rows, :, :width] = t
        return arena.cache

    def __call__(
        self,
        kind: str,
        ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticKV,
        keep: int = 0,
    ) -> torch.Tensor:
        """Logits [B, 1, V] of one decode forward of the B live rows (ids, positions [B, 1];
        attention [B, W], its last column the fed one), counted under `kind`."""
        started = time.perf_counter()
        arena = cache.arena
        live, width = attention.shape
        rows = bucket(live)
        arena.ids[:live] = ids
        arena.ids[live:rows] = self.pad_token_id
        arena.positions[:live] = positions
        arena.positions[live:rows] = 0
        bias = arena.bias[:rows, 0, 0]  # [rows, columns]
        bias.fill_(torch.finfo(bias.dtype).min)
        bias[:live, :width].masked_fill_(attention.bool(), 0.0)
        bias[live:, 0] = 0.0  # idle rows attend to one column: no row is all masked
        arena.column.fill_(width - 1)
        logits = arena.logits(self.model, rows)[:live]
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.counts.add_seconds(kind, time.perf_counter() - started)
        return logits
