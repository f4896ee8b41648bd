"""RL algorithms as small pure functions over tensors, each testable alone."""

from tidal.algo.advantages import ADVANTAGES, compute_advantages, dr_grpo_advantages, grpo_advantages, rloo_advantages  # noqa: F401
from tidal.algo.aggregation import AGGREGATIONS, aggregate_loss, aggregate_numerator  # noqa: F401
from tidal.algo.kl import KL_ESTIMATORS, kl_estimate, kl_reward_penalty  # noqa: F401
from tidal.algo.losses import POLICY_LOSSES, gspo_token_loss, policy_token_loss, ppo_clip_token_loss, sequence_log_ratio  # noqa: F401
from tidal.algo.shaping import has_no_signal, logprob_mismatch, overlong_penalty, truncated_importance_weights  # noqa: F401
from tidal.model.packing import token_logprobs_from_logits  # noqa: F401
