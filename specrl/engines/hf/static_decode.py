"""Decoding at static shapes (`rollout.static_decode`): the KV cache allocated once, batch sizes
and fed widths in buckets, and on CUDA each bucket's decode forward captured once as a CUDA graph
and replayed.

The eager decode loop (decode.py) narrows its KV cache as rows finish and drops the columns no row
attends to, so its forwards change shape as they go; on a GPU a small model's decode forward is
then bound by the host launching its kernels one by one. Here a decode call's KV lives in an
`Arena`: buffers [rows, kv heads, columns, head dim] per layer (views of one store for the layers
of one shape), `rows` the largest batch so far rounded up to a power of two and `columns` the most
any call has needed rounded up to a power of two (at least `COLUMN_BUCKET`): one arena, replaced by
a larger one when a call needs more (on CUDA its graphs are then all captured again, so the sizes
grow in powers). A forward feeds the live rows padded to the next power of two, on CUDA at least
`GRAPH_ROWS` (idle rows feed the pad token at position 0 and attend to column 0; their outputs are
dropped), each row its token and, with a drafter, its K draft tokens, the fed width padded to a
width bucket (the padding columns attend as the last real one does; their outputs are dropped). It
writes its new KV columns in place (every row writes the same columns: contexts are left-padded,
and a rejected draft's column stays, masked out) and attends through a 4-D mask over the arena's
first columns up to the last it writes, in a power of two (at least `COLUMN_BUCKET`), causal among
the fed ones: a forward early in a call reads as little KV as the eager loop's, where attending
all the arena's made every forward pay for its largest call. Columns not written in this call are
masked; the buffers start zeroed and hold only KV computed since, so what a masked column holds
is finite and weighs exactly 0. Finished rows leave as in the eager cache (the last live rows
move into their places); when rejected drafts have left the columns sparse, every row's attended
columns move to the right end (`StaticKV.compact`), as in the eager cache, within the same
buffers. A call with drafts gets room for that: twice its widest context and budget, plus a spare
fed width (the decode loop compacts before the columns are twice what its longest row attends
to).

On CUDA the forward of each (batch bucket, width bucket, column bucket) is captured after two
warm-up runs on a side stream (the runs write the same KV the step writes), on that stream, with
Python's cyclic collector paused (it may free a dead arena's graphs, which CUDA forbids during a
capture) and without `torch.cuda.graph`'s device synchronize and emptied allocator cache, writing
its logits into the arena's one output buffer, and replayed for every later forward of that
shape. The engine captures them all as it is built (`capture_all`, for the run's largest call, as
vLLM captures its batch sizes as it starts): a step captures a graph only when a call outgrows
that arena.

The tokens are the eager loop's: the same uniforms and logits over the same attended columns,
the masked ones adding exact zeros (float sums over a wider row may round differently in the last
bits). tests/engines/test_static_decode.py compares the two paths on the CPU, with and without
drafts, and the graph path with the eager loop on a GPU (marker gpu). On an H200 a plain decode
forward of the 25M toy policy took 1.4-1.9 ms as a graph, 8.3-8.7 ms eager
(benchmarks/gpu-h200-hf-static-decode).
"""

from __future__ import annotations

import gc
import time

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specrl.engines.accounting import ForwardCounts
from specrl.engines.hf.kv_cache import DecodeCache, attended_columns, layers_kv
from specrl.models import planless_attention

COLUMN_BUCKET = 64
# A graph's forward feeds at least this many rows: on a GPU a decode forward of a few rows takes
# the time of its kernel launches and weight reads, whatever its rows (the 25M policy's graph
# forwards averaged 1.5 ms from 256 rows down to one on an H200), and the shapes below 16 rows
# were a third of a trie run's captures (benchmarks/cpu-graph-captures-min-rows)
GRAPH_ROWS = 16


def bucket(rows: int) -> int:
    """The power of two at or above `rows`."""
    return 1 << max(rows - 1, 0).bit_length()


def arena_columns(needed: int, width: int) -> int:
    """The columns of an arena for calls whose contexts and new tokens are `needed` columns, fed
    `width` at a time: with drafts (width > 1), twice that and a spare fed width, as rejected
    drafts' columns stay until the loop compacts them; in a power of two."""
    if width > 1:
        needed = 2 * needed + 32 + width
    return max(bucket(needed), COLUMN_BUCKET)


def graph_pool(device: torch.device):
    """The memory pool an arena's CUDA graphs share; None where forwards are not captured."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


class Arena:
    """The KV buffers, static inputs and captured graphs of one decode shape: up to `rows` rows,
    `columns` KV columns, `width` fed columns per row."""

    def __init__(self, like: list[torch.Tensor], rows: int, columns: int, width: int) -> None:
        first = like[0]
        self.pool = graph_pool(first.device)
        if self.pool is not None:
            rows = max(rows, GRAPH_ROWS)
        self.rows, self.columns, self.width, self.device = rows, columns, width, first.device
        # the layers' keys and values of one shape share a store [n, rows, heads, columns, dim],
        # so that moving rows or columns is a few ops for every layer, not a few per layer (on a
        # GPU each op is a launch from the host); `kv`: each layer's K and V, views of them
        shapes: dict[tuple, list[int]] = {}
        for i, t in enumerate(like):
            shapes.setdefault((t.shape[1], t.shape[3], t.dtype), []).append(i)
        self.stores: list[torch.Tensor] = []
        views: dict[int, torch.Tensor] = {}
        for (heads, dim, _), members in shapes.items():
            store = like[members[0]].new_zeros(len(members), rows, heads, columns, dim)
            self.stores.append(store)
            views |= {i: store[k] for k, i in enumerate(members)}
        self.kv = [views[i] for i in range(len(like))]
        self.ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        self.bias = first.new_zeros(rows, 1, width, columns)
        self.fed = torch.zeros(width, dtype=torch.long, device=self.device)  # the fed columns
        self.steps = torch.arange(max(width, columns), device=self.device)  # 0, 1, 2, ...
        self.span = columns  # the columns the last forward attended (`_ArenaLayer` slices them)
        self.cache = StaticKV(self)
        # (rows, fed width, attended columns) → the captured graph and its logits, views of
        # `out`: every graph writes its logits there, so a graph holds no memory once captured
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.out: torch.Tensor | None = None  # [rows, width, V], made by the first capture

    def fits(self, like: list[torch.Tensor], rows: int, columns: int, width: int) -> bool:
        """Whether it holds KV like `like` for `rows` rows, `columns` columns and `width` fed
        columns (or more)."""
        return (
            len(like) == len(self.kv)
            and all(a.shape[1::2] == t.shape[1::2] for a, t in zip(self.kv, like, strict=True))
            and rows <= self.rows
            and columns <= self.columns
            and width <= self.width
            and like[0].dtype == self.kv[0].dtype
            and like[0].device == self.device
        )

    def rows_bucket(self, rows: int) -> int:
        """The rows a forward of `rows` live rows runs at: the power of two at or above it, as a
        graph at least `GRAPH_ROWS`."""
        return bucket(rows) if self.pool is None else max(bucket(rows), GRAPH_ROWS)

    def width_bucket(self, width: int) -> int:
        """The fed width a forward of `width` columns runs at: the power of two at or above it,
        at most the arena's width."""
        return min(bucket(width), self.width)

    def columns_bucket(self, columns: int) -> int:
        """The columns a forward that writes up to column `columns` attends: the power of two at
        or above it, at least `COLUMN_BUCKET`, at most the arena's."""
        return min(max(bucket(columns), COLUMN_BUCKET), self.columns)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, fed width, attended columns) bucket a forward in this arena can take."""
        rows = [1 << b for b in range(self.rows_bucket(1).bit_length() - 1, self.rows.bit_length())]
        widths = sorted({self.width_bucket(w) for w in range(1, self.width + 1)})
        columns = sorted(
            {self.columns_bucket(c) for c in (1 << b for b in range(self.columns.bit_length()))}
        )
        return [(r, w, c) for r in rows for w in widths for c in columns]

    def uncaptured(self, shape: tuple[int, int, int]) -> bool:
        """Whether a forward of this shape needs its graph captured first (CUDA only)."""
        return self.pool is not None and shape not in self.graphs

    def logits(self, model: PreTrainedModel, shape: tuple[int, int, int]) -> torch.Tensor:
        """The forward of the first rows and fed columns of the static inputs, attending their
        first columns, as `shape` counts them: logits [rows, width, V] (on CUDA its captured
        graph's output, valid until the next replay)."""
        if self.pool is None:
            return self._run(model, shape)
        self.span = shape[2]
        graph, logits = self.graphs[shape]
        graph.replay()
        return logits

    def _run(self, model: PreTrainedModel, shape: tuple[int, int, int]) -> torch.Tensor:
        rows, width, self.span = shape
        with planless_attention():
            return model(
                input_ids=self.ids[:rows, :width],
                attention_mask=self.bias[:rows, :, :width, : self.span],
                position_ids=self.positions[:rows, :width],
                past_key_values=self.cache,
                use_cache=True,
            ).logits

    def output(self, shape: tuple[int, int, int], like: torch.Tensor) -> torch.Tensor:
        """Where the graph of `shape` writes its logits (`like`: a run's): a view of `out`."""
        if self.out is None:
            self.out = like.new_empty(self.rows, self.width, like.shape[-1])
        return self.out[: shape[0], : shape[1]]

    def capture(self, model: PreTrainedModel, shape: tuple[int, int, int]) -> None:
        """Capture the graph of the forward of `shape` (rows, fed width, attended columns)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        # A graph freed during a capture invalidates it (CUDA forbids the destroy): the cyclic
        # collector, run by the forward's allocations, would free the graphs of dead arenas
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: kernels chosen, workspaces allocated
                    out = self.output(shape, self._run(model, shape))
                # not `torch.cuda.graph`, which first synchronizes the device and empties the
                # allocator's cache: its entry took 30 of a capture's 43 ms on an H200 (the wait
                # for the warm-ups included), and the allocations after it were cudaMallocs
                # again (benchmarks/gpu-h200-hf-captures-680f630)
                graph.capture_begin(pool=self.pool)
                try:
                    # into `out`: the forward's own memory goes back to the pool for the next
                    # capture (a graph's replay needs it only while it runs)
                    out.copy_(self._run(model, shape))
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graphs[shape] = graph, out


class StaticKV(DecodeCache):
    """The decode loop's cache over an arena: rows leave by moving, columns move only when
    compacted."""

    def __init__(self, arena: Arena) -> None:
        DynamicCache.__init__(self)
        self.arena = arena
        self.layers = [
            _ArenaLayer(arena, arena.kv[j], arena.kv[j + 1]) for j in range(0, len(arena.kv), 2)
        ]

    def keep_rows(self, keep: torch.Tensor, moved: torch.Tensor | None = None) -> None:
        if moved is None:
            moved = (keep != torch.arange(len(keep), device=keep.device)).nonzero().squeeze(1)
        source = keep[moved]
        for store in self.arena.stores:
            store.index_copy_(1, moved, store.index_select(1, source))

    def drop_padding(self, attention: torch.Tensor) -> torch.Tensor:
        return attention  # the columns stay: the forwards keep their shape

    def holds(self, context: int, fed: int) -> bool:
        arena = self.arena
        return context + arena.width_bucket(fed) <= arena.columns

    def compact(self, attention: torch.Tensor) -> torch.Tensor:
        """Every live row's attended columns (`attention` [B, W]) move to the right end of the
        first W' columns in order, W' the most a row attends to: → the new mask [B, W']."""
        columns = attended_columns(attention)
        for store in self.arena.stores:
            live = store[:, : len(attention)]  # [n, B, heads, columns, dim]
            index = columns[None, :, None, :, None].expand(
                live.shape[0], -1, live.shape[2], -1, live.shape[4]
            )
            live[:, :, :, : columns.shape[1]] = live.gather(3, index)
        return attention.gather(1, columns)


class _ArenaLayer(DynamicLayer):
    """One layer of an arena: an update writes the fed columns of the fed rows in place and
    attends over all their columns."""

    def __init__(self, arena: Arena, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.arena = arena
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, fed = key_states.shape[0], self.arena.fed[: key_states.shape[2]]
        span = self.arena.span
        keys, values = self.keys[:rows, :, :span], self.values[:rows, :, :span]
        keys.index_copy_(2, fed, key_states)
        values.index_copy_(2, fed, value_states)
        return keys, values


class StaticDecode:
    """The engine's static-shape decode forwards: `adopt` moves a prefilled cache into an arena,
    calling it runs a decode forward there (the eager `forward`'s signature and counting)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, counts: ForwardCounts) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.counts = counts
        self.arena: Arena | None = None  # one, grown to the largest call: memory stays bounded

    @staticmethod
    def columns(cache: StaticKV, written: int) -> int:
        """The columns a forward that writes up to column `written` of `cache` attends."""
        return cache.arena.columns_bucket(written)

    @torch.inference_mode()
    def capture_all(
        self, rows: int, context: int, max_new_tokens: int, width: int
    ) -> tuple[int, float]:
        """Where forwards are graphs (CUDA), before the first call: the arena of calls of up to
        `rows` rows, `context` context tokens and `max_new_tokens` new ones, fed up to `width`
        columns at a time, and the graph of every batch, width and column bucket its forwards
        can take (`Arena.shapes`), captured now, as vLLM captures its batch sizes as it starts.
        A run's steps then capture none unless a call outgrows these sizes (captured as met,
        12-14 in the first reuse step of a trie arm on an H200, 0.3-0.7 s:
        benchmarks/gpu-h200-hf-captures-315af38). → graphs captured and their seconds; (0, 0.0)
        where forwards are not captured."""
        device = next(self.model.parameters()).device
        if graph_pool(device) is None:
            return 0, 0.0
        started = time.perf_counter()
        cache = DynamicCache()  # a one-token forward: the layers' KV shapes and dtype
        self.model(
            input_ids=torch.full((1, 1), self.pad_token_id, device=device),
            past_key_values=cache,
            use_cache=True,
        )
        columns = arena_columns(context + max_new_tokens, width)
        arena = self.arena = Arena(layers_kv(cache), bucket(rows), columns, width)
        # the captures' own runs: every fed column its own, every column attended (finite KV
        # where a later call's mask weighs it 0)
        torch.add(arena.steps[: arena.width], 0, out=arena.fed)
        for shape in arena.shapes():
            arena.capture(self.model, shape)
        return len(arena.graphs), time.perf_counter() - started

    def adopt(
        self, cache: DecodeCache, attention: torch.Tensor, max_new_tokens: int, width: int = 1
    ) -> StaticKV:
        """The arena cache holding `cache`'s KV (attention [B, W]), with room for
        `max_new_tokens` more tokens fed `width` columns at a time (1: plain decoding)."""
        kv = layers_kv(cache)
        rows, context = attention.shape
        columns = arena_columns(context + max_new_tokens, width)  # a new arena: graphs again
        arena = self.arena
        if arena is None or not arena.fits(kv, bucket(rows), columns, width):
            size = (bucket(rows), columns, width)
            if arena is not None and arena.fits(kv, 0, 0, 0):  # the same model: grow it
                size = (
                    max(size[0], arena.rows),
                    max(columns, arena.columns),
                    max(width, arena.width),
                )
            arena = self.arena = Arena(kv, *size)
        for buffer, t in zip(arena.kv, kv, strict=True):
            buffer[:rows, :, :context] = t
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
        """Logits [B, K+1, V] of one decode forward of the B live rows (ids, positions [B, K+1]:
        each row's token and its K drafts; attention [B, W], its last K+1 columns the fed
        ones), counted under `kind`."""
        started = time.perf_counter()
        arena = cache.arena
        live, fed = ids.shape
        context = attention.shape[1] - fed  # the first fed column
        rows, width = arena.rows_bucket(live), arena.width_bucket(fed)
        shape = rows, width, arena.columns_bucket(context + width)
        padded, idle = fed < width, live < rows  # (an op on an empty slice is still a launch)
        arena.ids[:live, :fed] = ids
        arena.positions[:live, :fed] = positions
        if padded:
            arena.ids[:live, fed:width] = self.pad_token_id
            arena.positions[:live, fed:width] = positions[:, -1:]
        if idle:
            arena.ids[live:rows, :width] = self.pad_token_id
            arena.positions[live:rows, :width] = 0
        bias = arena.bias[:rows, 0, :width, : shape[2]]  # [rows, width, attended columns]
        bias.fill_(torch.finfo(bias.dtype).min)
        steps = arena.steps
        causal = steps[None, : attention.shape[1]] <= context + steps[:fed, None]
        allowed = attention.bool()[:, None, :] & causal[None]  # [B, K+1, W]
        bias[:live, :fed, : attention.shape[1]].masked_fill_(allowed, 0.0)
        if padded:  # padding attends as the last fed column
            bias[:live, fed:width] = bias[:live, fed - 1 : fed]
        if idle:  # idle rows attend to one column: no row is all masked
            bias[live:, :, 0] = 0.0
        torch.add(steps[: arena.width], context, out=arena.fed)
        if arena.uncaptured(shape):
            capture_started = time.perf_counter()
            arena.capture(self.model, shape)
            self.counts.add_capture(time.perf_counter() - capture_started)
        logits = arena.logits(self.model, shape)[:live, :fed]
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.counts.add_seconds(kind, time.perf_counter() - started)
        return logits
