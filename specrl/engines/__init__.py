from specrl.engines.protocol import (
    GREEDY,
    Capabilities,
    Drafter,
    GenRequest,
    GenResult,
    LogprobRequest,
    Prefixes,
    RolloutEngine,
    SamplingParams,
    TrieLogprobs,
    TrieRequest,
)

__all__ = [
    "GREEDY",
    "Capabilities",
    "Drafter",
    "GenRequest",
    "GenResult",
    "LogprobRequest",
    "Prefixes",
    "RolloutEngine",
    "SamplingParams",
    "TrieLogprobs",
    "TrieRequest",
]
