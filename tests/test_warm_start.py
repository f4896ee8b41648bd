"""The tiny model's warm start: an early stop at a probe accuracy, so every seed starts RL at the same
point of its learning curve rather than after a fixed step count."""

import copy

import pytest
import torch

from tidal.config import TinyModelConfig, config_from_dict
from tidal.data import load_dataset
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.demo.warm_start import answer_batcher, prepare_base_model, supervised_warm_start


def tiny_model():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    return build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok), tok


def test_the_warm_start_stops_at_the_first_probe_that_reaches_the_accuracy(tiny_config):
    model, tok = tiny_model()
    readings = iter([0.0, 0.1, 0.35, 0.9])
    probed_in_eval_mode = []

    def probe() -> float:
        probed_in_eval_mode.append(not model.training)
        return next(readings)

    problems = load_dataset(tiny_config.data, 0).train
    result = supervised_warm_start(
        model, answer_batcher(tok, problems), len(problems), 100, 8, 3e-3, 0, probe=probe, probe_every=5, stop_at_accuracy=0.3
    )
    assert (result.steps, result.probe_accuracy) == (15, 0.35)
    assert probed_in_eval_mode == [True, True, True] and not model.training


def test_without_a_target_the_warm_start_runs_every_step(tiny_config):
    model, tok = tiny_model()
    problems = load_dataset(tiny_config.data, 0).train
    result = supervised_warm_start(model, answer_batcher(tok, problems), len(problems), 12, 8, 3e-3, 0, probe=lambda: 1.0, probe_every=5)
    assert result.steps == 12 and result.probe_accuracy is None


@pytest.mark.parametrize("target", [0.05, None])
def test_prepare_base_model_caches_the_early_stopped_model_under_its_own_key(tiny_config_dict, tmp_path, target):
    data = copy.deepcopy(tiny_config_dict)
    data["model"]["warm_start"].update(cache_dir=str(tmp_path), steps=60, probe_every=20, probe_prompts=32, stop_at_accuracy=target)
    cfg = config_from_dict(data)
    path = prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed))
    assert (path / "config.json").is_file() and len(list((tmp_path / "warm-start").iterdir())) == 1
    assert prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed)) == path  # cached
