"""How short the decode loop of a reuse step can get with drafts from the prompts' history: the
trie arm's own rollouts replayed offline under other draft sources.

    python benchmarks/decode_tail_drafts.py --out DIR [--arm trie] [--steps 56] [--ks 4,8]
        [key=value ...]

A reuse step's decode loop runs until its slowest slot is done, so its forwards are that slot's.
The arm trains on the built-in task (or the overrides' config) for `--steps` steps. At every step
it records the prompts' token trees as they stood before the walks (what the engine drafts from)
and, per slot, its prompt, how many tokens its walk reused and its whole response. Under the exact
rule a slot's response is the same whatever is drafted, so each draft source is replayed on the
recorded responses: from the first token its walk did not reuse, a forward emits one token plus the
leading draft tokens equal to the response's next ones (at most K). Per step: the engine's own
decode forwards (measured, K adapted per forward, finished siblings joining the trees online), and
per source and K the slowest slot's forwards and all slots' forwards. Sources:

- `tree`: the engine's `Cursor` (the response's path in its prompt's tree, else the most
  frequent longest suffix match; the most frequent children from there);
- `aligned`: the response aligned token for token with its tree's most frequent path, a token off
  that path counted as a substitution; drafted from there while at most one of the last 8 tokens
  was off, otherwise as `tree`;
- `aligned+ngram`: as `aligned`, and where the tree proposes nothing, the most frequent
  continuation in a 5-gram table of all the step's stored responses (every prompt's);
- `prompt`: prompt lookup (as vLLM's `ngram` method): the tokens that followed the latest
  earlier occurrence of the context's last 3, else 2, else 1 tokens in the prompt and the
  response so far;
- `tree+prompt`: as `tree`, and where the tree proposes nothing, as `prompt`.

Also per step: the slowest slot's decoded tokens and how many of them follow their previous
token nowhere in the prompt's tree (an unseen bigram: no edge of the tree proposes it there).
Writes results.json. Run alone.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

NGRAM = 5
LOOKUP = 3  # `prompt`: the longest n-gram looked up (rollout.spec.tree.prompt_lookup)
WINDOW, MISSES = 8, 1  # `aligned`: drafted while at most MISSES of the last WINDOW tokens were off


def aligned_node(tree, response: list[int]) -> int | None:
    """The node of `tree` the response aligns with (most frequent child where it is off the
    tree), or None when it ran off the tree's leaves or too many recent tokens were off."""
    from specrl.speculative.tree import ROOT

    node, off = ROOT, []
    for token in response:
        child = tree.children[node].get(token)
        off.append(child is None)
        node = tree.best[node] if child is None else child
        if node < 0:
            return None
    return node if sum(off[-WINDOW:]) <= MISSES else None


def ngram_table(trees) -> dict[tuple[int, ...], collections.Counter]:
    table: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
    for tree in trees:
        for _, response in tree.responses:
            for i, token in enumerate(response):
                for n in range(1, min(NGRAM, i) + 1):
                    table[tuple(response[i - n : i])][token] += 1
    return table


def ngram_drafts(table, response: list[int], k: int) -> list[int]:
    context, out = list(response), []
    while len(out) < k:
        found = next(
            (table[key] for n in range(NGRAM, 0, -1) if (key := tuple(context[-n:])) in table),
            None,
        )
        if found is None:
            break
        token = found.most_common(1)[0][0]
        out.append(token)
        context.append(token)
    return out


def prompt_lookup(context: list[int], k: int) -> list[int]:
    """What the engine's prompt lookup source proposes after `context`."""
    from specrl.speculative.lookup import PromptLookup

    return PromptLookup([context], LOOKUP).propose(0, [], k)


def drafts(
    source: str, tree, table, response: list[int], k: int, prompt: list[int] = ()
) -> list[int]:
    from specrl.speculative.tree import Cursor

    if source == "prompt":
        return prompt_lookup([*prompt, *response], k)
    if tree is None:
        return prompt_lookup([*prompt, *response], k) if source == "tree+prompt" else []
    if source != "tree":
        node = aligned_node(tree, response)
        if node is not None:
            return tree.continuation(node, k)
    proposed = Cursor(tree, response).propose(k)
    if not proposed and source == "aligned+ngram":
        return ngram_drafts(table, response, k)
    if not proposed and source == "tree+prompt":
        return prompt_lookup([*prompt, *response], k)
    return proposed


def branch_roots(tree, response: list[int]) -> list[int]:
    """The nodes a branching draft grows from: the response's path node if it has one, else its
    aligned node and every longest suffix match."""
    from specrl.speculative.tree import ROOT

    node = ROOT
    for token in response:
        node = tree.children[node].get(token)
        if node is None:
            aligned = aligned_node(tree, response)
            return ([aligned] if aligned is not None else []) + tree.suffix_matches(response)
    return [node]


def branch_accepted(tree, response: list[int], at: int, nodes: int) -> int:
    """The leading tokens of response[at:] that a draft tree of at most `nodes` nodes, grown
    best first (the most frequent paths) from `branch_roots`, holds as one path."""
    import heapq

    roots = branch_roots(tree, response[:at])
    heap = [(-tree.count[c], c) for r in roots for c in tree.children[r].values()]
    heapq.heapify(heap)
    drafted: set[int] = set()
    while heap and len(drafted) < nodes:
        _, node = heapq.heappop(heap)
        if node not in drafted:
            drafted.add(node)
            for c in tree.children[node].values():
                heapq.heappush(heap, (-tree.count[c], c))
    best = 0
    for root in roots:
        node, depth = root, 0
        while at + depth < len(response):
            child = tree.children[node].get(response[at + depth])
            if child not in drafted:
                break
            node, depth = child, depth + 1
        best = max(best, depth)
    return best


def slot_forwards(
    source: str, tree, table, response: list[int], reused: int, k: int, prompt: list[int]
) -> int:
    """Forwards to decode `response` from token `reused` on, each emitting one token and the
    leading drafts that equal the response's next tokens (`branches`: a draft tree of k nodes,
    its longest path that does)."""
    at, forwards = reused, 0
    while at < len(response):
        if tree is not None and source == "branches":
            accepted = branch_accepted(tree, response, at, k)
        else:
            proposed = drafts(source, tree, table, response[:at], k, prompt)
            accepted = 0
            while (
                accepted < len(proposed)
                and at + accepted < len(response)
                and proposed[accepted] == response[at + accepted]
            ):
                accepted += 1
        at += accepted + 1
        forwards += 1
    return forwards


def unseen_bigrams(tree, response: list[int], reused: int) -> int:
    from specrl.speculative.tree import ROOT

    edges = {
        (tree.token[tree.parent[v]] if tree.parent[v] != ROOT else None, tree.token[v])
        for v in range(1, len(tree.token))
    }
    return sum(
        (response[i - 1] if i else None, response[i]) not in edges
        for i in range(reused, len(response))
    )


def replay(step: dict, ks: list[int], branch_nodes: list[int]) -> dict:
    trees, slots = step["trees"], step["slots"]
    table = ngram_table(trees.values())
    decoding = [s for s in slots if s["reused"] < len(s["response"])]
    out = {
        "step": step["step"],
        "trie_pass": step["trie_pass"],
        "engine_decode_forwards": step["engine_decode_forwards"],
        "slots_decoding": len(decoding),
        "decoded_tokens": sum(len(s["response"]) - s["reused"] for s in decoding),
    }
    if decoding:
        slowest = max(decoding, key=lambda s: len(s["response"]) - s["reused"])
        out["longest_tail_tokens"] = len(slowest["response"]) - slowest["reused"]
        out["longest_tail_unseen_bigrams"] = unseen_bigrams(
            trees[slowest["prompt"]], slowest["response"], slowest["reused"]
        )
    for source, sizes in (
        ("tree", ks),
        ("aligned", ks),
        ("aligned+ngram", ks),
        ("prompt", ks),
        ("tree+prompt", ks),
        ("branches", branch_nodes),
    ):
        for k in sizes:
            per_slot = [
                slot_forwards(
                    source, trees.get(s["prompt"]), table, s["response"], s["reused"], k, s["ids"]
                )
                for s in decoding
            ]
            out[f"{source}/nodes={k}" if source == "branches" else f"{source}/K={k}"] = {
                "slowest_slot_forwards": max(per_slot, default=0),
                "slot_forwards": sum(per_slot),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm", default="trie")
    parser.add_argument("--steps", type=int, default=56)
    parser.add_argument("--ks", default="4,8", help="draft tokens per forward replayed")
    parser.add_argument("--branch-nodes", default="16,64", help="draft tree sizes replayed")
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    from specrl.bench import arm_config
    from specrl.config import load_config
    from specrl.trainer import Trainer

    ks = [int(k) for k in args.ks.split(",")]
    branch_nodes = [int(n) for n in args.branch_nodes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    started_load = os.getloadavg()
    cfg = load_config(None, [*args.overrides, "trainer.logger=[]", "trainer.save_freq=0"])
    trainer = Trainer(arm_config(cfg, args.arm, cfg.trainer.seed, Path(tempfile.mkdtemp())))
    reuse = trainer.run.rollouts.stage.reuse
    recorded: dict = {}

    def before_decoding(slots, seed_key, prefixes, stats, walk=reuse.before_decoding):
        ids = {s.prompt.prompt_id for s in slots}
        recorded["trees"] = {p: copy.deepcopy(t) for p in ids if (t := reuse.tree.get(p))}
        return walk(slots, seed_key, prefixes, stats)

    def after_decoding(slots, results, stats, done=reuse.after_decoding):
        recorded["slots"] = [
            {
                "prompt": s.prompt.prompt_id,
                "ids": list(s.prompt.ids),
                "reused": len(s.kept),
                "response": [*s.kept, *(results[i].token_ids if i in results else ())],
            }
            for i, s in enumerate(slots)
        ]
        return done(slots, results, stats)

    reuse.before_decoding, reuse.after_decoding = before_decoding, after_decoding
    steps = []
    try:
        for step in range(1, args.steps + 1):
            trainer.run.global_step = step
            recorded.clear()
            metrics = trainer.train_step()
            recorded["step"] = step
            recorded["trie_pass"] = bool(metrics.get("perf/verify/forwards"))
            recorded["engine_decode_forwards"] = metrics["perf/decode/forwards"]
            steps.append(replay(recorded, ks, branch_nodes))
            print(json.dumps(steps[-1]), flush=True)
    finally:
        trainer.run.rollouts.shutdown()
        trainer.run.lock.release()
    keys = [k for k in steps[0] if "/K=" in k or "/nodes=" in k]
    medians = {
        "engine_decode_forwards": statistics.median(s["engine_decode_forwards"] for s in steps),
        "longest_tail_tokens": statistics.median(s.get("longest_tail_tokens", 0) for s in steps),
        "longest_tail_unseen_bigrams": statistics.median(
            s.get("longest_tail_unseen_bigrams", 0) for s in steps
        ),
    } | {
        f"{k}/{field}": statistics.median(s[k][field] for s in steps)
        for k in keys
        for field in ("slowest_slot_forwards", "slot_forwards")
    }
    result = {
        "command": " ".join(sys.argv),
        "load_average_at_start": started_load,
        "load_average_at_end": os.getloadavg(),
        "median_over_steps": medians,
        "steps": steps,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
