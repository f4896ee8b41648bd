"""One typed config for every role: YAML in, validated, clear errors out (schema: the top level and the rules
across blocks; model, reward, rollout, trainer: the big blocks; names: the built-in names, read from their
registries; legacy: old keys read at their new places; files: loading, overrides, the resolved config written back)."""

from tidal.config.files import (  # noqa: F401
    NON_TRAINING_KEYS,
    apply_overrides,
    config_from_dict,
    dump_config,
    flatten,
    load_config,
    parse_override,
    training_changes,
)
from tidal.config.schema import (  # noqa: F401
    AgentConfig,
    ConfigError,
    DataConfig,
    EvalConfig,
    FunctionRewardConfig,
    JudgeRewardConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
    RolloutConfig,
    SandboxConfig,
    ServedRewardConfig,
    ServeRewardModelConfig,
    TidalConfig,
    TinyModelConfig,
    ToolLatencyConfig,
    TrackingConfig,
    TrainerConfig,
    TransportConfig,
    VLLMConfig,
    WarmStartConfig,
    WeightsConfig,
    WorkerRange,
)
