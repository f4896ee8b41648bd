"""Tiny causal LMs of the families the trainer and the HF engine cover, random weights from a fixed seed."""

import torch
import transformers


def tiny_causal_lm(family: str, vocab_size: int, **extra) -> torch.nn.Module:
    """family: qwen2, qwen2-mha (as many key/value heads as query heads: no grouped-query attention),
    qwen3 or llama; `extra`: more config fields. float32, eval mode."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **extra,
    )
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "qwen2-mha":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**common, "num_key_value_heads": 4}))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.float().eval()
