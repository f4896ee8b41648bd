"""LoRA on the tiny vision-language model (HF engine): the adapter on the language model with the vision tower
frozen (the default target modules name only the language model's projections), or adapters on the vision tower
too (its `qkv`, `proj`, `fc1`, `fc2`). Each version's adapter reaches the rollout worker, vision part included:
the engine's log-probs of responses to prompts with images agree with the trainer's after the adapter has moved
(a vision adapter the engine did not apply would move them apart)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_jsonl, run_cli

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vision.yaml"
LANGUAGE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VISION = ["qkv", "proj", "fc1", "fc2"]  # Qwen2-VL's vision blocks: attention and MLP

SHORT = [
    "model.warm_start.steps=20",
    "model.warm_start.stop_at_accuracy=null",
    "data.num_train=64",
    "data.num_eval=8",
    "trainer.iterations=3",
    "trainer.prompts_per_iteration=4",
    "trainer.lr=1e-2",  # the adapter moves far enough in one step for an unapplied part to show
    "reward.functions=[{name: 'tests.rewards:digit_count', weight: 1.0}]",  # graded: every group has an advantage
    "rollout.group_size=4",
    "eval.samples_per_prompt=2",
    "eval.k=[1,2]",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # one warm start for both runs


@pytest.mark.parametrize("vision", [False, True], ids=["vision-frozen", "vision-adapters"])
def test_lora_on_the_tiny_vlm_reaches_the_engine_every_version(vision, cache, tmp_path):
    targets = LANGUAGE + VISION if vision else LANGUAGE
    run = tmp_path / "run"
    sets = [*SHORT, f"model.lora={{target_modules: [{', '.join(targets)}]}}"]
    proc = run_cli(
        "run",
        str(EXAMPLE),
        "--run-dir",
        str(run),
        "--no-progress",
        *(a for s in sets for a in ("--set", s)),
        env={"TIDAL_CACHE": str(cache)},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    adapter = load_file(run / "weights" / "v000003" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    moved = {k for k, t in adapter.items() if "lora_B" in k and torch.count_nonzero(t) > 0}  # B starts at zero
    visual = {k for k in adapter if ".visual." in k}
    assert moved - visual  # the language model's adapter trained
    if vision:
        assert moved & visual, sorted(visual)  # and the vision tower's
    else:
        assert not visual  # the vision tower stays the base model's

    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    # iterations 1 and 2 generate with an adapter that has moved: the worker computes what the trainer does
    assert all(m["trained_tokens"] > 0 for m in metrics) and max(m["logprob_mismatch"] for m in metrics) < 1e-5
    summary = json.loads((run / "summary.json").read_text())
    assert summary["staleness_max"] == 0 and summary["accuracy_after"] is not None
