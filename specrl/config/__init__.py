"""Typed run configuration: one class per section, loaded from YAML plus dotted overrides.

Names follow verl where the concept exists there (`data.train_batch_size`, `rollout.n`,
`actor.clip_ratio_low`, `algorithm.adv_estimator`, `trainer.total_epochs` ...). Every field has a
default, a bound where one exists and a one-line description; a wrong key, type or value fails at
load time with one `ConfigError` naming the field.

The package: `section.py` (the base and `ConfigError`), one module per group of sections
(`run.py`, `rollout.py`, `training.py`), `schema.py` (`Config` and its cross-section checks),
`loading.py` (YAML, overrides, verl's spellings, help text).
"""

from specrl.config.loading import (
    VERL_ALIASES,
    describe_config,
    flatten,
    load_config,
    save_config,
    sections_help,
    validated,
)
from specrl.config.rollout import (
    CheckpointEngineConfig,
    DispatchConfig,
    FaultToleranceConfig,
    MultiTurnConfig,
    RolloutConfig,
    SpecConfig,
    TreeConfig,
)
from specrl.config.run import (
    DataConfig,
    ModelConfig,
    RayInitConfig,
    RayKwargsConfig,
    TrainerConfig,
)
from specrl.config.schema import Config
from specrl.config.section import ConfigError, Section
from specrl.config.training import (
    GROUP_BASELINES,
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    CriticModelConfig,
    CriticOptimConfig,
    CustomRewardConfig,
    EnvConfig,
    FilterGroupsConfig,
    LoraConfig,
    OptimConfig,
    OverlongBufferConfig,
    PolicyLossConfig,
    RewardModelConfig,
    RolloutCorrectionConfig,
)

__all__ = [
    "GROUP_BASELINES", "VERL_ALIASES", "ActorConfig", "AlgorithmConfig", "CheckpointEngineConfig",
    "Config", "ConfigError", "CriticConfig", "CriticModelConfig", "CriticOptimConfig",
    "CustomRewardConfig", "DataConfig", "DispatchConfig", "EnvConfig", "FaultToleranceConfig",
    "FilterGroupsConfig", "LoraConfig", "ModelConfig", "MultiTurnConfig", "OptimConfig",
    "OverlongBufferConfig", "PolicyLossConfig", "RayInitConfig", "RayKwargsConfig",
    "RewardModelConfig", "RolloutConfig", "RolloutCorrectionConfig", "Section", "SpecConfig",
    "TrainerConfig", "TreeConfig", "describe_config", "flatten", "load_config", "save_config",
    "sections_help", "validated",
]  # fmt: skip
