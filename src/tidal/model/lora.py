"""LoRA through peft: wrapping a model, and the adapter's tensors and config as the weight store keeps them."""

from __future__ import annotations

import copy

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


def adapter_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names peft's `save_pretrained` writes (no adapter name); from
    `state` (the model's own keys, e.g. the trainable parameters gathered over ranks) when given, else
    from the model's state dict."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model, state_dict=state).items()}


def adapter_keys(model: torch.nn.Module) -> dict[str, str]:
    """peft's file name of each adapter tensor -> the model's own parameter name (with the adapter name)."""
    from peft import get_peft_model_state_dict

    names = [name for name, _ in model.named_parameters()]
    tagged = {name: torch.tensor(i) for i, name in enumerate(names)}
    return {key: names[int(index)] for key, index in get_peft_model_state_dict(model, state_dict=tagged).items()}


OLD_ADAPTER = "old"


def add_old_adapter(model: torch.nn.Module) -> None:
    """A second, frozen adapter beside the trained one, for the old (proximal) policy: a copy of the
    adapter alone, the base shared. Its values are set from the trained adapter at every iteration
    (`adapter_pairs`); peft leaves the active adapter as it was and the new one without gradients."""
    model.add_adapter(OLD_ADAPTER, copy.deepcopy(model.peft_config["default"]))
    model.set_adapter("default")  # the trained adapter stays the active, trainable one
    for name, p in model.named_parameters():
        if f".{OLD_ADAPTER}." in name:
            p.requires_grad_(False)


def adapter_pairs(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(old adapter's parameter, trained adapter's parameter) for every tensor of the adapter."""
    params = dict(model.named_parameters())
    return [(params[name], params[name.replace(f".{OLD_ADAPTER}.", ".default.")]) for name in params if f".{OLD_ADAPTER}." in name]


class AdapterForward:
    """`model` computing with one of its adapters instead of the active one (peft's `adapter_names`
    forward argument, which needs eval mode), for no-grad forward passes: the old policy under LoRA."""

    def __init__(self, model: torch.nn.Module, adapter: str):
        self.model, self.adapter = model, adapter

    def __call__(self, **kwargs):
        training = self.model.training
        self.model.eval()
        try:
            return self.model(**kwargs, adapter_names=[self.adapter] * kwargs["input_ids"].shape[0])
        finally:
            self.model.train(training)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


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
