"""Decoding at static shapes (static_decode.py) against the eager decode loop, on the CPU: the
same tokens and finish reasons, logprobs equal to float rounding, every forward at a bucketed
batch and fed width over one arena's columns, with and without drafts. On CUDA each bucket's
forward is a CUDA graph, captured once and replayed: the tests marked gpu (`pytest -m gpu`, where
a GPU is) compare that path to the eager loop on the same device."""

import contextlib
import gc
import time

import pytest
import torch

from specrl.config import SpecConfig, TreeConfig
from specrl.engines import GenRequest, SamplingParams
from specrl.engines.hf import HFEngine
from specrl.engines.hf.static_decode import COLUMN_BUCKET, GRAPH_ROWS, Arena, StaticKV, bucket
from specrl.speculative.stage import SpeculativeStage
from specrl.types import Example, Prompt
from tests.conftest import EOS, PAD, make_tiny_model
from tests.engines.graphs import emulate_graphs
from tests.engines.test_drafts import drafting
from tests.engines.test_syncs import Dispatches

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


def engines(init: float, device: str = "cpu") -> tuple[HFEngine, HFEngine]:
    model = make_tiny_model(init=init).to(device)
    return HFEngine(model, [EOS], PAD), HFEngine(model, [EOS], PAD, static_decode=True)


def requests(count: int, sampling: SamplingParams) -> list[GenRequest]:
    """Prompts of 1-9 tokens, budgets of 6-20 tokens: rows start at different widths and leave
    at different forwards (their budgets, or the eos token)."""
    return [
        GenRequest([2 + (i + j) % 10 for j in range(1 + i % 9)], 6 + (3 * i) % 15, sampling, seed=i)
        for i in range(count)
    ]


def assert_same(eager, static) -> None:
    for a, b in zip(eager, static, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_static_decoding_samples_the_eager_loops_tokens(device):
    eager, static = engines(init=0.3, device=device)
    stopped = []
    for sampling in (SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(0.0)):
        got = static.generate(requests(13, sampling))
        assert_same(eager.generate(requests(13, sampling)), got)
        stopped += [len(r.token_ids) for r in got if r.finish_reason == "stop"]
    assert any(n > 1 for n in stopped)  # rows left at the eos token, not only at their budgets
    graphs = static.static.arena.graphs
    assert (len(graphs) > 1) == (device == "cuda")  # a graph per bucket, on CUDA alone


@pytest.mark.parametrize("device", [CUDA])
def test_a_buckets_graph_is_captured_once_and_replayed_in_later_calls(device):
    _, static = engines(init=2.0, device=device)
    static.generate(requests(13, SamplingParams(1.0)))
    arena = static.static.arena
    captured = {shape: graph for shape, (graph, _) in arena.graphs.items()}
    assert {rows for rows, _, _ in captured} <= {1, 2, 4, 8, 16}
    assert (16, 1, COLUMN_BUCKET) in captured
    assert {width for _, width, _ in captured} == {1}  # plain decoding feeds one column
    first = static.generate(requests(13, SamplingParams(1.0)))
    assert static.static.arena is arena
    assert {shape: graph for shape, (graph, _) in arena.graphs.items()} == captured
    assert [r.token_ids for r in first] == [
        r.token_ids for r in static.generate(requests(13, SamplingParams(1.0)))
    ]


def test_every_forward_is_at_a_bucketed_batch_over_one_arena_that_grows_when_needed():
    _, static = engines(init=2.0)
    shapes = []
    hook = static.model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(
            (kwargs["input_ids"].shape, kwargs["attention_mask"].shape)
        ),
        with_kwargs=True,
    )
    try:
        static.generate(requests(13, SamplingParams(1.0)))
    finally:
        hook.remove()
    prefill, *decode = shapes
    assert prefill[0][1] > 1  # the prefill is eager: its own shape
    batches = {ids[0] for ids, _ in decode}
    assert all(ids[1] == 1 for ids, _ in decode)
    assert batches <= {1, 2, 4, 8, 16} and 16 in batches and len(batches) > 1  # rows left
    assert len({mask[-1] for _, mask in decode}) == 1  # the same columns every forward
    assert decode[0][1][-1] == COLUMN_BUCKET  # the columns a power of two, at least the bucket
    arena = static.static.arena
    static.generate(requests(5, SamplingParams(1.0)))
    assert static.static.arena is arena  # a smaller call: the same arena
    static.generate(requests(20, SamplingParams(1.0)))
    assert static.static.arena.rows == 32  # a larger one grows it
    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]


def test_the_arena_grows_in_powers_of_two_so_few_calls_replace_it():
    """On CUDA a new arena captures every graph again (benchmarks/gpu-h200-hf-captures-680f630:
    a trie arm's reuse steps spent most of their decode time capturing): calls that each need a
    few more columns than the last replace the arena once per doubling, not once per bucket."""
    _, static = engines(init=0.3)  # rows mostly stop early: the arena is sized by the budget
    arenas = []
    for budget in range(8, 500, 24):
        static.generate([GenRequest([2, 3, 4], budget, SamplingParams(1.0), seed=budget)])
        arena = static.static.arena
        if not arenas or arenas[-1] is not arena:
            arenas.append(arena)
    columns = [arena.columns for arena in arenas]
    assert columns == [64, 128, 256, 512]  # needs of 11 to 491 columns: 21 calls


def test_rows_and_columns_move_in_every_layer_in_ops_that_do_not_grow_with_the_layers():
    """On a GPU each op is a launch from the host: finished rows leaving an arena (and columns
    compacted) cost the same few ops for 2 layers as for 12, however many layers share a shape
    (a model whose layers differ gets a store per shape), and each layer's keys and values
    move as they would alone."""

    def arena(layers: int, heads: list[int]) -> tuple[Arena, list[torch.Tensor]]:
        like = [torch.zeros(4, heads[j // 2 % len(heads)], 8, 6) for j in range(2 * layers)]
        arena = Arena(like, 4, COLUMN_BUCKET, 1)
        for j, buffer in enumerate(arena.kv):
            buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(j)))
        return arena, [buffer.clone() for buffer in arena.kv]

    def moved(layers: int, heads: list[int]) -> int:
        store, before = arena(layers, heads)
        keep = torch.tensor([0, 3, 2])  # row 1 finished: the last row moves into its place
        attention = torch.zeros(3, COLUMN_BUCKET, dtype=torch.long)
        attention[:, [5, 9, 30]] = 1  # columns rejected drafts left sparse
        with Dispatches(lambda: True) as rows:
            store.cache.keep_rows(keep)
        for buffer, old in zip(store.kv, before, strict=True):
            assert torch.equal(buffer[:3], old[keep])
        with Dispatches(lambda: True) as columns:
            store.cache.compact(attention)
        for buffer, old in zip(store.kv, before, strict=True):
            assert torch.equal(buffer[:3, :, :3], old[keep][:, :, [5, 9, 30]])
        return rows.count, columns.count, len(store.stores)

    assert moved(2, [2]) == moved(12, [2]) and moved(2, [2])[2] == 1
    mixed = moved(12, [2, 3])  # two shapes: two stores, each moved as one
    assert mixed[2] == 2 and mixed[:2] == moved(2, [2, 3])[:2]


def test_a_capture_pauses_the_cyclic_collector_and_leaves_the_allocators_cache(monkeypatch):
    """What the graph path's capture runs under, seen on the CPU: no collection can free a dead
    arena's graphs during it (on an H200 one did, in the bench's cost model check at 680f630:
    `cudaErrorStreamCaptureInvalidated`), and the allocator's cache is not emptied for it (most
    of a capture's time there)."""
    seen = []

    class Graph:
        def capture_begin(self, pool=None):
            seen.append(("begin", gc.isenabled()))

        def capture_end(self):
            seen.append(("end", gc.isenabled()))

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("emptied"))
    monkeypatch.setattr(Arena, "_run", lambda self, model, shape: torch.ones(*shape[:2], 3))
    arena = Arena([torch.zeros(1, 1, 1, 1)] * 2, rows=1, columns=1, width=1)
    assert gc.isenabled()
    arena.capture(None, (1, 1, 1))
    assert seen == [("begin", False), ("end", False)] and gc.isenabled()
    graph, logits = arena.graphs[1, 1, 1]
    assert isinstance(graph, Graph) and logits.shape == (1, 1, 3)
    assert logits.data_ptr() == arena.out.data_ptr()  # into the arena's one output


@pytest.fixture
def emulated_graphs(monkeypatch) -> None:
    """Graphs emulated on the CPU (tests/engines/graphs.py)."""
    emulate_graphs(monkeypatch.setattr)


def test_captures_are_counted_and_timed_apart_from_replays(emulated_graphs):
    """The graph path's bookkeeping with a graph emulated on the CPU: each (rows, fed width)
    shape is captured once per arena, counted under perf/decode/captures with its seconds
    within the decode seconds, and the tokens stay the eager loop's."""
    eager, static = engines(init=0.3)
    batch = requests(40, SamplingParams(1.0))
    assert_same(eager.generate(batch), static.generate(batch))
    counts, shapes = static.counts, set(static.static.arena.graphs)
    assert counts.decode_captures == len(shapes) > 1
    assert 0 < counts.decode_capture_seconds < counts.decode_seconds
    assert_same(eager.generate(batch), static.generate(batch))  # replayed, none captured again
    metrics = static.counts.metrics()
    assert metrics["perf/decode/captures"] == len(shapes)
    assert metrics["timing_s/capture/decode"] == counts.decode_capture_seconds


def test_the_draft_width_controller_fits_decode_forwards_without_their_captures(
    emulated_graphs, monkeypatch
):
    """A capture is paid once per shape; the forwards' fitted costs price every later forward.
    With each capture taking 0.2 s more (on an H200 27-50 ms; fitted in, the first reuse steps'
    captures likely set the draft width near 0 there, as they did with 50 ms ones on the CPU:
    benchmarks/cpu-graph-captures-draft-width), the seconds the controller observes per decode
    iteration leave them out."""
    capture = Arena.capture
    monkeypatch.setattr(Arena, "capture", lambda *args: time.sleep(0.2) or capture(*args))
    _, static = engines(init=2.0)
    batch = requests(12, SamplingParams(1.0))
    source = drafting([[2 + j % 10 for j in range(20)]] * len(batch))
    observed = []
    observe = source.width.observe_forward
    monkeypatch.setattr(
        source.width,
        "observe_forward",
        lambda rows, fed, seconds, span: (
            observed.append(seconds) or observe(rows, fed, seconds, span)
        ),
    )
    static.generate_with_drafts(batch, source)
    assert static.counts.decode_captures > 1 and len(observed) > 1
    assert max(observed) < 0.2 < static.counts.decode_capture_seconds


def test_a_graph_feeds_at_least_graph_rows_rows(emulated_graphs):
    """As CUDA graphs, forwards of fewer live rows run at `GRAPH_ROWS` (on a GPU in the time of
    one row's): a batch of 13 rows leaving at different forwards is one shape, captured once,
    where the eager arena runs it at several power-of-two batches; the tokens are the eager
    loop's."""
    eager, static = engines(init=0.3)
    batch = requests(13, SamplingParams(1.0))
    assert_same(eager.generate(batch), static.generate(batch))
    assert set(static.static.arena.graphs) == {(GRAPH_ROWS, 1, COLUMN_BUCKET)}
    assert static.counts.decode_captures == 1


@pytest.mark.parametrize("device", [CUDA])
def test_graphs_are_captured_while_dead_arenas_wait_for_the_collector(device):
    """Calls that grow the arena leave its old graphs in a reference cycle; with the collector
    run at every allocation, the next captures still succeed and sample the eager loop's tokens."""
    eager, static = engines(init=0.3, device=device)
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for budget in (8, 80, 200):
            batch = [
                GenRequest(r.prompt_ids, budget, r.sampling, seed=r.seed)
                for r in requests(13, SamplingParams(1.0))
            ]
            assert_same(eager.generate(batch), static.generate(batch))
    finally:
        gc.set_threshold(*thresholds)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_static_decoding_with_drafts_samples_the_eager_loops_tokens(device, monkeypatch):
    """Drafts fed in the arena at bucketed widths: own outputs (accepted) for some rows, random
    tokens (mostly rejected, their columns masked, then compacted away) for the rest."""
    eager, static = engines(init=0.3, device=device)
    calls, compact = [], StaticKV.compact
    monkeypatch.setattr(StaticKV, "compact", lambda *a: calls.append(1) or compact(*a))
    widths, run = [], Arena._run
    monkeypatch.setattr(Arena, "_run", lambda *a: widths.append(a[2][1]) or run(*a))
    sampling = SamplingParams(1.0)
    long = [GenRequest(r.prompt_ids, 60, sampling, seed=r.seed) for r in requests(13, sampling)]
    for batch in (requests(13, sampling), long):
        plain = eager.generate(batch)
        references = [r.token_ids for r in plain[:6]] + [[]] * (len(batch) - 6)
        drafted = static.generate_with_drafts(batch, drafting(references, k=8))
        assert_same(plain, drafted)
        assert all(r.accepted_tokens == r.draft_tokens > 0 for r in drafted[:6])
        assert sum(r.draft_tokens - r.accepted_tokens for r in drafted) > 0
    assert calls  # rejected drafts' columns compacted within the arena
    assert set(widths) <= {1, 2, 4, 8, 9} and 9 in widths  # K + 1 in width buckets
    assert static.static.arena.width == 9


@pytest.mark.parametrize("drafts", [False, True])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_speculative_step_over_static_decoding_is_the_eager_steps(device, drafts):
    """History tries walked, the rest decoded from the walks' prefixes (KV handed over from the
    trie pass, first draws excluding the children left), plainly or with tree drafts: the same
    rollouts either way, the static engine's tails decoded in its arena."""
    prompts = [Prompt((2, 3, 4 + i % 7, 5 + i % 3), Example(f"p{i}", "", "t")) for i in range(6)]
    # every node verified (the budget decides from timings)
    cfg = SpecConfig(reuse="trie", verify_budget=False, tree=TreeConfig(enabled=drafts))
    stages = [
        SpeculativeStage(engine, SamplingParams(1.0), 12, cfg)
        for engine in engines(init=0.5, device=device)
    ]
    static_engine = stages[1].engine.static
    adopt, adopted = static_engine.adopt, []
    static_engine.adopt = lambda *args: adopted.append(step) or adopt(*args)
    for step in range(3):
        (eager, eager_stats), (static, _) = (s(prompts, 4, (1, step, 0), step) for s in stages)
        for a, b in zip(eager, static, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.allclose(
                torch.tensor(a.current_logprobs), torch.tensor(b.current_logprobs), atol=1e-5
            )
    assert eager_stats.reused_tokens > 0
    assert 2 in adopted  # a reuse step's tails decoded in the arena
    assert (static_engine.arena.width > 1) == drafts  # with drafts, fed there too


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_tree_drafts_decode_on_every_engine_and_graphs_free_the_rows(device):
    """tree.enabled=auto drafts in the tails of speculative rollouts on either path (with static
    decoding, in the arena). Where decode forwards are CUDA graphs a reused token saves no row
    of a forward, only forwards (the budget's rows_free)."""
    eager, static = engines(init=0.5, device=device)
    graphs = device == "cuda"
    assert [e.capabilities.graph_decoding for e in (eager, static)] == [False, graphs]
    for engine, rows_free in ((eager, False), (static, graphs)):
        auto = SpeculativeStage(engine, SamplingParams(1.0), 12, SpecConfig(reuse="trie"))
        assert auto.tree_drafts
        assert auto.reuse.budget.rows_free == rows_free


def test_the_cost_model_prices_captures_at_what_the_calibration_paid(emulated_graphs):
    """With graphs (emulated), the calibration's captures give the machine a cost per capture
    (their seconds over their number; on an H200 at 315af38 27-50 ms each, what the cost model
    missed the graph arms by), the fit of the forwards leaves those seconds out, and a step is
    priced with the graphs it captured."""
    from specrl.cost_model import ModelShape, step_seconds
    from specrl.engines.accounting import ForwardCounts
    from specrl.projection import calibrate

    _, static = engines(init=0.3)
    shape = ModelShape.from_config("tiny", static.model.config.to_dict())
    before = ForwardCounts() + static.counts
    machine = calibrate(static, shape)
    spent = static.counts - before
    assert spent.decode_captures > 1
    assert machine.capture_s == pytest.approx(spent.decode_capture_seconds / spent.decode_captures)
    step = ForwardCounts()
    step.record("decode", 64, 64, 640, 640, forwards=4)
    plain = step_seconds(step, shape, machine)
    step.add_capture(0.1)
    step.add_capture(0.1)
    assert step_seconds(step, shape, machine) == pytest.approx(plain + 2 * machine.capture_s)


def test_a_forward_attends_the_columns_written_so_far_in_a_power_of_two():
    """The arena's columns are what its largest call needs; a forward attends only the first
    columns that hold its rows' KV and what it writes, in a power of two (at least
    `COLUMN_BUCKET`): as a row decodes, its forwards' masks widen 64 → 128, the tokens the eager
    loop's."""
    model = make_tiny_model(init=0.3)
    eager, static = (HFEngine(model, [999], PAD, static_decode=s) for s in (False, True))
    batch = [GenRequest([2, 3, 4], 120, SamplingParams(1.0), seed=5)]
    masks = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: masks.append(kwargs["attention_mask"].shape[-1]), with_kwargs=True
    )
    try:
        assert_same(eager.generate(batch), static.generate(batch))
    finally:
        hook.remove()
    decode = masks[len(masks) // 2 + 1 :]  # the static call's decode forwards
    assert static.static.arena.columns == 128
    assert decode == sorted(decode) and set(decode) == {COLUMN_BUCKET, 128}


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_graphs_captured_before_the_first_call_serve_every_later_forward(device, monkeypatch):
    """`capture_all`, run as the engine is built: the arena of the run's largest call and a graph
    of every shape its forwards can take (rows, fed width, attended columns), not counted as a
    step's. A speculative stage's steps (history tries walked, tree drafts in the tails) then
    capture none and decode in that arena, sampling the eager engine's tokens. On the CPU the
    graphs are emulated."""
    if device == "cpu":
        emulate_graphs(monkeypatch.setattr)
    prompts = [Prompt((2, 3, 4 + i % 7, 5 + i % 3), Example(f"p{i}", "", "t")) for i in range(6)]
    eager, static = engines(init=0.5, device=device)
    captured, seconds = static.static.capture_all(24, 4 + 12, 12, 9)
    arena = static.static.arena
    shapes = {(r, w, c) for r in (16, 32) for w in (1, 2, 4, 8, 9) for c in (64, 128)}
    assert set(arena.graphs) == set(arena.shapes()) == shapes
    assert captured == len(shapes) and seconds > 0 and static.counts.decode_captures == 0
    cfg = SpecConfig(reuse="trie", verify_budget=False, tree=TreeConfig(enabled=True))
    stages = [SpeculativeStage(e, SamplingParams(1.0), 12, cfg) for e in (eager, static)]
    for step in range(3):
        (eager_rollouts, stats), (static_rollouts, _) = (
            s(prompts, 4, (1, step, 0), step) for s in stages
        )
        for a, b in zip(eager_rollouts, static_rollouts, strict=True):
            assert a.token_ids == b.token_ids
    assert stats.reused_tokens > 0 and static.counts.decode_forwards > 0
    assert static.counts.decode_captures == 0 and static.static.arena is arena


@pytest.mark.parametrize("speculative", [False, True])
def test_the_engine_is_built_with_the_graphs_of_its_runs_largest_call(emulated_graphs, speculative):
    """`hf_engine` with static decoding and the run's `largest_call`: the arena holds its
    training batch's slots or its evaluation batch, whichever has more rows, contexts of its
    longest prompt (with speculation, and a reused prefix up to the response budget) and the
    budget, fed as wide as its drafts; one line says what the captures took."""
    from specrl.config import load_config
    from specrl.engines.build import hf_engine, largest_call

    overrides = [
        "rollout.static_decode=true", f"rollout.spec.enabled={speculative}",
        "data.train_batch_size=2", "rollout.n=4", "data.val_batch_size=12",
        "data.max_response_length=16", "actor.ppo_mini_batch_size=2",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    train = [Prompt(tuple(range(2, 2 + n)), Example(f"t{n}", "", "t")) for n in (3, 9)]
    val = [Prompt((2, 3), Example(f"v{i}", "", "t")) for i in range(10)]
    assert largest_call(cfg, train, val) == (10, 9)  # 2 · 4 slots, 10 of 12 evaluated
    lines = []
    engine = hf_engine(
        cfg, make_tiny_model(), [EOS], PAD, largest_call(cfg, train, val), lines.append
    )
    arena = engine.static.arena
    width = 9 if speculative else 1
    needed = 9 + 16 + 16 if speculative else 9 + 16
    assert (arena.rows, arena.width) == (GRAPH_ROWS, width)
    assert arena.columns == max(bucket(2 * needed + 32 + width if speculative else needed), 64)
    assert set(arena.graphs) == set(arena.shapes())
    assert lines == [lines[0]] and f"{len(arena.graphs)} decode CUDA graphs captured" in lines[0]
