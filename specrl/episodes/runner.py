"""Multi-turn episodes over the speculative stage.

An episode alternates sampled turns and environment observations (env.py) in one context:

    prompt · obs_0 · turn_0 · obs_1 · turn_1 · ... · turn_T

(obs_0 is what the environment's reset returned, often nothing). Each turn of the live episodes
is one call of the speculative stage, whose `Prompt` is the context so far keyed
`<prompt id>/turn<t>`: the stage keeps a token tree per turn, the history trie every turn walks
under `reuse=trie` (verified under the turn's own context, so any turn may walk it). Under
`reuse=slot` it keeps, per (prompt, slot), each turn of the last episode as that turn's draft,
and `ObservationRecord` makes a stored turn a draft only while every observation before it
equals the stored episode's: once the environment answers differently, the rest of the stored
episode is no draft (token trees still propose). Under the exact rule every sampled token is
the current policy's, reused or not.

The episode is one `Rollout`: the tokens after the prompt, observations included with loss mask
0 (logprobs 0.0 there), the environment's summed rewards as its score. `data.max_response_length`
bounds all of it; finish reasons: `stop` (the environment said done), `length` (out of tokens),
`max_turns` (`rollout.multi_turn.max_turns`), `env_error`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from specrl.engines import RolloutEngine, SamplingParams
from specrl.episodes.env import EnvError, Environment, EnvironmentFactory
from specrl.rollouts import SlotRequest, sample_slots
from specrl.speculative.stage import SpeculativeStage
from specrl.speculative.stats import RolloutStats
from specrl.types import FinishReason, Prompt, Rollout

# rolls out one turn of each request → (turn rollouts, in order; what the stage did)
TurnFn = Callable[[Sequence[SlotRequest]], tuple[list[Rollout], RolloutStats]]


@dataclass
class _Episode:
    prompt: Prompt
    slot: int
    env: Environment | None  # None: its reset failed
    budget: int  # tokens left: turns and observations
    tokens: list[int] = field(default_factory=list)  # after the prompt
    current_logprobs: list[float] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    lenient: bool = False  # some turn was sampled with behaviour logprobs of its own
    loss_mask: list[int] = field(default_factory=list)
    observations: list[tuple[int, ...]] = field(default_factory=list)  # [t]: before turn t
    reward: float = 0.0
    acc: float | None = None  # the last accuracy the environment stated
    turns: int = 0
    finish: FinishReason | None = None

    def turn_prompt(self) -> Prompt:
        return Prompt(
            (*self.prompt.ids, *self.tokens),
            self.prompt.example,
            f"{self.prompt.prompt_id}/turn{self.turns}",
        )

    def observe(self, ids: Sequence[int]) -> None:
        self.observations.append(tuple(ids))
        self._append(ids, [0.0] * len(ids), [0.0] * len(ids), 0)

    def sampled(self, turn: Rollout) -> None:
        self.turns += 1
        self.lenient |= turn.behaviour_logprobs is not None
        behaviour = turn.behaviour_logprobs or turn.current_logprobs
        self._append(turn.token_ids, turn.current_logprobs, behaviour, 1)

    def _append(
        self, ids: Sequence[int], current: Sequence[float], behaviour: Sequence[float], mask: int
    ) -> None:
        self.tokens += ids
        self.current_logprobs += current
        self.behaviour_logprobs += behaviour
        self.loss_mask += [mask] * len(ids)
        self.budget -= len(ids)

    def rollout(self, policy_version: int) -> Rollout:
        return Rollout(
            self.prompt,
            self.slot,
            self.tokens,
            self.current_logprobs,
            self.finish,
            policy_version,
            self.behaviour_logprobs if self.lenient else None,
            self.loss_mask,
            0.0 if self.finish == "env_error" else self.reward,
            None if self.finish == "env_error" else self.acc,
        )


class ObservationRecord:
    """The observations of the last episode of each (prompt id, slot), whose turns the stage
    stores as drafts: turn t of that episode is a draft only for an episode whose observations
    up to turn t are the same."""

    def __init__(self) -> None:
        self._observations: dict[tuple[str, int], tuple[tuple[int, ...], ...]] = {}

    def drafts(self, episode: _Episode) -> bool:
        stored = self._observations.get((episode.prompt.prompt_id, episode.slot))
        t = episode.turns
        return (
            stored is not None
            and len(stored) > t
            and stored[: t + 1] == tuple(episode.observations)
        )

    def put(self, episode: _Episode) -> None:
        self._observations[(episode.prompt.prompt_id, episode.slot)] = tuple(episode.observations)

    def state_dict(self) -> dict[str, Any]:
        return {
            "observations": [
                (pid, slot, [list(o) for o in obs])
                for (pid, slot), obs in self._observations.items()
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._observations = {
            (pid, slot): tuple(tuple(o) for o in obs) for pid, slot, obs in state["observations"]
        }


@dataclass
class EpisodeStats:
    """What a call of the episode loop did: the stage's counts over every sampled turn, and
    the episodes' own counts (they add up like `RolloutStats`)."""

    rollout: RolloutStats = field(default_factory=RolloutStats)
    episodes: int = 0
    turns: int = 0
    env_errors: int = 0
    env_s: float = 0.0
    finish: Counter = field(default_factory=Counter)
    turn_reused_tokens: Counter = field(default_factory=Counter)  # turn → reused draft tokens
    turn_response_tokens: Counter = field(default_factory=Counter)  # turn → sampled tokens
    first_error: str | None = None

    def __add__(self, other: EpisodeStats) -> EpisodeStats:
        return EpisodeStats(
            self.rollout + other.rollout,
            self.episodes + other.episodes,
            self.turns + other.turns,
            self.env_errors + other.env_errors,
            self.env_s + other.env_s,
            self.finish + other.finish,
            self.turn_reused_tokens + other.turn_reused_tokens,
            self.turn_response_tokens + other.turn_response_tokens,
            self.first_error or other.first_error,
        )

    def metrics(self) -> dict[str, float]:
        """The stage's `spec/*` (over sampled turns), `num_turns/mean`, `episode/*`, and the
        reused token ratio of each turn in speculative runs."""
        out = self.rollout.metrics()
        episodes = max(self.episodes, 1)
        out["num_turns/mean"] = self.turns / episodes
        out["episode/env_errors"] = float(self.env_errors)
        for reason in ("stop", "length", "max_turns", "env_error"):
            out[f"episode/finish/{reason}"] = self.finish[reason] / episodes
        out["timing_s/env"] = self.env_s
        if self.rollout.speculative:
            for t, tokens in sorted(self.turn_response_tokens.items()):
                reused = self.turn_reused_tokens[t]
                out[f"spec/turn_{t}/reused_tokens"] = float(reused)
                out[f"spec/turn_{t}/response_tokens"] = float(tokens)
                out[f"spec/turn_{t}/reused_token_ratio"] = reused / max(tokens, 1)
        return out


class EpisodeLoop:
    """Plays episodes turn by turn: every live episode's next turn in one call of `turn`, then
    one environment step each."""

    def __init__(
        self,
        envs: EnvironmentFactory,
        tokenizer: PreTrainedTokenizerBase,
        max_turns: int,
        max_response_length: int,
        max_error_ratio: float = 1.0,
        warn: Callable[[str], None] = print,
    ) -> None:
        self.envs = envs
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_response_length = max_response_length
        self.max_error_ratio = max_error_ratio
        self.warn = warn

    def run(
        self,
        prompts: Sequence[Prompt],
        n: int,
        turn: TurnFn,
        policy_version: int,
        record: ObservationRecord | None = None,
        every_turn_reuses: bool = False,
    ) -> tuple[list[Rollout], EpisodeStats]:
        """n episodes per prompt (prompt-major) → their rollouts and stats. With a `record`,
        stored turns are drafts while the observations agree, and the record is updated; with
        `every_turn_reuses` (history tries, verified under each turn's own context) every turn
        may reuse."""
        stats = EpisodeStats()
        start = time.perf_counter()
        episodes = [self._reset(p, s, stats) for p in prompts for s in range(n)]
        for t in range(self.max_turns):
            live = [e for e in episodes if e.finish is None]
            if not live:
                break
            requests = [
                SlotRequest(
                    e.turn_prompt(),
                    e.slot,
                    e.budget,
                    every_turn_reuses or (record is not None and record.drafts(e)),
                )
                for e in live
            ]
            rollouts, turn_stats = turn(requests)
            stats.rollout = stats.rollout + turn_stats
            stats.turn_reused_tokens[t] += turn_stats.reused_tokens
            stats.turn_response_tokens[t] += turn_stats.response_tokens
            for e, r in zip(live, rollouts, strict=True):
                e.sampled(r)
                self._step(e, r, stats)
        for e in episodes:
            e.finish = e.finish or "max_turns"
            stats.finish[e.finish] += 1
            stats.turns += e.turns
            if record is not None:
                record.put(e)
        stats.episodes = len(episodes)
        if stats.env_errors > self.max_error_ratio * len(episodes):
            raise EnvError(
                f"environment {self.envs.name} failed in {stats.env_errors} of {len(episodes)} "
                f"episodes (first: {stats.first_error}); fix it, or raise env.max_error_ratio"
            )
        if stats.first_error is not None:
            self.warn(
                f"environment {self.envs.name}: {stats.env_errors} failed episodes, first: "
                f"{stats.first_error}"
            )
        stats.rollout.rollout_s = time.perf_counter() - start
        return [e.rollout(policy_version) for e in episodes], stats

    def _reset(self, prompt: Prompt, slot: int, stats: EpisodeStats) -> _Episode:
        start = time.perf_counter()
        env, text, error = self.envs.reset(prompt.example)
        stats.env_s += time.perf_counter() - start
        episode = _Episode(prompt, slot, env, self.max_response_length)
        if error is not None:
            self._failed(episode, error, stats)
        else:
            self._observe(episode, text or "")
        return episode

    def _step(self, episode: _Episode, turn: Rollout, stats: EpisodeStats) -> None:
        """The environment's answer to a turn just sampled; ends the episode or appends the
        observation."""
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        start = time.perf_counter()
        result, error = self.envs.step(episode.env, text, turn.token_ids)
        stats.env_s += time.perf_counter() - start
        if error is not None:
            self._failed(episode, error, stats)
            return
        episode.reward += result.reward
        if result.acc is not None:
            episode.acc = result.acc
        if result.done:
            episode.finish = "stop"
        elif turn.finish_reason == "length" or episode.budget <= 0:
            episode.finish = "length"
        elif episode.turns < self.max_turns:
            self._observe(episode, result.observation)

    def _observe(self, episode: _Episode, text: str) -> None:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        if len(ids) >= episode.budget:  # no room left for a sampled token after it
            episode.finish = "length"
            return
        episode.observe(ids)

    @staticmethod
    def _failed(episode: _Episode, error: str, stats: EpisodeStats) -> None:
        episode.finish = "env_error"
        stats.env_errors += 1
        stats.first_error = stats.first_error or error


class EpisodeStage:
    """The rollout stage of multi-turn runs: episodes whose turns the speculative stage rolls
    out. Owns that stage and the `ObservationRecord`; both are its checkpointed state."""

    def __init__(self, stage: SpeculativeStage, loop: EpisodeLoop) -> None:
        self.stage = stage
        self.loop = loop
        self.record = ObservationRecord()

    def __call__(
        self, prompts: Sequence[Prompt], n: int, seed_key: tuple, policy_version: int
    ) -> tuple[list[Rollout], EpisodeStats]:
        def turn(requests: Sequence[SlotRequest]) -> tuple[list[Rollout], RolloutStats]:
            return self.stage.rollout(requests, seed_key, policy_version)

        record = self.record if self.stage.cfg.enabled else None
        every_turn = self.stage.reuse.every_turn_reuses
        return self.loop.run(prompts, n, turn, policy_version, record, every_turn)

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage.state_dict(), "record": self.record.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage.load_state_dict(state["stage"])
        self.record.load_state_dict(state["record"])


def sampled_turns(
    engine: RolloutEngine, sampling: SamplingParams, seed_key: tuple, policy_version: int
) -> TurnFn:
    """Turns by plain sampling, no drafts (evaluation: greedy episodes)."""

    def turn(requests: Sequence[SlotRequest]) -> tuple[list[Rollout], RolloutStats]:
        return sample_slots(engine, requests, sampling, seed_key, policy_version), RolloutStats()

    return turn
