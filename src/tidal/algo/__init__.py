"""RL algorithms as small pure functions over tensors, each testable alone; advantages and policy losses are registered by name."""

from tidal.algo.advantages import (  # noqa: F401
    ADVANTAGES,
    AdvantageFn,
    advantage_fn,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    register_advantage,
    rloo_advantages,
)
from tidal.algo.aggregation import AGGREGATIONS, aggregate_loss, aggregate_numerator  # noqa: F401
from tidal.algo.kl import KL_ESTIMATORS, kl_estimate, kl_reward_penalty  # noqa: F401
from tidal.algo.logprobs import token_logprobs_from_logits  # noqa: F401
from tidal.algo.losses import (  # noqa: F401
    POLICY_LOSSES,
    PolicyLossFn,
    gspo_token_loss,
    policy_loss_fn,
    policy_token_loss,
    ppo_clip_token_loss,
    register_policy_loss,
    sequence_log_ratio,
)
from tidal.algo.shaping import has_no_signal, logprob_mismatch, overlong_penalty, sampled_only, truncated_importance_weights  # noqa: F401
