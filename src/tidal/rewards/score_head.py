"""A reward model must have a trained score head: transformers loads a causal LM's directory as a
sequence classifier with a randomly initialised head, silently, and its rewards would be noise."""

from __future__ import annotations

import json
from pathlib import Path


class NoScoreHeadError(ValueError):
    """A reward model directory whose weights hold no trained score head (e.g. a causal LM's)."""


def check_score_head(model_dir: str | Path, missing_keys: list[str]) -> None:
    """transformers gives a sequence-classification model whose checkpoint lacks the head a randomly
    initialised one, silently: its rewards would be noise. Any weight the checkpoint lacks is refused."""
    if missing_keys:
        shown = ", ".join(sorted(missing_keys)[:4]) + (", ..." if len(missing_keys) > 4 else "")
        raise NoScoreHeadError(
            f"{model_dir} has no trained score head: its weights lack {shown} (a causal LM's checkpoint, not a reward model); "
            "give a directory saved from an AutoModelForSequenceClassification trained as a reward model"
        )


def architecture_without_score_head(model_dir: str | Path) -> str | None:
    """The architecture config.json names when it is not a sequence classifier (e.g. Qwen2ForCausalLM):
    read before any weight loads, so a run is refused within seconds. None when it is one or names none."""
    try:
        names = json.loads(Path(model_dir, "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None  # unreadable here: loading it says what is wrong
    if names and not any(str(n).endswith("ForSequenceClassification") for n in names):
        return ", ".join(map(str, names))
    return None
