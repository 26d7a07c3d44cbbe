"""The decode loop's KV cache: a transformers `DynamicCache` whose layers grow in place, lose
finished rows and unused columns without copying the whole cache.

It subclasses `DynamicCache` / `DynamicLayer` and sets their `keys` / `values` and
`layer_class_to_replicate`: more than transformers' public Cache API. tests/engines/test_kv_cache.py
pins what it relies on, so a transformers upgrade that changes it fails there, loudly.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class DecodeCache(DynamicCache):
    """The KV cache of a decode loop: a DynamicCache whose layers grow in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_class_to_replicate = _GrowingLayer

    def keep_rows(self, keep: torch.Tensor, moved: torch.Tensor | None = None) -> None:
        """Row i becomes row `keep[i]` [B']: row i itself, a row past B' moved into its place
        (`_staying`), or a copy of another row (a context whose sequences part ways). `moved`:
        the rows that are not themselves, where the caller knows them."""
        if moved is None:
            moved = (keep != torch.arange(len(keep), device=keep.device)).nonzero().squeeze(1)
        for layer in self.layers:
            layer.keep_rows(keep, moved)

    def drop_padding(self, attention: torch.Tensor) -> torch.Tensor:
        """Drop the leading KV columns no row attends to (attention [B, W]), as when the rows
        with the longest contexts have left: → the attention mask of the columns kept."""
        padding = int(attention.argmax(1).min()) if attention.numel() else 0
        if padding:
            self.drop_front(padding)
        return attention[:, padding:]

    def holds(self, context: int, fed: int) -> bool:
        """Whether a forward can feed `fed` columns after `context` columns without compacting
        first (this cache grows)."""
        return True

    def drop_front(self, columns: int) -> None:
        """Drop the first `columns` KV columns, which no row attends to."""
        for layer in self.layers:
            layer.drop_front(columns)

    def compact(self, attention: torch.Tensor) -> torch.Tensor:
        """Drop KV columns no row attends to (rejected drafts; `attention` [B, W]): every row's
        attended columns move to the right end in order, the cache narrows to the longest row.
        → the new attention mask [B, W']."""
        columns = attended_columns(attention)
        for layer in self.layers:
            layer.keep_columns(columns)
        return attention.gather(1, columns)


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with columns to spare: a decode
    step writes its columns in place, where DynamicLayer concatenates and so copies the whole
    cache every step. Rows leave by moving the last rows into their place (`keep_rows`), leading
    columns by moving the view's start (`drop_front`); keys and values narrowed by `keep_columns`
    move into a new buffer at the next update. The buffers keep every row they were made with
    (`bases`), so a row copied for a sequence that parts from its context's others is written
    in place too."""

    spare_columns = 32
    bases: tuple[torch.Tensor, torch.Tensor] | None = None  # every row the buffers were made with
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # the bases' rows in use
    views: tuple[torch.Tensor, torch.Tensor] | None = None  # what keys and values were set to
    start = 0  # buffer column of the first key
    capacity = 0  # rows of the bases, or of the next ones

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> _GrowingLayer:
        """A layer over buffers [B, H, T, D] whose first `length` columns hold the KV."""
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer.bases = layer.buffers = (keys, values)
        layer.capacity = len(keys)
        layer._view(length)
        return layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        if not self._viewed(self.start + length + key_states.shape[-2]):
            rows = key_states.shape[0]
            self.capacity = max(rows, self.capacity)
            self.bases = (
                _grown(self.keys, key_states, self.spare_columns, self.capacity),
                _grown(self.values, value_states, self.spare_columns, self.capacity),
            )
            self.buffers = tuple(b[:rows] for b in self.bases)
            self.start = 0
        begin = self.start + length
        end = begin + key_states.shape[-2]
        keys, values = self.buffers
        keys[:, :, begin:end] = key_states
        values[:, :, begin:end] = value_states
        self._view(end)
        return self.keys, self.values

    def keep_rows(self, keep: torch.Tensor, moved: torch.Tensor) -> None:
        """Row i becomes row keep[i] [B'], which differs from i only at the rows `moved`: their KV
        is copied into the bases' first B' rows, which then are the buffers."""
        end = self.start + self.get_seq_length()
        if not self._viewed(end) or len(keep) > self.capacity:
            self.keys, self.values = self.keys[keep], self.values[keep]
            self.capacity = max(len(keep), self.capacity)
            self.bases = self.buffers = self.views = None  # new buffers at the next update
            return
        source = keep[moved]
        for base in self.bases:
            used = base[:, :, self.start : end]
            used.index_copy_(0, moved, used.index_select(0, source))
        self.buffers = tuple(b[: len(keep)] for b in self.bases)
        self._view(end)

    def drop_front(self, columns: int) -> None:
        """Drop the first `columns` KV columns (of every row)."""
        end = self.start + self.get_seq_length()
        viewed = self._viewed(end)
        self.keys, self.values = self.keys[:, :, columns:], self.values[:, :, columns:]
        if viewed:
            self.start += columns
            self._view(end)

    def keep_columns(self, columns: torch.Tensor) -> None:
        """Keep, of row b, KV columns `columns[b]` in order (columns [B, W'])."""
        index = columns[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
        self.keys, self.values = self.keys.gather(2, index), self.values.gather(2, index)
        self.bases = self.buffers = self.views = None  # the old buffers are not needed any more

    def _view(self, end: int) -> None:
        """Keys and values: the buffers' columns from `start` to `end`."""
        self.keys, self.values = (b[:, :, self.start : end] for b in self.buffers)
        self.views = (self.keys, self.values)

    def _viewed(self, end: int) -> bool:
        """Whether keys and values are still the views `_view` set, with room up to `end`."""
        return (
            self.views is not None
            and self.keys is self.views[0]
            and self.values is self.views[1]
            and end <= self.buffers[0].shape[2]
        )


def attended_columns(attention: torch.Tensor) -> torch.Tensor:
    """Of each row (`attention` [B, W]), the columns it attends to, in order, left-padded with
    columns it does not to the most any row attends to: [B, W']."""
    width = int(attention.sum(1).max())
    return attention.sort(dim=1, stable=True).indices[:, attention.shape[1] - width :]


def _grown(cached: torch.Tensor, new: torch.Tensor, spare: int, rows: int) -> torch.Tensor:
    """A buffer [rows, H, T + T' + spare, D] holding `cached` [B, H, T, D] in its first B rows
    and T columns, with room for `new` [B, H, T', D] and `spare` columns after it."""
    batch, heads, length, dim = new.shape
    start = cached.shape[2] if cached.dim() == 4 else 0
    buffer = new.new_empty(rows, heads, start + length + spare, dim)
    if start:
        buffer[:batch, :, :start] = cached
    return buffer


def layers_kv(cache: DynamicCache) -> list[torch.Tensor]:
    """[K_0, V_0, K_1, V_1, ...], each [B, heads, T, head_dim]."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def merge(
    parts: list[tuple[list[int], list[torch.Tensor], torch.Tensor]], room: int
) -> tuple[DecodeCache, torch.Tensor]:
    """One left-padded cache from row groups of different widths, rows in their original order:
    each group's KV is written once, straight into the decode cache's buffers, which have `room`
    columns to spare (at least `spare_columns`): what the decoding writes, so that it never
    grows them."""
    width = max(mask.shape[1] for _, _, mask in parts)
    batch = sum(len(rows) for rows, _, _ in parts)
    ref = next(kv for _, kv, _ in parts if kv)
    masks = ref[0].new_zeros(batch, width, dtype=torch.long)
    buffers = [
        t.new_empty(batch, t.shape[1], width + max(room, _GrowingLayer.spare_columns), t.shape[3])
        for t in ref
    ]
    for rows, kv, mask in parts:
        index = torch.tensor(rows, device=masks.device)
        start = width - mask.shape[1]
        masks[index, start:] = mask
        for j, buffer in enumerate(buffers):
            # padding is masked, but a masked NaN would still poison: zeros (the spare columns
            # are written before they are read)
            buffer[index, :, :start] = 0
            if kv:  # none: rows with nothing to prefill
                buffer[index, :, start:width] = kv[j]
    cache = DecodeCache()
    for layer in range(len(buffers) // 2):
        cache.layers.append(_GrowingLayer.of(buffers[2 * layer], buffers[2 * layer + 1], width))
    return cache, masks
