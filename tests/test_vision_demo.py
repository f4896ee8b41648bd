"""The vision demo as `tidal run examples/vision.yaml` gets it on a fresh clone: the count_squares task made from
the seed in memory, the built-in tiny Qwen2-VL (model.tiny.arch: qwen2_vl) and its cached SFT warm start, then a
short periodic run with held-out eval before and after. Whether it learns is measured in docs/vision.md (minutes)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import read_jsonl, run_cli
from tidal.config import ConfigError, config_from_dict, load_config
from tidal.data import load_dataset
from tidal.demo.warm_start import warm_start_key

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vision.yaml"


def red_squares(image_bytes: bytes) -> int:
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(image_bytes)).convert("RGB")).astype(int)
    red = (pixels[..., 0] == 220) & (pixels[..., 1] == 30) & (pixels[..., 2] == 30)
    return int(red.sum()) // (10 * 10)  # a square fills 10x10 pixels of its 14x14 cell


def test_count_squares_is_made_from_the_seed_and_its_answers_are_the_images_red_squares():
    cfg = load_config(EXAMPLE).data.model_copy(update={"num_train": 200, "num_eval": 50})
    data = load_dataset(cfg, seed=3)
    assert (len(data.train), len(data.eval)) == (200, 50)
    assert [p.images for p in load_dataset(cfg, seed=3).train] == [p.images for p in data.train]
    assert [p.images for p in load_dataset(cfg, seed=4).train] != [p.images for p in data.train]
    assert not {p.images for p in data.train} & {p.images for p in data.eval}  # held out: no image seen in training
    assert [str(red_squares(p.images[0])) for p in data.train + data.eval] == [p.answer for p in data.train + data.eval]
    assert {p.answer for p in data.train} == {str(n) for n in range(cfg.max_count + 1)}
    assert data.train[0].prompt == "how many red squares?\n"


def test_count_squares_needs_a_vision_language_model():
    with pytest.raises(ConfigError, match=r"data.task 'count_squares' has images: set model.tiny.arch: qwen2_vl"):
        config_from_dict({"data": {"task": "count_squares"}})


def test_the_warm_starts_key_follows_the_vision_fields_only_where_they_apply():
    text = config_from_dict({})
    assert warm_start_key(text) == warm_start_key(config_from_dict({"model": {"tiny": {"vision_depth": 3}}, "data": {"max_count": 6}}))
    vision = config_from_dict({"model": {"tiny": {"arch": "qwen2_vl"}}, "data": {"task": "count_squares"}})
    assert warm_start_key(vision) != warm_start_key(
        vision.model_copy(update={"model": vision.model.model_copy(update={"tiny": vision.model.tiny.model_copy(update={"vision_depth": 3})})})
    )
    assert warm_start_key(vision) != warm_start_key(vision.model_copy(update={"data": vision.data.model_copy(update={"max_count": 6})}))


def test_the_vision_warm_start_trains_on_the_answers_with_the_images():
    import torch

    from tidal.demo.vision import build_processor, build_tiny_vlm, tiny_vlm_size, vision_sft_batch
    from tidal.demo.warm_start import vision_warm_start

    cfg = load_config(EXAMPLE)
    cfg = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(
                update={"warm_start": cfg.model.warm_start.model_copy(update={"steps": 30, "batch_size": 8, "lr": 1e-2, "stop_at_accuracy": None})}
            )
        }
    )
    pool = load_dataset(cfg.data.model_copy(update={"num_train": 64, "num_eval": 1}), cfg.seed).train
    torch.manual_seed(0)
    processor = build_processor()
    model = build_tiny_vlm(processor.tokenizer, tiny_vlm_size(cfg.model.tiny))
    ids, mask, labels, images = vision_sft_batch(
        processor,
        [
            (*processor.encode(processor.tokenizer("<|vision_start|><|image_pad|><|vision_end|>q\n").input_ids, list(p.images)), p.answer)
            for p in pool[:2]
        ],
    )
    trained = [processor.tokenizer.decode(row[row != -100]) for row in labels]
    assert trained == [f"A: {p.answer}<eos>" for p in pool[:2]]  # the answer line only, never the prompt or the image
    assert images["pixel_values"].shape[0] == 2 * 16 and (images["mm_token_type_ids"].sum(1) == 4).all()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask, labels=labels, **images).loss.item()
    result = vision_warm_start(cfg, model, processor, pool)
    assert result.steps == 30 and result.loss < before / 2


def test_tidal_run_of_the_vision_example_warm_starts_the_tiny_vlm_and_trains_it(tmp_path):
    overrides = [
        "model.warm_start.steps=20",
        "model.warm_start.stop_at_accuracy=null",
        "data.num_train=64",
        "data.num_eval=8",
        "trainer.iterations=2",
        "trainer.prompts_per_iteration=4",
        "rollout.group_size=4",
        "eval.samples_per_prompt=2",
        "eval.k=[1,2]",
    ]
    run = tmp_path / "run"
    args = ["run", str(EXAMPLE), "--run-dir", str(run), "--no-progress"]
    proc = run_cli(*args, *(a for o in overrides for a in ("--set", o)), env={"TIDAL_CACHE": str(tmp_path / "cache")}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (base,) = (tmp_path / "cache" / "warm-start").iterdir()  # the warm start, cached with the image processor
    assert json.loads((run / "run.json").read_text())["base_model"] == str(base)
    assert (base / "preprocessor_config.json").is_file() and "vision_config" in json.loads((base / "config.json").read_text())
    assert "warm start: 20 steps" in (run / "logs" / "launcher.log").read_text()
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    assert all(m["trained_tokens"] > 0 for m in metrics) and max(m["logprob_mismatch"] for m in metrics) < 1e-5
    summary = json.loads((run / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "sampled_accuracy_before", "sampled_accuracy_after"):
        assert summary[key] is not None, key
