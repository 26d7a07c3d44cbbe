"""CUDA graphs emulated on the CPU, for tests and `benchmarks/graph_captures.py`: an arena's
forwards are captured and replayed as on CUDA (a capture runs the forward, a replay runs it again
into the arena's output buffer), so the graph path's shapes, counts and tokens can be checked here."""

from specrl.engines.hf import static_decode
from specrl.engines.hf.static_decode import Arena


class Graph:
    def __init__(self, replay) -> None:
        self.replay = replay


def capture(self: Arena, model, shape: tuple[int, int, int]) -> None:
    out = self.output(shape, self._run(model, shape))
    out.copy_(self._run(model, shape))
    self.graphs[shape] = Graph(lambda: out.copy_(self._run(model, shape))), out


def emulate_graphs(setattr) -> None:
    """Emulate through `setattr(owner, name, value)` (pytest's `monkeypatch.setattr`, or the
    builtin for a whole process)."""
    setattr(static_decode, "graph_pool", lambda device: object())
    setattr(Arena, "capture", capture)
