"""A run that must learn: if a change breaks the update (a sign, the normalisation, the loss, the
weight sync), the training reward stops rising and this fails, not only a shape check.

The reward is the share of digits in the completion: learnable within a few steps from any start,
so a short deterministic run shows it. Measured here: 0.17 -> 0.96 over 12 iterations (lr 1e-2).
"""

import json

from tests.conftest import run_cli


def test_the_training_reward_rises_in_a_short_periodic_run(tmp_path, write_config):
    config = write_config(
        {
            "rollout.deterministic": True,
            "rollout.group_size": 8,
            "trainer.iterations": 12,
            "trainer.prompts_per_iteration": 16,
            "trainer.lr": 1e-2,
            "trainer.warmup_steps": 0,
            "eval.enabled": False,
            "reward.functions": [{"name": "tests.rewards:digit_fraction"}],
        }
    )
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [json.loads(line)["reward_mean"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.3, rewards  # measured: +0.7
