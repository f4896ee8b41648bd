"""What the model sees: data.prompt_template, the tokenizer's chat template, a system prompt; the same
prompt ids in workers (generate_groups), sync mode and eval."""

import pytest
import torch

from tidal.config import ConfigError, DataConfig, TinyModelConfig, config_from_dict
from tidal.data import DatasetError, Problem, prompt_encoder, render_prompt
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.evaluate import held_out_accuracy
from tidal.protocol import WorkItem
from tidal.rewards import RewardScorer
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import generate_groups

CHATML = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


def chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    return tok


def data_cfg(**kw) -> DataConfig:
    return config_from_dict({"data": kw}).data


@pytest.mark.parametrize(
    "template, message",
    [
        ("Solve: {question}", r"exactly once and no other field, found \['question'\]"),
        ("{prompt} and {prompt}", r"exactly once"),
        ("no field at all", r"found \[\]"),
        ("{prompt} then a stray {", r"not a valid template"),
    ],
)
def test_a_bad_prompt_template_is_named(template, message):
    with pytest.raises(ConfigError, match=rf"data.prompt_template.*{message}|{message}"):
        config_from_dict({"data": {"prompt_template": template}})


def test_a_system_prompt_needs_the_chat_template():
    with pytest.raises(ConfigError, match=r"data.system_prompt needs data.chat_template: true"):
        config_from_dict({"data": {"system_prompt": "Be brief."}})


def test_literal_braces_survive_the_template():
    assert render_prompt("1+2=", data_cfg(prompt_template="{{x}} {prompt}")) == "{x} 1+2="


def test_chat_messages_carry_the_system_prompt_and_the_templated_question():
    cfg = data_cfg(prompt_template="{prompt}Answer after ####.", chat_template=True, system_prompt="Be brief.")
    assert render_prompt("What is 2+2?\n", cfg) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?\nAnswer after ####."},
    ]


def test_plain_encoding_is_the_tokenizer_on_the_templated_text():
    tok = build_char_tokenizer()
    encode = prompt_encoder(tok, data_cfg(prompt_template="Q: {prompt}"))
    assert encode("1+2=") == tok("Q: 1+2=", add_special_tokens=False).input_ids


def test_chat_encoding_applies_the_tokenizers_template():
    tok = chat_tokenizer()
    ids = prompt_encoder(tok, data_cfg(chat_template=True, system_prompt="S"))("1+2=\n")
    assert tok.decode(ids) == "<|system|>S\n<|user|>1+2=\n<|assistant|>"


def test_a_tokenizer_without_a_chat_template_is_named():
    with pytest.raises(DatasetError, match=r"data.chat_template is true but the tokenizer .* has no chat template"):
        prompt_encoder(build_char_tokenizer(), data_cfg(chat_template=True))


def test_workers_and_eval_generate_from_the_same_chat_prompt():
    cfg = config_from_dict({"data": {"chat_template": True}, "rollout": {"group_size": 2, "max_new_tokens": 3}})
    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok).eval()
    engine = HFEngine.for_rollout(model, tok, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    problem = Problem(3, "12+7=", "19")
    (group,) = generate_groups(
        engine, tok, RewardScorer.from_config(cfg.reward), [WorkItem(0, problem.id, problem.prompt, problem.answer)], cfg, version=0, worker_id="w0"
    )
    assert tok.decode(group.prompt_ids.tolist()) == "<|user|>12+7=\n<|assistant|>"

    seen = []

    class Recording:
        def generate(self, requests, greedy=False, max_new_tokens=None):
            seen.extend(r.prompt_ids for r in requests)
            return engine.generate(requests, greedy, max_new_tokens)

    held_out_accuracy(Recording(), tok, [problem], encode=prompt_encoder(tok, cfg.data))
    assert seen == [group.prompt_ids.tolist()]


def test_the_warm_start_trains_on_the_prompts_rl_will_use():
    from tidal.demo.warm_start import sft_batch

    tok = build_char_tokenizer()
    encode = prompt_encoder(tok, data_cfg(prompt_template="Q {prompt}"))
    ids, mask, labels = sft_batch(tok, [Problem(0, "1+2=", "3")], encode)
    prompt = encode("1+2=")
    assert ids[0, : len(prompt)].tolist() == prompt
    assert (labels[0, : len(prompt)] == -100).all() and tok.decode(labels[0, len(prompt) : int(mask[0].sum())].tolist()) == "A: 3<eos>"
