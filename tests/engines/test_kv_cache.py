"""The decode loop's KV cache against transformers' DynamicCache, and the transformers internals
it relies on beyond the public Cache API (kv_cache.py): an upgrade that changes them fails here."""

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specrl.engines.hf.batch import _staying
from specrl.engines.hf.kv_cache import DecodeCache


def test_the_transformers_internals_the_cache_relies_on_are_there():
    cache = DynamicCache()
    assert hasattr(cache, "layer_class_to_replicate") and isinstance(cache.layers, list)
    layer = DynamicLayer()
    for name in ("lazy_initialization", "get_seq_length", "update"):
        assert callable(getattr(layer, name)), name
    assert list(inspect.signature(layer.lazy_initialization).parameters)[:2] == [
        "key_states",
        "value_states",
    ]
    assert layer.is_initialized is False
    keys = torch.randn(2, 2, 3, 4)
    layer.update(keys, -keys)
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, -keys)
    assert layer.get_seq_length() == 3


def test_decode_cache_grows_in_place_and_matches_dynamic_cache():
    torch.manual_seed(0)
    ours, reference = DecodeCache(), DynamicCache()

    def update(batch, columns):
        keys = torch.randn(batch, 2, columns, 8)
        for cache in (ours, reference):
            got = cache.update(keys, -keys, 0)
        assert torch.equal(got[0], ours.layers[0].keys) and torch.equal(got[1], -got[0])
        assert torch.equal(ours.layers[0].keys, reference.layers[0].keys)

    update(5, 4)  # prefill
    buffer = ours.layers[0].buffers[0].data_ptr()
    for _ in range(5):
        update(5, 1)
    assert ours.layers[0].buffers[0].data_ptr() == buffer  # decode steps wrote in place
    keep, moved = _staying([True, False, False, True, False])
    assert keep == [4, 1, 2] and moved == [0]  # rows 1, 2 stay in place, row 4 takes row 0's
    keep = torch.tensor(keep)
    ours.keep_rows(keep)
    reference.batch_select_indices(keep)
    assert torch.equal(ours.layers[0].keys, reference.layers[0].keys)
    assert ours.layers[0].buffers[0].data_ptr() == buffer  # only row 4 moved
    ours.drop_front(2)  # columns no row attends to any more
    for layer in reference.layers:
        layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]
    update(3, 1)
    assert ours.layers[0].buffers[0].data_ptr() == buffer  # still written in place
    spare = ours.layers[0].spare_columns
    for _ in range(spare):  # past the spare columns: into a new, larger buffer
        update(3, 1)
    assert ours.get_seq_length() == reference.get_seq_length() == 8 + spare


def test_rows_copied_for_parting_sequences_are_written_in_place():
    """A row copied for sequences that part from their context's others (`keep` naming a row
    twice) lands in the buffers' spare rows: only the copies move, and the copies grow on."""
    torch.manual_seed(0)
    ours, reference = DecodeCache(), DynamicCache()

    def update(batch, columns):
        keys = torch.randn(batch, 2, columns, 8)
        for cache in (ours, reference):
            cache.update(keys, -keys, 0)
        assert torch.equal(ours.layers[0].keys, reference.layers[0].keys)

    update(4, 3)
    buffer = ours.layers[0].buffers[0].data_ptr()
    ours.keep_rows(torch.tensor([0, 2]))  # two contexts left
    reference.batch_select_indices(torch.tensor([0, 2]))
    update(2, 1)
    keep = torch.tensor([0, 1, 1, 0])  # each parts in two: copies of rows 1 and 0
    ours.keep_rows(keep)
    reference.batch_select_indices(keep)
    assert torch.equal(ours.layers[0].keys, reference.layers[0].keys)
    assert ours.layers[0].buffers[0].data_ptr() == buffer  # within the buffers made for 4 rows
    update(4, 1)
    assert ours.layers[0].buffers[0].data_ptr() == buffer
