"""A tiny causal LM and a character tokenizer built locally: nothing comes from a hub."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tidal.config import TinyModelConfig
from tidal.model.templates import TOOL_CHAT_TEMPLATE  # noqa: F401 - the tiny model's, where the demo's users look

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]

CHARACTERS = [c for c in string.printable if c not in "\r\x0b\x0c"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast):
    # the model classes here, not at the top: the checks before a run only need the tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if cfg.arch == "qwen2_vl":
        raise ValueError("model.tiny.arch 'qwen2_vl' is built by tidal.demo.vision.build_tiny_vlm (with its processor's tokenizer)")
    if cfg.arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(**common))
