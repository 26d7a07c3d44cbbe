from specrl.engines.base import (
    GREEDY,
    FinishReason,
    GenRequest,
    GenResult,
    RolloutEngine,
    SamplingParams,
    ScoreRequest,
)

__all__ = [
    "GREEDY",
    "FinishReason",
    "GenRequest",
    "GenResult",
    "RolloutEngine",
    "SamplingParams",
    "ScoreRequest",
]
