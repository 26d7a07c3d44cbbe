"""The CUDA graphs a static-decode run would capture, counted on the CPU: a run of `specrl train`
with `rollout.static_decode=true`, counting per step (step 0: before the first, where the engine
captures every shape of the run's largest call) the arenas built, the (rows, fed width, attended
columns) shapes captured (on CUDA two warm-up forwards and the capture each; `shapes`: which) and
the decode forwards, and over the run how many forwards each shape served (`uses`: shapes by
their count of forwards, per arena; shapes captured and never fed are not counted there).

    python benchmarks/graph_captures.py --out FILE [CONFIG OVERRIDES...]

Graphs are emulated (tests/engines/graphs.py: the arenas take CUDA's shapes, and a capture or
replay runs the forward eagerly), so what it counts is the shapes, not their cost; on an H200
a trie arm's reuse steps spent most of their decode time capturing
(benchmarks/gpu-h200-hf-captures-680f630).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

from specrl import trainer
from specrl.cli import main as specrl_main
from specrl.engines.hf import static_decode

ROOT = Path(__file__).resolve().parents[1]  # the tests package lives there
sys.path.insert(0, str(ROOT))


def count(overrides: list[str]) -> dict:
    events: list[tuple] = []
    shapes: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    replaced: list[tuple] = []

    def patch(owner, name, value) -> None:
        replaced.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    from tests.engines.graphs import emulate_graphs

    emulate_graphs(patch)  # the arenas' shapes as on CUDA (GRAPH_ROWS rows at least)
    init, capture, logits, begin_step = (
        static_decode.Arena.__init__,
        static_decode.Arena.capture,
        static_decode.Arena.logits,
        trainer.Trainer.begin_step,
    )

    def counted_init(self, like, rows, columns, width):
        init(self, like, rows, columns, width)
        events.append(("arenas", (rows, columns, width)))

    def counted_capture(self, model, shape):
        events.append(("captures", shape))
        return capture(self, model, shape)

    def counted_logits(self, model, shape):
        shapes[id(self)][shape] += 1
        events.append(("forwards", None))
        return logits(self, model, shape)

    def marked_step(self):
        events.append(("step", None))
        return begin_step(self)

    static_decode.Arena.__init__ = counted_init
    static_decode.Arena.capture = counted_capture
    static_decode.Arena.logits = counted_logits
    trainer.Trainer.begin_step = marked_step
    try:
        specrl_main(["train", "rollout.static_decode=true", *overrides])
    finally:
        static_decode.Arena.__init__, static_decode.Arena.logits = init, logits
        static_decode.Arena.capture = capture
        trainer.Trainer.begin_step = begin_step
        for owner, name, value in reversed(replaced):
            setattr(owner, name, value)
    steps: list[collections.Counter] = [collections.Counter()]  # [0]: before the first step
    captured: list[list[list[int]]] = [[]]  # per step, the shapes captured
    for kind, shape in events:
        if kind == "step":
            steps.append(collections.Counter())
            captured.append([])
        else:
            steps[-1][kind] += 1
            if kind == "captures":
                captured[-1].append(list(shape))
    kinds = ("arenas", "captures", "forwards")
    return {
        "steps": [
            {"step": i, **{k: c[k] for k in kinds}, "shapes": shapes_of_step}
            for i, (c, shapes_of_step) in enumerate(zip(steps, captured, strict=True))
        ],
        "totals": {k: sum(c[k] for c in steps) for k in kinds},
        "arenas": [list(shape) for kind, shape in events if kind == "arenas"],
        "uses": [dict(sorted(collections.Counter(c.values()).items())) for c in shapes.values()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args, overrides = parser.parse_known_args()
    result = {"command": " ".join(sys.argv), "load_average_at_start": os.getloadavg()}
    result |= count(overrides)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["steps"]:
        print(row)
    print("totals", result["totals"], "arenas", result["arenas"])
    print("captured shapes by forwards served, per arena", result["uses"])


if __name__ == "__main__":
    main()
