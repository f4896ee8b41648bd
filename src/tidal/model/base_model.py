"""The run's base model and reward model as the config names them: a Hugging Face model (model.name_or_path,
serve.model) as it is, else the demo's tiny model, its warm start and the built-in reward model, built once and
cached (tidal.demo). The one module of the runtime that reaches into the demo package."""

from __future__ import annotations

from pathlib import Path

from tidal.config import TidalConfig


def prepare_base_model(cfg: TidalConfig, dataset, progress=None) -> Path | str:
    """The weights RL starts from: model.name_or_path, or the tiny model's cached warm start (built once;
    `progress(step, total, loss)` follows its SFT)."""
    if cfg.model.name_or_path:
        return cfg.model.name_or_path
    from tidal.demo.warm_start import prepare_base_model as warm_start

    return warm_start(cfg, dataset, progress)


def tiny_tokenizer(arch: str = "qwen2"):
    """The tiny model's tokenizer (one token per character, and Qwen2-VL's vision tokens for `qwen2_vl`), built without the model."""
    if arch == "qwen2_vl":
        from tidal.demo.vision import build_vision_tokenizer

        return build_vision_tokenizer()
    from tidal.demo.tiny import build_char_tokenizer

    return build_char_tokenizer()


def prepare_reward_model(cfg: TidalConfig, base_model: str | Path) -> Path:
    """The built-in reward model of a `serve:` entry without `serve.model`: trained from the run's base, cached."""
    from tidal.demo.reward_model import prepare_reward_model as built_in

    return built_in(cfg, base_model)
