"""The multi-rank trainer on CPU: 2 gloo ranks under torchrun, in subprocesses, against one process.

Noise floor: two single-process runs that only split the same groups into micro-batches differently
end 3 AdamW steps apart by ~2.4e-5 (max |Δ| of the weights, measured here); fsdp2 at 2 ranks must
be no further from one process than that, and its gradients within 1e-6.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import learner_run, max_diff, run_and_kill, run_cli, trained_in
from tidal.trainer.assignment import assign_groups


def test_fsdp2_gradients_and_weights_match_one_process(tmp_path):
    learner_run(tmp_path / "single", 1, "--strategy", "single")
    learner_run(tmp_path / "split", 1, "--strategy", "single", "--token-budget", "60")  # the noise floor
    counts = learner_run(tmp_path / "fsdp2", 2, "--strategy", "fsdp2")
    assert counts["world_size"] == 2 and all(n >= 1 for n in counts["micro_batches_per_rank"])  # both ranks trained
    assert max_diff(tmp_path / "single" / "grads.safetensors", tmp_path / "fsdp2" / "grads.safetensors") < 1e-6
    floor = max_diff(tmp_path / "single" / "weights.safetensors", tmp_path / "split" / "weights.safetensors")
    moved = max_diff(tmp_path / "single" / "weights.safetensors", tmp_path / "fsdp2" / "weights.safetensors")
    assert 0 < floor < 1e-4 and moved <= floor, (moved, floor)


def test_uneven_micro_batches_neither_hang_nor_lose_exactness(tmp_path):
    """One rank gets one huge group, the other many small ones: 2 vs 3 micro-batches. The short rank
    runs a zero-gradient micro-batch so both make the same FSDP collectives."""
    learner_run(tmp_path / "single", 1, "--strategy", "single", "--uneven", "--token-budget", "40")
    counts = learner_run(tmp_path / "fsdp2", 2, "--strategy", "fsdp2", "--uneven", "--token-budget", "40")
    per_rank = counts["micro_batches_per_rank"]
    assert per_rank[0] != per_rank[1], per_rank  # the case really is uneven
    assert max_diff(tmp_path / "single" / "grads.safetensors", tmp_path / "fsdp2" / "grads.safetensors") < 1e-6
    assert max_diff(tmp_path / "single" / "weights.safetensors", tmp_path / "fsdp2" / "weights.safetensors") < 5e-5


def test_fsdp2_tri_model_and_activation_checkpointing_match_one_process(tmp_path):
    """The reference (KL) and the old policy (two optimizer steps per iteration) share the fsdp2
    layout; recomputing activations in backward changes nothing."""
    learner_run(tmp_path / "single", 1, "--strategy", "single", "--frozen")
    learner_run(tmp_path / "fsdp2", 2, "--strategy", "fsdp2", "--frozen", "--activation-checkpointing")
    assert max_diff(tmp_path / "single" / "grads.safetensors", tmp_path / "fsdp2" / "grads.safetensors") < 1e-6
    assert max_diff(tmp_path / "single" / "weights.safetensors", tmp_path / "fsdp2" / "weights.safetensors") < 5e-5


@pytest.fixture(scope="module")
def lora_one_process(tmp_path_factory) -> Path:
    """The LoRA learner on one process: KL against the base, two optimizer steps per iteration (the old
    policy), and a resume from the second iteration's checkpoint."""
    out = tmp_path_factory.mktemp("lora-single")
    learner_run(out, 1, "--strategy", "single", "--lora", "--frozen", "--resume-check")
    return out


@pytest.mark.parametrize("strategy", [("fsdp2",), ("deepspeed", "--zero-stage", "3")], ids=["fsdp2", "deepspeed-zero3"])
def test_lora_on_two_ranks_ends_on_the_adapter_of_one_process(tmp_path, lora_one_process, strategy):
    """The adapter (gathered from its shards: peft's names, nothing of the base) after 3 iterations
    of 2 steps each, with the reference and the old adapter under the strategy, and after a resume
    from the sharded checkpoint. Measured: gradients within 2e-8, adapters within 3e-7 of one process
    (float summation order); the bounds leave room for other BLAS builds."""
    counts = learner_run(tmp_path, 2, "--strategy", *strategy, "--lora", "--frozen", "--resume-check")
    assert counts["world_size"] == 2 and all(n >= 1 for n in counts["micro_batches_per_rank"])
    one = load_file(str(lora_one_process / "weights.safetensors"))
    assert one and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in one)  # the adapter alone, in peft's file names
    assert max(v.abs().max().item() for k, v in one.items() if "lora_B" in k) > 1e-3  # training moved it (B starts at 0)
    assert max_diff(lora_one_process / "grads.safetensors", tmp_path / "grads.safetensors") < 1e-6
    assert max_diff(lora_one_process / "weights.safetensors", tmp_path / "weights.safetensors") < 5e-6
    assert max_diff(tmp_path / "weights.safetensors", tmp_path / "resumed.safetensors") < 5e-6


def test_assignment_is_token_balanced_and_deterministic():
    counts = [50, 10, 10, 10, 10, 10, 3]
    shares = assign_groups(counts, 2)
    assert sorted(i for s in shares for i in s) == list(range(7))
    loads = [sum(counts[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= 3 and shares == assign_groups(counts, 2)
    assert assign_groups(counts, 1) == [list(range(7))] and assign_groups([], 3) == [[], [], []]


@pytest.mark.parametrize("folder", ["checkpoint/v000004", "checkpoint"], ids=["checkpoint-folder", "older-layout"])
def test_a_checkpoint_from_another_world_size_is_refused_clearly(tmp_path, folder):
    from types import SimpleNamespace

    from tidal.rundir import RunDir
    from tidal.trainer.checkpoint import resume_version
    from tidal.trainer.distributed import DistContext

    (tmp_path / folder).mkdir(parents=True)
    (tmp_path / folder / "state.json").write_text(json.dumps({"next_version": 4, "world_size": 2}))
    with pytest.raises(ValueError, match=r"written by 2 trainer rank\(s\) and this trainer has 1: resume with trainer.ranks=2"):
        resume_version(RunDir(tmp_path), SimpleNamespace(ctx=DistContext()), store=None)


def deterministic_config(write_config, **extra):
    overrides = {
        "rollout.deterministic": True,
        "eval.enabled": False,
        "reward.functions": [{"name": "exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.1}],
    }
    overrides.update(extra)
    return write_config(overrides)


def final_weights(run_dir: Path, version: int = 3) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "weights" / f"v{version:06d}" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float = 5e-5) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < atol, worst


def test_tidal_run_on_two_fsdp2_ranks_ends_at_one_process_weights(tmp_path, write_config):
    config = deterministic_config(write_config)
    for ranks in (1, 2):
        proc = run_cli("run", str(config), "--run-dir", str(tmp_path / f"r{ranks}"), "--set", f"trainer.ranks={ranks}", "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer rank 1 of 2 on cpu, strategy fsdp2" in (tmp_path / "r2" / "logs" / "trainer.log").read_text()
    start, one, two = final_weights(tmp_path / "r1", 0), final_weights(tmp_path / "r1"), final_weights(tmp_path / "r2")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-4  # training moved the weights
    assert_same_weights(one, two)
    worker_log = (tmp_path / "r2" / "logs" / "worker-0.log").read_text()  # the arrival check ran at every version and passed
    assert all(
        re.search(
            rf"loaded weights v{v} in [\d.]+s from the weight store \(probe log-probs within [\d.e+-]+ of the trainer's, mean per token\)", worker_log
        )
        for v in range(3)
    )
    records = [json.loads(line) for line in (tmp_path / "r2" / "groups.jsonl").read_text().splitlines()]
    keys = [(r["iteration"], r["prompt_id"]) for r in records]
    assert len(keys) == len(set(keys)) == 3 * 6  # every group trained exactly once
    checkpoint = tmp_path / "r2" / "checkpoint"
    assert [p.name for p in checkpoint.iterdir()] == ["v000003"]  # one folder per checkpoint, the superseded ones removed
    assert sorted(p.name for p in (checkpoint / "v000003").iterdir()) == [
        "optimizer-rank0-of-2.safetensors",
        "optimizer-rank1-of-2.safetensors",
        "state.json",
    ]


def test_a_killed_trainer_rank_resumes_from_the_sharded_checkpoint(tmp_path, write_config):
    """SIGKILL trainer rank 1 mid-iteration: torchrun restarts both ranks, they resume from the last
    boundary's shards, every group of the interrupted iteration is redelivered, none is lost or
    trained twice in the final metrics, and the weights match an uninterrupted 2-rank run."""
    slow_rewards = [{"name": "tests.rewards:slow_exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.1}]
    config = deterministic_config(
        write_config,
        **{"transport.ack_wait_seconds": 2.0, "rollout.groups_per_batch": 1, "trainer.ranks": 2, "reward.functions": slow_rewards},
    )
    reference = run_cli("run", str(config), "--run-dir", str(tmp_path / "ref"), "--no-progress")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "run"
    proc = run_and_kill(config, run_dir, "trainer-rank1.pid", when=lambda run_dir: trained_in(run_dir, 1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert all(m["samples"] == 6 * 4 for m in metrics)
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "resumed from checkpoint: version 1" in log
    assert_same_weights(final_weights(tmp_path / "ref"), final_weights(run_dir))
