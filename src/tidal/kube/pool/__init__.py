"""The rollout workers of a run: the fixed pool (worker lanes of each round) and the elastic pool (one
Deployment per run scaled by KEDA, its pods' entry process)."""
