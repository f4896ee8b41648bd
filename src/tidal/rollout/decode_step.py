"""One decode step of the HF engine without the transformers forward around it.

A decode step is one new token per row over the rows' KV cache. For a small model on a CPU, the
transformers forward spends a good part of that step building a 4-D mask, wrapping outputs and
dispatching through its layers' generic code; `DecodeStep` calls the same modules (embeddings, norms,
projections, rotary embedding, MLP, head) in the same order and does only the attention itself: the
rows' query against their cached keys and values, grouped-query heads read in place (no repeated
keys), padding hidden by an additive mask built once per step. The cache is the engine's own
(tidal.rollout.kv_slots), written through its layers' `update` as the transformers forward writes it.

It covers the decoder-only families whose layers are exactly that (Llama, Qwen2, Qwen3: `FAMILIES`),
plain or under a peft adapter, with full attention in every layer; `DecodeStep.of` returns None for
anything else (sliding windows, vision towers, sharded or hooked modules), and the engine keeps the
transformers forward there. Prefills and joins (several tokens a row) always take the transformers forward.
"""

from __future__ import annotations

import inspect

import torch

# (causal LM class, decoder layer class) of the families whose decode step this module computes
FAMILIES = {
    "LlamaForCausalLM": "LlamaDecoderLayer",
    "Qwen2ForCausalLM": "Qwen2DecoderLayer",
    "Qwen3ForCausalLM": "Qwen3DecoderLayer",
}


def grouped_query_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """One query token per row: query [rows, heads, 1, dim] against keys/values [rows, kv_heads, slots, dim];
    query head h reads kv head h // (heads / kv_heads), as transformers' `repeat_kv` arranges them.
    bias [rows, 1, 1, slots]: 0 where a slot is attended, -inf where it is padding. Returns [rows, 1, heads * dim].
    In float32 on a CPU two matrix products and a softmax (torch's fused CPU kernel works in blocks of
    queries, and one query a row leaves it slower); elsewhere torch's fused attention, which keeps float32
    accumulators for a bfloat16 model as transformers' forward does."""
    rows, heads, _, dim = query.shape
    if query.device.type != "cpu" or query.dtype != torch.float32:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).reshape(rows, 1, heads * dim)
    kv_heads = keys.shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scaling).add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), values).reshape(rows, 1, heads * dim)


def padding_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, slots] of 1 (a token) / 0 (padding) as the additive attention mask [rows, 1, 1, slots]."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, float("-inf"))[:, None, None, :]


def causal_lm(model):
    """The transformers causal LM inside `model` (a peft model's base), else `model`."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def unsupported(model) -> str | None:
    """Why `DecodeStep` cannot compute `model`'s decode step (None: it can)."""
    lm = causal_lm(model)
    layer_class = FAMILIES.get(type(lm).__name__)
    if layer_class is None:
        return f"{type(lm).__name__} is not one of {sorted(FAMILIES)}"
    inner = getattr(lm, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or any(type(layer).__name__ != layer_class for layer in layers):
        return f"its layers are not all {layer_class}"
    if len(layers) != lm.config.num_hidden_layers:
        return "it runs fewer layers than it holds"
    layer_types = set(getattr(lm.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or any(getattr(layer.self_attn, "sliding_window", None) for layer in layers):
        return "a layer has a sliding window"
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{type(module).__name__} has forward hooks"
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            return "its parameters are sharded"
    return None


class DecodeStep:
    """The logits of one decode step ([rows, vocab]) from the rows' next tokens, their attention mask
    (every slot of the cache and the new one) and positions; the cache gets the step's keys and values."""

    def __init__(self, model):
        lm = causal_lm(model)
        self.inner, self.head = lm.model, lm.lm_head
        first = self.inner.layers[0].self_attn
        self.rotate = inspect.getmodule(type(first)).apply_rotary_pos_emb
        self.head_dim, self.scaling = first.head_dim, first.scaling

    @classmethod
    def of(cls, model) -> DecodeStep | None:
        return cls(model) if unsupported(model) is None else None

    def logits(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, positions)
        bias = padding_bias(mask, hidden.dtype)
        for index, layer in enumerate(self.inner.layers):
            hidden = hidden + self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, bias, cache.layers[index])
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.head(self.inner.norm(hidden))[:, -1, :]

    def _attention(self, attn, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor, cache_layer) -> torch.Tensor:
        shape = (hidden.shape[0], 1, -1, self.head_dim)
        query, key = attn.q_proj(hidden).view(shape), attn.k_proj(hidden).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: each head normalised before the rotation
            query, key = attn.q_norm(query), attn.k_norm(key)
        query, key = self.rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        keys, values = cache_layer.update(key, attn.v_proj(hidden).view(shape).transpose(1, 2))
        return attn.o_proj(grouped_query_attention(query, keys, values, bias, self.scaling))
