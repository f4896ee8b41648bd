"""One typed config for every role: YAML in, validated, clear errors out (schema: the blocks and
their rules; files: loading, overrides, the resolved config written back)."""

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
    AGENT_KEYS,
    BUILT_IN_ALGORITHMS,
    BUILT_IN_ENVIRONMENTS,
    BUILT_IN_TOOL_PARSERS,
    BUILT_IN_TOOLS,
    ConfigError,
    DataConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RewardFunctionConfig,
    RolloutConfig,
    TidalConfig,
    TinyModelConfig,
    TrackingConfig,
    TrainerConfig,
    TransportConfig,
    VLLMConfig,
    WarmStartConfig,
    WeightsConfig,
    WorkerRange,
)
