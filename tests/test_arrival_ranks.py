"""The arrival check on several trainer ranks: fsdp2 and DeepSpeed ZeRO-2/3 at 2 gloo ranks, in subprocesses
(tests/distributed_learner.py --probe), against one process.

At each version every rank runs the probe forward and rank 0 writes its log-probs with the weights
(`publish_weights`, v0 before training and each iteration's after it, then the boundary's optimizer
snapshot); a twin learner beside it publishes without a probe. Measured over 3 iterations of 2 steps
(a KL reference and an old policy): probe log-probs within 2.4e-6 of one process's with full weights and
4.8e-7 with an adapter; the probed learner's weights equal its twin's bit for bit. Without putting the
shards back after the forward, fsdp2's boundary snapshot fails (the root's gathered tensors are not the
optimizer's parameters) and ZeRO-3 under LoRA trains the next iteration against a stale old adapter
(weights 7e-4 off the twin's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import learner_run, max_diff

KINDS = {"full": (), "lora": ("--lora",)}
ONE_PROCESS_WEIGHTS = {"full": 5e-5, "lora": 5e-6}  # tests/test_distributed.py's bounds for these runs
PROBE_TOLERANCE = 2e-5  # float32 summation order; the check's own default (1e-3) is 50 times wider


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for kind, extra in KINDS.items():
        out[kind] = tmp_path_factory.mktemp(f"one-process-{kind}")
        learner_run(out[kind], 1, "--strategy", "single", "--probe", "--frozen", *extra)
    return out


def published_probes(weights: Path, key: str = "logprobs") -> dict[str, list]:
    """version folder -> the probe record's `key` its manifest carries (None when it carries no probe)."""
    out = {}
    for version in sorted(weights.glob("v*")):
        probe = json.loads((version / "manifest.json").read_text()).get("probe")
        out[version.name] = probe and probe[key]
    return out


def largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize(
    "strategy, kind",
    [
        (("fsdp2",), "full"),
        (("fsdp2",), "lora"),
        (("deepspeed", "--zero-stage", "2"), "full"),
        (("deepspeed", "--zero-stage", "3"), "full"),
        (("deepspeed", "--zero-stage", "3"), "lora"),
    ],
    ids=["fsdp2-full", "fsdp2-lora", "zero2-full", "zero3-full", "zero3-lora"],
)
def test_two_ranks_publish_one_process_probe_and_train_as_with_the_check_off(tmp_path, one_process, strategy, kind):
    counts = learner_run(tmp_path, 2, "--strategy", *strategy, "--probe", "--frozen", *KINDS[kind])
    assert counts["world_size"] == 2 and all(n >= 1 for n in counts["micro_batches_per_rank"])
    # after every publish (v0..v3, probed learner and twin) each rank's policy is laid out as training leaves it
    assert counts["sharded_after_probe"] == [True] * 8, counts["sharded_after_probe"]

    one, two = published_probes(one_process[kind] / "weights"), published_probes(tmp_path / "weights")
    assert list(two) == ["v000000", "v000001", "v000002", "v000003"] == list(one)
    assert all(two.values())  # every version carries the probe
    assert max(largest_difference(one[v], two[v]) for v in one) < PROBE_TOLERANCE
    assert largest_difference(two["v000000"], two["v000003"]) > 1e-2  # training moved the probe: versions are told apart
    # the probe's responses, sampled by both ranks together, are one process's; so is the base's record
    assert published_probes(tmp_path / "weights", "sequences") == published_probes(one_process[kind] / "weights", "sequences")
    base_one, base_two = (published_probes(p / "weights", "base_logprobs")["v000003"] for p in (one_process[kind], tmp_path))
    assert largest_difference(base_one, base_two) < PROBE_TOLERANCE and base_two == two["v000000"]
    assert not any(published_probes(tmp_path / "unprobed-weights").values())  # the twin: the check off

    # the probe forward changes no gradient: the first step (after v0's probe) and the weights after 6 steps
    assert max_diff(one_process[kind] / "grads.safetensors", tmp_path / "grads.safetensors") < 1e-6
    assert max_diff(tmp_path / "weights.safetensors", tmp_path / "unprobed.safetensors") < 1e-7  # measured: bitwise equal
    assert max_diff(one_process[kind] / "weights.safetensors", tmp_path / "weights.safetensors") < ONE_PROCESS_WEIGHTS[kind]
