"""One decode step of the HF engine without the transformers forward around it.

A decode step is one new token per row over the rows' KV cache. For a small model on a CPU, the
transformers forward spends a good part of that step building a 4-D mask, wrapping outputs and
dispatching through its layers' generic code; `DecodeStep` calls the same modules (embeddings, norms,
projections, rotary embedding, MLP, head) in the same order and does only the attention itself: the
rows' query against their cached keys and values, grouped-query heads read in place (no repeated
keys), padding hidden by an additive mask built once per step. The cache is the engine's own
(tidal.rollout.kv_slots), written through its layers' `update` as the transformers forward writes it.

A step of a small model costs more in the number of operations than in arithmetic, so where the layers
are plain (no adapter) and small, a layer's query, key and value projections run as one matrix product,
its gate and up projections as another, its norms through torch's `rms_norm` and the rotation of its
queries and keys as one. The fused matrices are copies (at most `FUSED_COPY_BYTES`: a large model's
step is arithmetic, and its memory is better spent on the cache) of the weights the model holds when
the step is made: the engine makes one per call, and a new one when a call's rows go on with newer
weights (`HFRows.reload`).

It covers the decoder-only families whose layers are exactly that (Llama, Qwen2, Qwen3: `FAMILIES`),
plain or under a peft adapter, with full attention in every layer; `DecodeStep.of` returns None for
anything else (sliding windows, vision towers, sharded or hooked modules), and the engine keeps the
transformers forward there. Joins (rows coming back to the decode batch with their inserted tokens,
several a row) take the same forward, causal over their new tokens; prefills keep the transformers forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (causal LM class, decoder layer class) of the families whose decode step this module computes
FAMILIES = {
    "LlamaForCausalLM": "LlamaDecoderLayer",
    "Qwen2ForCausalLM": "Qwen2DecoderLayer",
    "Qwen3ForCausalLM": "Qwen3DecoderLayer",
}


def grouped_query_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """query [rows, heads, tokens, dim] against keys/values [rows, kv_heads, slots, dim]; query head h reads kv
    head h // (heads / kv_heads), as transformers' `repeat_kv` arranges them. bias [rows, 1, tokens, slots]:
    0 where a slot is attended, -inf where it is not. Returns [rows, tokens, heads * dim].
    In float32 on a CPU two matrix products and a softmax (torch's fused CPU kernel works in blocks of
    queries, and a query or a few a row leave it slower); elsewhere torch's fused attention, which keeps
    float32 accumulators for a bfloat16 model as transformers' forward does."""
    rows, heads, tokens, dim = query.shape
    if query.device.type != "cpu" or query.dtype != torch.float32:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).reshape(rows, tokens, heads * dim)
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    grouped = query.reshape(rows, kv_heads, group * tokens, dim)  # a kv head's query heads one after another
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scaling)
    scores = scores.view(rows, kv_heads, group, tokens, slots).add_(bias[:, :, None]).view(rows, kv_heads, group * tokens, slots)
    out = torch.matmul(torch.softmax(scores, dim=-1), values).view(rows, heads, tokens, dim)
    return out.transpose(1, 2).reshape(rows, tokens, heads * dim)


def padding_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, slots] of 1 (a token) / 0 (padding) as the additive attention mask [rows, 1, 1, slots]."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, float("-inf"))[:, None, None, :]


def attention_bias(mask: torch.Tensor, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [rows, 1, tokens, slots] of `tokens` new tokens a row, the last `tokens` of the
    mask's slots: padding hidden from every token, and each new token's later ones hidden from it."""
    bias = padding_bias(mask, dtype)
    if tokens == 1:
        return bias
    later = torch.full((tokens, tokens), float("-inf"), dtype=dtype, device=mask.device).triu(1)
    bias = bias.expand(-1, -1, tokens, -1).clone()
    bias[..., -tokens:] += later
    return bias


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


# the norms whose forward is exactly torch's RMSNorm over the last dimension (weight * x / rms(x), in float32)
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
SILU = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' (`hidden_act: silu`)
FUSED_COPY_BYTES = 64 * 2**20


def fusable(lm) -> bool:
    """True where every layer is plain (torch Linear projections, no adapter; a SiLU-gated MLP; `RMS_NORMS`)
    and the fused copies of its projections take at most FUSED_COPY_BYTES."""
    copies = sum(t.numel() * t.element_size() for layer in lm.model.layers for t in fused_weights(layer))
    if copies > FUSED_COPY_BYTES:
        return False
    for layer in lm.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not torch.nn.Linear for m in linears) or type(mlp.act_fn).__name__ not in SILU:
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *(getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n))]
        if any(type(n).__name__ not in RMS_NORMS for n in norms):
            return False
    return type(lm.model.norm).__name__ in RMS_NORMS


def rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)


@dataclass(frozen=True)
class FusedLayer:
    qkv_weight: torch.Tensor  # [q + k + v outputs, hidden]
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor  # [2 x intermediate, hidden]

    @classmethod
    def of(cls, layer) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = None
        if any(p.bias is not None for p in projections):
            bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections])
        return cls(torch.cat([p.weight for p in projections]), bias, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))


def fused_weights(layer) -> list[torch.Tensor]:
    """The weights and biases a layer's fused matrices copy."""
    attn, mlp = layer.self_attn, layer.mlp
    modules = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    return [t for m in modules for t in (m.weight, m.bias) if t is not None]


class DecodeStep:
    """The logits of one decode step ([rows, vocab]) from the rows' next tokens, their attention mask
    (every slot of the cache and the new one) and positions; the cache gets the step's keys and values.
    `join_logits` is the same forward over several new tokens a row (rows joining the decode batch with
    their inserted tokens)."""

    def __init__(self, model):
        lm = causal_lm(model)
        self.inner, self.head = lm.model, lm.lm_head
        first = self.inner.layers[0].self_attn
        family = inspect.getmodule(type(first))
        self.rotate, self.rotate_half = family.apply_rotary_pos_emb, family.rotate_half
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.heads = lm.config.num_attention_heads
        self.kv_heads = getattr(lm.config, "num_key_value_heads", None) or self.heads
        self.fused = [FusedLayer.of(layer) for layer in self.inner.layers] if fusable(lm) else None

    @classmethod
    def of(cls, model) -> DecodeStep | None:
        return cls(model) if unsupported(model) is None else None

    @property
    def fusable(self) -> bool:
        return self.fused is not None

    def logits(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        return self.head(self.hidden_states(input_ids, mask, positions, cache)[:, -1])

    def join_logits(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, last: torch.Tensor) -> torch.Tensor:
        """input_ids [rows, tokens] (right-padded; `mask` ends with their slots, 0 on the padding): the logits
        [rows, vocab] after each row's token at `last`."""
        hidden = self.hidden_states(input_ids, mask, positions, cache)
        return self.head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])

    def hidden_states(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The last layer's normalised hidden states [rows, tokens, hidden] of the rows' new tokens."""
        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, positions)
        bias = attention_bias(mask, input_ids.shape[1], hidden.dtype)
        if self.fusable:
            return self._fused_hidden_states(hidden, cos, sin, bias, cache)
        for index, layer in enumerate(self.inner.layers):
            hidden = hidden + self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, bias, cache.layers[index])
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.inner.norm(hidden)

    def _fused_hidden_states(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor, cache) -> torch.Tensor:
        (rows, tokens, _), heads, kv_heads, dim = hidden.shape, self.heads, self.kv_heads, self.head_dim
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [rows, tokens, 1 (every head), dim]
        for index, (layer, fused) in enumerate(zip(self.inner.layers, self.fused, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = F.linear(rms_norm(layer.input_layernorm, hidden), fused.qkv_weight, fused.qkv_bias)
            qkv = qkv.view(rows, tokens, heads + 2 * kv_heads, dim)
            query_key, value = qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads :]
            if hasattr(attn, "q_norm"):  # Qwen3: each head normalised before the rotation
                query_key = torch.cat([rms_norm(attn.q_norm, query_key[:, :, :heads]), rms_norm(attn.k_norm, query_key[:, :, heads:])], dim=2)
            query_key = query_key * cos + self.rotate_half(query_key) * sin
            keys, values = cache.layers[index].update(query_key[:, :, heads:].transpose(1, 2), value.transpose(1, 2))
            attended = grouped_query_attention(query_key[:, :, :heads].transpose(1, 2), keys, values, bias, self.scaling)
            hidden = hidden + attn.o_proj(attended)
            gate, up = F.linear(rms_norm(layer.post_attention_layernorm, hidden), fused.gate_up_weight).chunk(2, dim=-1)
            hidden = hidden + mlp.down_proj(F.silu(gate) * up)
        return rms_norm(self.inner.norm, hidden)

    def _attention(self, attn, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor, cache_layer) -> torch.Tensor:
        shape = (*hidden.shape[:2], -1, self.head_dim)
        query, key = attn.q_proj(hidden).view(shape), attn.k_proj(hidden).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: each head normalised before the rotation
            query, key = attn.q_norm(query), attn.k_norm(key)
        query, key = self.rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        keys, values = cache_layer.update(key, attn.v_proj(hidden).view(shape).transpose(1, 2))
        return attn.o_proj(grouped_query_attention(query, keys, values, bias, self.scaling))
