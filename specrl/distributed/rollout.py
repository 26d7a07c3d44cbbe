"""Rollout workers on Ray, driven by the trainer (single controller).

`RolloutWorkers` is a rollout backend (backends.py), as the in-process engine and stage are:
called with a batch of prompts it returns their rollouts and a `RolloutStats`; `load_weights`
publishes new weights; `generate` serves evaluation; `state_dict` / `load_state_dict` are the
stage's format, so a run saved with N workers resumes with 0, 1 or M.

Each worker owns a shard of prompts (their drafts and trees). Per call the planner keeps prompts
on their owner within the balance slack and moves the rest with their state. Every call returns
a delta (the state of the prompts it touched) which the controller keeps in `self.shards`; a
worker that dies mid-call is restarted by Ray, given back its shard from there, the current
weights, and the same request with the same seeds: its rollouts are the ones it would have
returned. A worker past its restarts is retired and its prompts move to the others.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specrl.config import Config
from specrl.distributed.planner import plan_dispatch
from specrl.distributed.ray_cluster import import_ray, require_cpus, start_ray
from specrl.distributed.weight_sync import resolve_backend
from specrl.distributed.worker import RolloutWorker, WorkerResult
from specrl.engines import GenRequest, GenResult, SamplingParams
from specrl.errors import UserError
from specrl.speculative.prompt_state import PromptState
from specrl.speculative.stats import RolloutStats
from specrl.types import Prompt, Rollout


class RolloutWorkersError(UserError):
    """Every rollout worker died."""


class RolloutWorkers:
    episodes = None  # multi-turn runs roll out in the trainer's process (the config says so)

    def __init__(
        self,
        cfg: Config,
        model_dir: Path,
        eos_ids: list[int],
        pad_id: int,
        sampling: SamplingParams,
        log: Callable[[str], None] = print,
    ) -> None:
        ray = import_ray()
        start_ray(cfg.ray_kwargs.ray_init)
        require_cpus(ray, cfg)
        self._ray = ray
        self.cfg = cfg
        self.log = log
        rollout = cfg.rollout
        actor = ray.remote(RolloutWorker).options(
            num_cpus=rollout.num_cpus_per_worker,
            num_gpus=rollout.num_gpus_per_worker,
            max_restarts=rollout.fault_tolerance.max_restarts,
            max_task_retries=0,  # a retried call would run without its shard: we re-send it
        )
        n = rollout.num_workers
        backend = resolve_backend(cfg)
        transfer = "nccl" if backend == "nccl" else "local"
        self.handles = [
            actor.remote(cfg, model_dir, eos_ids, pad_id, sampling, n, transfer) for _ in range(n)
        ]
        self.live = list(range(n))
        self.owners: dict[str, int] = {}  # prompt id → worker holding its drafts and tree
        self.costs: dict[str, float] = {}  # prompt id → tokens of its last rollouts
        self.shards = PromptState(None, adopt_trees=True)  # every prompt, as last reported
        self.weights: Any = None  # object ref of the current weights
        self.version: int | None = None
        self.restarts = 0
        self.migrated = 0  # prompts handed to a new worker with their drafts and trees
        self._ahead: list[Any] = []  # run-ahead calls in flight
        width = ray.get([h.draft_width.remote() for h in self.handles])[0]  # engines built
        self.draft_widths: dict[int, dict[str, Any]] = dict.fromkeys(self.live, width)
        self.state: Mapping[str, torch.Tensor] = {}  # the current weights (nccl backend)
        self.nccl = None
        if backend == "nccl":
            from specrl.engines.vllm.nccl_sync import NcclWeightSync

            self.nccl = NcclWeightSync(ray)
            self.nccl.connect(self.handles)

    # ---------------------------------------------------------------- rollouts
    def __call__(
        self, prompts: Sequence[Prompt], n: int, seed_key: tuple, policy_version: int
    ) -> tuple[list[Rollout], RolloutStats]:
        start = time.perf_counter()
        self.collect_run_ahead()
        ids = [p.prompt_id for p in prompts]
        plan = plan_dispatch(
            ids, self.costs, self.owners, self.live, self.cfg.rollout.dispatch.max_imbalance
        )
        restarts, migrated = self.restarts, self.migrated
        shards = [shard for shard in plan.shards if shard]
        workers = [self.live[j] for j, shard in enumerate(plan.shards) if shard]
        calls = [
            self._rollout_call([prompts[i] for i in shard], n, seed_key, policy_version)
            for shard in shards
        ]
        done = self._run(workers, calls)
        out: list[Rollout] = [None] * (len(prompts) * n)  # type: ignore[list-item]
        busy = dict.fromkeys(self.live, 0.0)
        for shard, (w, result) in zip(shards, done, strict=True):
            if result.policy_version != policy_version:
                raise RuntimeError(
                    f"rollout worker {w} holds the weights of step {result.policy_version}, "
                    f"step {policy_version} needs its own"
                )
            for k, i in enumerate(shard):
                out[i * n : (i + 1) * n] = result.rollouts[k * n : (k + 1) * n]
            busy[w] += result.stats.rollout_s
        for pid in ids:
            self.costs[pid] = 0.0
        for r in out:
            self.costs[r.prompt.prompt_id] += len(r.token_ids)
        stats = RolloutStats.of_workers([r.stats for _, r in done], time.perf_counter() - start)
        stats.workers = len(self.live)
        stats.migrated_prompts = self.migrated - migrated
        stats.worker_restarts = self.restarts - restarts
        stats.worker_busy_max_s = max(busy.values())
        stats.worker_busy_mean_s = sum(busy.values()) / len(busy)
        return out, stats

    def _rollout_call(self, prompts: list[Prompt], n: int, seed_key: tuple, version: int):
        """The call rolling `prompts` out on a worker (after handing them over to it); the
        result's delta and draft widths are kept here."""
        ids = list(dict.fromkeys(p.prompt_id for p in prompts))

        def submit(w: int):
            self._hand_over(w, ids)
            return self.handles[w].rollout.remote(prompts, n, seed_key, version)

        def keep(w: int, result: WorkerResult) -> WorkerResult:
            self.shards.import_(result.delta)
            self.draft_widths[w] = result.draft_width
            return result

        return submit, keep

    def run_ahead(self, prompts: Sequence[Prompt], seed_key: tuple, policy_version: int) -> None:
        """SRT run-ahead: the next batch's prompts go to the workers the planner will give them
        to, which sample one response each into their trees, without the trainer waiting (it
        updates meanwhile). The next call collects the trees' state."""
        ids = [p.prompt_id for p in prompts]
        plan = plan_dispatch(
            ids, self.costs, self.owners, self.live, self.cfg.rollout.dispatch.max_imbalance
        )
        for j, shard in enumerate(plan.shards):
            if shard:
                w = self.live[j]
                batch = [prompts[i] for i in shard]
                self._hand_over(w, [p.prompt_id for p in batch])
                ref = self.handles[w].run_ahead.remote(batch, seed_key, policy_version)
                self._ahead.append(ref)

    def collect_run_ahead(self) -> None:
        """Wait for the run-ahead calls in flight and keep the trees they seeded (a worker that
        died meanwhile is given back its shard without them when it is recovered)."""
        for ref in self._ahead:
            with contextlib.suppress(self._ray.exceptions.RayActorError):
                self.shards.import_(self._ray.get(ref))
        self._ahead = []

    def _hand_over(self, w: int, ids: list[str]) -> None:
        """Worker `w` takes over the prompts it does not own: their state from `self.shards`
        (the previous owner forgets them)."""
        incoming = [p for p in ids if self.owners.get(p) != w]
        for old in {self.owners[p] for p in incoming if p in self.owners} & set(self.live):
            self.handles[old].drop.remote([p for p in incoming if self.owners[p] == old])
        if incoming:
            self.handles[w].import_.remote(self.shards.export(incoming))
            self.migrated += sum(p in self.costs for p in incoming)  # rolled out before
        self.owners.update(dict.fromkeys(ids, w))

    # ---------------------------------------------------------------- faults
    def _run(
        self, workers: list[int], calls: list[tuple[Callable, Callable]]
    ) -> list[tuple[int, Any]]:
        """Run call i on workers[i], all at once; a call whose worker dies (or runs past
        rollout.fault_tolerance.step_timeout_s) is sent again once the worker is back, or to the
        least busy other worker when it is not coming back. → (the worker that ran it, its
        result) in call order."""
        ray = self._ray
        results: list[tuple[int, Any]] = [None] * len(calls)  # type: ignore[list-item]
        pending = dict(enumerate(workers))
        while pending:
            refs = {calls[i][0](w): i for i, w in pending.items()}
            _, late = ray.wait(
                list(refs),
                num_returns=len(refs),
                timeout=self.cfg.rollout.fault_tolerance.step_timeout_s,
            )
            for ref in late:
                w = pending[refs[ref]]
                self.log(f"warning: rollout worker {w} timed out; restarting it")
                ray.kill(self.handles[w], no_restart=False)
            failed = {}
            for ref, i in refs.items():
                w = pending[i]
                try:
                    results[i] = w, calls[i][1](w, ray.get(ref))
                except ray.exceptions.RayActorError as err:
                    failed[i] = (w, err)
            pending = {}
            for i, (w, err) in failed.items():
                pending[i] = w if self._recover(w, err) else self._retire(w, workers)
        return results

    def _recover(self, w: int, err: Exception) -> bool:
        """Wait for dead worker `w` to be restarted and give it back its shard, draft widths and
        the current weights. → False when it is not coming back."""
        ray = self._ray
        self.restarts += 1
        self.log(f"warning: rollout worker {w} died ({type(err).__name__}); waiting for it")
        handle = self.handles[w]
        deadline = time.monotonic() + self.cfg.rollout.fault_tolerance.restart_timeout_s
        while True:  # unavailable while Ray restarts it; died when it will not
            try:
                ray.get(handle.pid.remote(), timeout=max(deadline - time.monotonic(), 0))
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False
        owned = [p for p, o in self.owners.items() if o == w]
        calls = [handle.import_.remote(self.shards.export(owned))]
        if w in self.draft_widths:
            calls.append(handle.load_draft_width.remote(self.draft_widths[w]))
        if self.weights is not None:
            calls.append(handle.load_weights.remote(self.weights, self.version))
        try:
            ray.get(calls)
            if self.nccl is not None:  # the group lost a member: a new one, the weights again
                self._nccl_regroup()
        except ray.exceptions.RayActorError:
            return False
        self.log(f"rollout worker {w} is back with {len(owned)} prompts")
        return True

    def _retire(self, w: int, busy: list[int]) -> int:
        """Take dead worker `w` out of the run; its prompts belong to no one (their state stays
        here and moves with them). → the live worker to take its call over."""
        self.live.remove(w)
        if not self.live:
            raise RolloutWorkersError(
                "every rollout worker died (restarts exhausted); see the worker logs above, and "
                "raise rollout.fault_tolerance.max_restarts or rerun to resume"
            )
        self.owners = {p: o for p, o in self.owners.items() if o != w}
        self.draft_widths.pop(w, None)
        if self.nccl is not None:
            self._nccl_regroup()
        self.log(f"warning: rollout worker {w} is gone; continuing with {len(self.live)} workers")
        return min(self.live, key=lambda v: (busy.count(v), v))

    # ---------------------------------------------------------------- weights, evaluation
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Publish the policy's weights (rollouts of step `version` are sampled with them): one
        object in Ray's store, loaded by every worker; or, with the nccl backend, a broadcast
        from this process's GPU to every worker's vLLM."""
        self.version = version
        if self.nccl is not None:
            self.state = state
            self.nccl.send(state, [self.handles[w] for w in self.live], version)
            return
        ray = self._ray
        self.weights = ray.put({k: v.detach().cpu() for k, v in state.items()})
        workers = list(self.live)
        self._run(
            workers,
            [(lambda w: self.handles[w].load_weights.remote(self.weights, version),
              lambda w, got: got)] * len(workers),
        )  # fmt: skip

    def _nccl_regroup(self) -> None:
        handles = [self.handles[w] for w in self.live]
        self.nccl.connect(handles)
        if self.state:
            self.nccl.send(self.state, handles, self.version)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Requests split evenly over the workers (evaluation: no drafts, no state)."""
        chunks = [c for c in np.array_split(np.arange(len(requests)), len(self.live)) if len(c)]
        calls = [
            (lambda w, c=c: self.handles[w].generate.remote([requests[i] for i in c]),
             lambda w, got: got)
            for c in chunks
        ]  # fmt: skip
        return [r for _, part in self._run(self.live[: len(calls)], calls) for r in part]

    def sleep(self) -> None:
        self._ray.get([self.handles[w].sleep.remote() for w in self.live])

    def wake_up(self) -> None:
        self._ray.get([self.handles[w].wake_up.remote() for w in self.live])

    def shutdown(self) -> None:
        for handle in self.handles:
            self._ray.kill(handle, no_restart=True)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The stage's checkpoint format: every prompt's drafts and tree, and the workers' draft
        width statistics averaged."""
        self.collect_run_ahead()
        return {**self.shards.state_dict(), "draft_width": _mean(list(self.draft_widths.values()))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: every prompt's state waits here for the worker the planner gives it to."""
        self.shards.load_state_dict(state)
        self.owners, self.costs = {}, {}
        store = state["store"]
        for pid, length in zip(store["prompt_ids"], store["lengths"].tolist(), strict=True):
            self.costs[pid] = self.costs.get(pid, 0) + length
        self.draft_widths = dict.fromkeys(self.live, state["draft_width"])
        self._ray.get(
            [self.handles[w].load_draft_width.remote(state["draft_width"]) for w in self.live]
        )


def _mean(states: list[Any]) -> Any:
    """The workers' states averaged: arrays and numbers elementwise, dicts (a draft width's
    statistics, its per-span fits) key by key over the workers that have the key."""
    if isinstance(states[0], dict):
        keys = dict.fromkeys(k for state in states for k in state)
        return {k: _mean([state[k] for state in states if k in state]) for k in keys}
    return np.mean(states, axis=0)
