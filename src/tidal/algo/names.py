"""The names of the built-in algorithms, in a module without torch: the config checks a name against these
before any process imports torch, and each registry checks at import that it registers exactly these."""

ADVANTAGES = ("grpo", "dr_grpo", "rloo")
POLICY_LOSSES = ("ppo_clip", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
