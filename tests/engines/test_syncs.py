"""Host-device syncs of the transformers engine, counted on the CPU: on a GPU each one stalls the
host until the device catches up, so the decode loop may sync a constant number of times per
forward, never once per sequence or per trie node. A `TorchDispatchMode` counts the dispatches
that force a sync on a GPU (`_local_scalar_dense`: `.item()`, `int()`, `bool()`; `nonzero`;
indexing with a boolean mask; `masked_select`); `Tensor.tolist` and `Tensor.cpu`, which copy to
the host without a dispatch on the CPU, are counted by wrapping them."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specrl.config import SpecConfig
from specrl.engines import GenRequest, SamplingParams, TrieRequest
from specrl.engines.hf import HFEngine
from specrl.speculative.stage import SpeculativeStage
from specrl.types import Example, Prompt
from tests.conftest import PAD, make_tiny_model
from tests.engines.test_drafts import drafting

SYNCING = {
    "aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
    "aten.masked_select.default",
}  # fmt: skip
NEVER = 999  # an end-of-sequence id the model cannot sample: every request runs its budget


class SyncCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        masked = name == "aten.index.Tensor" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
        )
        self.syncs += name in SYNCING or masked
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """→ count(call) = (dispatches that sync, tolist and cpu calls) while `call` runs."""
    calls = [0]

    def counting(method):
        def copy(self, *args, **kwargs):
            calls[0] += 1
            return method(self, *args, **kwargs)

        return copy

    for name in ("tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))

    def count(call):
        calls[0] = 0
        with SyncCount() as mode:
            call()
        return mode.syncs, calls[0]

    return count


def test_plain_decoding_copies_once_a_forward_and_syncs_only_per_call(counted):
    """Plain decoding copies each forward's outcome to the host once (the tokens, whether each
    sequence finished, `Emitted`), whatever the batch; its other syncs are the call's own (the
    prefill's counts, the uniforms' table, the results written after the last forward, the
    forwards' counts read once), so they do not grow with the forwards."""
    engine = HFEngine(make_tiny_model(), [NEVER], PAD)

    def decode(batch: int, tokens: int) -> None:
        engine.generate(
            [
                GenRequest([2, 3, 4 + i % 5], tokens, SamplingParams(1.0), seed=i)
                for i in range(batch)
            ]
        )

    small, large = counted(lambda: decode(4, 10)), counted(lambda: decode(32, 10))
    assert small == large  # the same 10 forwards: not a sync more for 8x the sequences
    longer = counted(lambda: decode(4, 20))
    # measured: 8 syncs and 15 copies over 10 forwards, 8 and 25 over 20 (68 and 64 over 10
    # when each forward read its counts, tokens and finished sequences from the device apart)
    assert longer[0] == small[0] <= 10 and longer[1] - small[1] == 10


def test_a_trie_step_syncs_per_forward_not_per_slot_or_node(counted):
    """A speculative step (history tries walked, the rest decoded with tree drafts) of 2 and of
    16 prompts: the syncs grow with the step's forwards, not with its slots or trie nodes."""
    per_forward = []
    for count in (2, 16):
        prompts = [Prompt((2, 3, 4 + i % 7, 5 + i % 3), Example(f"p{i}", "", "t")) for i in range(count)]  # fmt: skip
        engine = HFEngine(make_tiny_model(init=0.5), [NEVER], PAD)
        cfg = SpecConfig(enabled=True, acceptance="exact", reuse="trie", verify_budget=False)
        stage = SpeculativeStage(engine, SamplingParams(1.0), 10, cfg)
        stage(prompts, 4, (1, 0, 0), 0)
        out = []
        syncs, copies = counted(lambda: out.append(stage(prompts, 4, (1, 1, 0), 1)))  # noqa: B023
        stats = out[0][1]
        forwards = stats.compute.decode_forwards + stats.compute.verify_forwards
        assert stats.trie_nodes > 0 and stats.reused_tokens > 0
        per_forward.append((syncs / forwards, copies / forwards))
    # measured: 1.2 and 1.6 syncs, 2.0 and 1.9 tolist and cpu calls per forward (2 and 16
    # prompts: 6.3 and 8.8, 7.8 and 8.3 when decoding read its counts, tokens and finished
    # sequences from the device apart)
    assert all(syncs <= 3 and copies <= 3 for syncs, copies in per_forward), per_forward


def test_a_trie_pass_copies_to_the_host_per_forward_not_per_trie(counted):
    """A trie pass over 2 and over 16 tries (one forward each, with and without a prefix cache):
    the same syncs and host copies, whatever the tries. Each trie's sampler intervals are
    computed where its distributions are; only the intervals leave the device, in one copy."""
    engine = HFEngine(make_tiny_model(), [NEVER], PAD)

    def verify(count: int, prefixes: bool) -> tuple[int, int]:
        tries = [
            TrieRequest((2, 3, 4 + i % 7), [0, 1, 1, 0], [5, 6, 7, 8], SamplingParams(1.0))
            for i in range(count)
        ]
        handle = engine.new_prefixes() if prefixes else None
        before = engine.counts.verify_forwards
        out = []
        copies = counted(lambda: out.extend(engine.verify_tries(tries, handle)))
        assert len(out) == count and engine.counts.verify_forwards == before + 1
        return copies

    for prefixes in (False, True):
        assert verify(2, prefixes) == verify(16, prefixes)


def test_no_forward_attends_through_cudnn_plans_and_the_process_keeps_its_choice():
    """cuDNN's attention builds a plan on the host for every new shape (on an H100, 80-840 ms
    each: most of a reuse step's time, and of a run's first plain steps; benchmarks/
    gpu-h100-hf-profile). Every model forward of the engine (prefill, decode, verification,
    trie passes) and of the actor (old logprobs, the update) runs with it out of SDPA's kernels,
    which the flag read inside each forward shows on the CPU too; outside, it is as it was."""
    from tests.actor.test_update import _actor_update

    model = make_tiny_model(init=0.5)
    seen = []
    model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    engine = HFEngine(model, [NEVER], PAD)
    prompts = [Prompt((2, 3, 4 + i), Example(f"p{i}", "", "t")) for i in range(3)]
    stage = SpeculativeStage(
        engine,
        SamplingParams(1.0),
        6,
        SpecConfig(enabled=True, acceptance="exact", reuse="trie", verify_budget=False),
    )
    stage(prompts, 2, (1, 0, 0), 0)
    _, stats = stage(prompts, 2, (1, 1, 0), 1)  # a trie pass, then decoding
    assert stats.compute.verify_forwards > 0 and stats.compute.decode_forwards > 0
    engine_forwards = len(seen)
    _actor_update(model)
    assert len(seen) > engine_forwards and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_static_decode_forward_syncs_nothing(counted, monkeypatch):
    """What a CUDA graph records (static_decode.py's arena forward: the model over the arena's
    buffers, one fed column or a row's drafts too) may not sync the host at all: a capture fails
    on the first sync."""
    from specrl.engines.hf.static_decode import Arena

    run, forwards = Arena._run, []

    def counted_run(self, model, shape):
        logits = []
        forwards.append((shape[1], counted(lambda: logits.append(run(self, model, shape)))))
        return logits[0]

    monkeypatch.setattr(Arena, "_run", counted_run)
    engine = HFEngine(make_tiny_model(), [NEVER], PAD, static_decode=True)
    requests = [GenRequest([2, 3, 4 + i % 5], 10, SamplingParams(1.0), seed=i) for i in range(5)]
    plain = engine.generate(requests)
    engine.generate_with_drafts(requests, drafting([r.token_ids for r in plain]))
    assert len(forwards) > 10 and {width for width, _ in forwards} > {1}
    assert all(count == (0, 0) for _, count in forwards), forwards


VIEWS = frozenset(
    {"view", "slice", "select", "expand", "unsqueeze", "squeeze", "alias", "detach", "t",
     "transpose", "permute", "_unsafe_view", "as_strided", "split", "unbind", "lift_fresh"}
)  # fmt: skip


class Dispatches(TorchDispatchMode):
    """The ops dispatched, views aside, while `outside` holds (a GPU launches each)."""

    def __init__(self, outside) -> None:
        super().__init__()
        self.outside, self.count = outside, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.outside() and func._overloadpacket.__name__ not in VIEWS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_plain_decode_forward_dispatches_a_few_dozen_ops_besides_the_model(static):
    """On a GPU every op of the decode loop is a launch from the host, before and after the
    model's (which a CUDA graph replays as one): per plain decode forward, whatever the batch,
    a bounded number of them."""
    model = make_tiny_model()
    depth = [0]
    model.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
    model.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
    engine = HFEngine(model, [NEVER], PAD, static_decode=static)

    def per_forward(batch: int) -> float:
        # distinct prompts: on the CPU the eager loop shares a row between equal contexts
        requests = [
            GenRequest([2 + i % 9, 2 + i // 9, 4], 12, SamplingParams(1.0), seed=i)
            for i in range(batch)
        ]
        before = engine.counts.decode_forwards
        with Dispatches(lambda: depth[0] == 0) as mode:
            engine.generate(requests)
        return mode.count / (engine.counts.decode_forwards - before)

    small, large = per_forward(4), per_forward(32)
    # measured: 67.75 (eager) and 73.5 (static) per forward at both sizes, the call's own ops
    # spread over its 12 forwards; 85-92 and 97-104 before the tally summed its rows once a call,
    # a forward without drafts skipped counting accepted ones, the prefill's ids were padded in
    # numpy and the arena wrote no empty padding
    assert abs(small - large) < 3 and large < (80 if static else 75), (small, large)
