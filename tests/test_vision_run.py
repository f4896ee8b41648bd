"""`tidal run` of a tiny vision-language model on the square-counting task, 2 iterations, sync and periodic:
the images go from the data rows through the work items, the engine and the groups to the learner. The
engine's log-probs (computed with the image) equal the trainer's: a trainer without the image would differ
by about 0.1 on this model (its image tokens would be plain embeddings)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import read_jsonl, run_cli
from tidal.demo.vision import save_tiny_vlm, write_count_task


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_tidal_run_trains_a_tiny_vlm_on_prompts_with_images(tmp_path, mode):
    model = save_tiny_vlm(tmp_path / "model")
    data = write_count_task(tmp_path / "data", rows=32)
    config = {
        "mode": mode,
        "model": {"name_or_path": str(model)},
        "data": {"task": "jsonl", "path": str(data), "num_train": 28, "num_eval": 4},
        "rollout": {"group_size": 4, "max_new_tokens": 4},
        "trainer": {"prompts_per_iteration": 2, "iterations": 2, "kl_coef": 0.01},  # a KL term: every group is trained
        "eval": {"enabled": mode == "sync", "samples_per_prompt": 2, "k": [1, 2]},  # held-out prompts with their images, before and after
    }
    path = tmp_path / "vision.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_cli("run", str(path), "--run-dir", str(tmp_path / "run"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    assert all(m["trained_tokens"] > 0 for m in metrics)
    assert max(m["logprob_mismatch"] for m in metrics) < 1e-5
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 2
    if mode == "sync":
        assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None
        exported = tmp_path / "exported"  # the model with its processor, loadable on its own
        proc = run_cli("export", str(tmp_path / "run"), "--out", str(exported))
        assert proc.returncode == 0, proc.stderr[-3000:]
        from transformers import AutoModelForImageTextToText

        from tidal.model.vision import load_processor

        assert AutoModelForImageTextToText.from_pretrained(str(exported)).config.vision_config is not None
        assert load_processor(exported).process_images([data.parent.joinpath("images/00000.png").read_bytes()]).tokens(2) == 4
