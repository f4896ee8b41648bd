"""LoRA through peft: wrapping a model, and the adapter's tensors and config as the weight store keeps them."""

from __future__ import annotations

import torch

from tidal.config import LoraConfig


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """`model` wrapped by peft: its own weights frozen, the adapter (and `modules_to_save`) trainable.
    The adapter's B starts at zero, so the wrapped model computes exactly the base model; its random A
    is drawn from `seed` alone (not the process's RNG), so every process of a run starts alike."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        modules_to_save=list(cfg.modules_to_save) if cfg.modules_to_save else None,
        task_type="CAUSAL_LM",
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(model, peft_cfg)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules {list(cfg.target_modules)}: {str(err).splitlines()[0]}") from None


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names peft's `save_pretrained` writes (no adapter name)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model).items()}


def adapter_config(model: torch.nn.Module, base_model: str | None) -> dict:
    """adapter_config.json as peft's `save_pretrained` writes it, naming the base it sits on."""
    cfg = model.peft_config["default"]
    out = cfg.to_dict()
    out["base_model_name_or_path"] = base_model
    out["inference_mode"] = True  # as save_pretrained writes it
    for key, value in list(out.items()):
        if isinstance(value, set):  # target_modules: json has no sets
            out[key] = sorted(value)
    return out


def load_adapter_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Sets the adapter's tensors in place (the base stays as loaded); a tensor that does not fit is a ValueError."""
    from peft import set_peft_model_state_dict

    expected = set(adapter_state_dict(model))
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"the adapter does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        set_peft_model_state_dict(model, state)
