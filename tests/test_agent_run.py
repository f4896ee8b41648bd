"""`tidal run` with an environment (rollout.agent.env), as a user runs it: multi-turn trajectories go
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
            "rollout.agent.env": "tests.environments:Chatty",  # answers every turn, never done: max_turns ends it
            "rollout.agent.tools": ["calc"],
            "rollout.agent.max_turns": 2,
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


def test_the_calculator_example_evaluates_through_its_environment_and_trains_the_same_in_sync_and_periodic(tmp_path):
    """examples/calculator.yaml as shipped, shortened: the warm start plays its tool-use traces, the
    held-out eval runs the environment before and after, the table shows tool use, and sync and
    periodic end on the same weights in deterministic mode."""
    shorter = [
        "model.warm_start.steps=40",
        "model.warm_start.batch_size=16",
        f"model.warm_start.cache_dir={tmp_path / 'cache'}",
        "data.num_train=200",
        "rollout.group_size=4",
        "rollout.deterministic=true",
        "trainer.iterations=2",
        "trainer.prompts_per_iteration=4",
        "eval.num_prompts=4",
        "eval.samples_per_prompt=2",
        "eval.k=[1,2]",
    ]
    finals, outputs = {}, {}
    for mode in ("sync", "periodic"):
        sets = [a for s in [*shorter, f"mode={mode}"] for a in ("--set", s)]
        proc = run_cli("run", "examples/calculator.yaml", "--run-dir", str(tmp_path / mode), *sets, "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[mode] = proc.stdout
        finals[mode] = load_file(str(tmp_path / mode / "weights" / "v000002" / "model.safetensors"))
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        assert summary["groups_trained"] == 2 * 4
        for when in ("before", "after"):
            assert 0.0 <= summary[f"sampled_tool_use_rate_{when}"] <= 1.0 and summary[f"turns_mean_{when}"] >= 1.0
    assert "calls the tool" in outputs["periodic"] and "(sampled)" in outputs["periodic"]
    metrics = read_jsonl(tmp_path / "sync" / "metrics.jsonl")
    assert all("agent_tool_use_rate" in m for m in metrics)
    for name, tensor in finals["sync"].items():
        torch.testing.assert_close(finals["periodic"][name], tensor, atol=1e-5, rtol=1e-4, msg=name)
