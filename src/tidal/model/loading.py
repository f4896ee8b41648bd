"""One loading path for every model: an HF directory or hub id (the tiny warm start is one too)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedTokenizerFast

from tidal.logs import quiet_transformers

log = logging.getLogger(__name__)
quiet_transformers()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model or tokenizer (model.name_or_path) cannot be loaded: not there, no hub access, not a model."""


@contextlib.contextmanager
def _loading(path: str | Path, what: str):
    try:
        yield
    except (OSError, ValueError) as err:  # transformers: OSError for missing files or no hub, ValueError for broken ones
        reason = "no such directory" if is_missing_local_path(path) else str(err)
        raise ModelLoadError(f"cannot load the {what} of {str(path)!r} (model.name_or_path): {reason}") from None


def is_missing_local_path(path: str | Path) -> bool:
    """A path that cannot be a hub id (`org/name`): absolute, `./`, `../`, `~`, or several folders deep, and
    not there. transformers tries such a value as a hub id and reports that it is not a valid one."""
    text = str(path)
    local = Path(text).is_absolute() or text.startswith(("./", "../", "~")) or text.count("/") > 1
    return local and not Path(text).expanduser().exists()


def load_tokenizer(path: str | Path):
    """AutoTokenizer, except for a plain `tokenizers` tokenizer (ours): AutoTokenizer would pick the
    model type's tokenizer class (e.g. Qwen2Tokenizer) and replace its pre-tokenizer."""
    config = Path(path) / "tokenizer_config.json"
    with _loading(path, "tokenizer"):
        if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(path: str | Path, dtype: str = "float32"):
    tokenizer = load_tokenizer(path)
    return load_model(path, dtype), tokenizer


def load_model(path: str | Path, dtype: str = "float32"):
    """The model alone, for a process that holds its tokenizer already."""
    with _loading(path, "model"):
        config = AutoConfig.from_pretrained(str(path))
        auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
        return auto.from_pretrained(str(path), dtype=DTYPES[dtype])


def load_state_dict_tied(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads a snapshot saved without tied aliases; anything else missing is an error."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    really_missing = [k for k in missing if not (tied and "lm_head" in k)]
    if unexpected or really_missing:
        raise ValueError(f"weights do not fit the model: missing {really_missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
