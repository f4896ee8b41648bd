"""`tidal run` with an environment (rollout.env), as a user runs it: multi-turn trajectories go
from the rollout side to the trainer, in sync mode and through NATS in periodic mode, and the two
make the same update."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tests.conftest import read_jsonl, run_cli


def test_sync_and_periodic_train_the_same_multi_turn_trajectories_to_the_same_weights(tmp_path, write_config):
    config = write_config(
        {
            "rollout.env": "tests.test_agent_loop:Chatty",  # answers every turn, never done: max_turns ends it
            "rollout.tools": ["calc"],
            "rollout.max_turns": 2,
            "rollout.max_new_tokens": 24,  # long enough for the barely warm-started model to end turns with EOS
            "rollout.deterministic": True,
            "trainer.iterations": 2,
            "trainer.prompts_per_iteration": 4,
            "eval.enabled": False,
        }
    )
    finals, metrics = {}, {}
    for mode in ("sync", "periodic"):
        proc = run_cli("run", str(config), "--run-dir", str(tmp_path / mode), "--set", f"mode={mode}", "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
        finals[mode] = load_file(str(tmp_path / mode / "weights" / "v000002" / "model.safetensors"))
        metrics[mode] = read_jsonl(tmp_path / mode / "metrics.jsonl")
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        assert summary["groups_trained"] == 2 * 4
    for m in metrics["sync"]:
        assert {"agent_turns_mean", "agent_masked_token_fraction", "agent_tool_error_rate", "agent_trajectory_length_p90"} <= m.keys()
        # inserted tokens are generated but not trained on
        assert m["trained_tokens"] == round(m["generated_tokens"] * (1 - m["agent_masked_token_fraction"]))
        assert m["logprob_mismatch"] < 1e-5
    assert any(m["agent_turns_mean"] > 1 and m["trained_tokens"] < m["generated_tokens"] for m in metrics["sync"])  # some went to a second turn
    assert [m["generated_tokens"] for m in metrics["sync"]] == [m["generated_tokens"] for m in metrics["periodic"]]
    start = load_file(str(tmp_path / "sync" / "weights" / "v000000" / "model.safetensors"))
    assert max((finals["sync"][k] - start[k]).abs().max().item() for k in start) > 1e-4
    for name, tensor in finals["sync"].items():
        torch.testing.assert_close(finals["periodic"][name], tensor, atol=1e-5, rtol=1e-4, msg=name)
