"""examples/agent-qwen.yaml (Qwen2.5-1.5B-Instruct, vLLM, a GPU: it cannot run here) and the path a
real model's turns take: tidal.rollout.agent renders with `tokenizer.apply_chat_template(messages,
tools=...)`. The tokenizer here is a small byte-level BPE built on the spot, with Qwen's special
tokens and Qwen2.5-Instruct's real chat template (tests/data/qwen2.5-instruct-chat-template.jinja,
see tests/data/README.md), saved as a tokenizer directory and named as model.name_or_path."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tidal.config import load_config
from tidal.envs import EnvError
from tidal.envs.parsing import ToolCall, hermes
from tidal.model.loading import load_tokenizer
from tidal.protocol import WorkItem
from tidal.rewards import RewardScorer
from tidal.rollout.agent import AgentLoop
from tidal.rollout.engine import GroupRequest
from tidal.rollout.trajectory import Turn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "agent-qwen.yaml"
QWEN25_TEMPLATE = Path(__file__).parent / "data" / "qwen2.5-instruct-chat-template.jinja"
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>'


def build_qwen_like_tokenizer(path: Path, eos: str = "<|im_end|>") -> Path:
    """A byte-level BPE trained on a few lines, Qwen's three special tokens, Qwen2.5-Instruct's chat
    template and, as in Qwen2.5-Instruct's tokenizer_config.json, eos <|im_end|> and pad <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [QWEN25_TEMPLATE.read_text(), CALL, "Compute 12*34=\nUse the calc tool.", "#### 408", "<tool_response>\n408\n</tool_response>"]
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>", chat_template=QWEN25_TEMPLATE.read_text())
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return build_qwen_like_tokenizer(tmp_path_factory.mktemp("qwen25"))


@pytest.fixture
def agent(qwen_dir):
    cfg = load_config(EXAMPLE, [f"model.name_or_path={qwen_dir}"])
    loop = AgentLoop.from_config(cfg, load_tokenizer(qwen_dir), cfg.rollout.vllm.max_model_len)
    yield loop
    loop.close()


def text(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_the_example_is_an_agent_run_of_a_hub_instruct_model_on_vllm_evaluated_on_hf():
    cfg = load_config(EXAMPLE)
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.rollout.engine == "vllm"
    assert (cfg.rollout.agent.env, cfg.rollout.agent.tools, cfg.data.operations, cfg.data.max_digits) == ("tools", ["calc"], ["*"], 3)
    assert cfg.eval.enabled and cfg.eval.engine == "hf"
    with pytest.raises(Exception, match="set eval.engine: hf"):  # the rule the example follows
        load_config(EXAMPLE, ["eval.engine=rollout"])
    # the final turn its instruction asks for is what the rewards read
    scorer = RewardScorer.from_config(cfg.reward)
    assert scorer.score("12*34 = 408.\n#### 408", "408")[0] == pytest.approx(1.1)


def test_the_prompt_is_qwens_system_prompt_with_the_tool_schema_then_the_problem(agent):
    tok = agent.tokenizer
    assert agent.chat_template is None  # a named model renders with its tokenizer's own template
    rendered = text(tok, agent.first_prompt(WorkItem(0, 0, "12*34=", "408")))
    head, rest = rendered.split("<tools>\n", 1)
    schemas, tail = rest.split("\n</tools>", 1)
    assert (
        head
        == f"<|im_start|>system\n{QWEN_SYSTEM}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    )
    (schema,) = [json.loads(line) for line in schemas.splitlines()]
    assert schema == agent.factory().tool_schemas[0] and schema["function"]["name"] == "calc"
    assert "expression" in schema["function"]["parameters"]["properties"]
    assert tail == (
        "\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\nCompute 12*34=\nUse the calc tool. End your answer with the line "#### <number>".<|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_a_qwen_tool_call_parses_into_a_calc_call(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    assert getattr(tok, "response_template", None) is None  # Qwen2.5's tokenizer has none: the regex parser reads it
    turn = hermes(CALL, tokenizer=tok)
    assert turn.calls == [ToolCall("calc", {"expression": "12*34"})] and not turn.errors and turn.content == ""
    turn = hermes(f"I will use the tool.\n{CALL}", tokenizer=tok)
    assert turn.calls == [ToolCall("calc", {"expression": "12*34"})] and turn.content == "I will use the tool."


def play(agent, turns: list[str]):
    """One trajectory of scripted assistant turns (each ends with the EOS the engine samples): the
    prompt, every token after it with its loss mask, and the row."""
    tok = agent.tokenizer
    request = GroupRequest(prompt_ids=[], n=1)
    call = agent.begin([agent.problem(WorkItem(0, 0, "12*34=", "408"))], [request])
    tokens, mask = [], []
    for i, turn_text in enumerate(turns):
        ids = tok(turn_text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        tokens += ids
        mask += [1] * len(ids)
        inserted = asyncio.run(call.respond(0, Turn(ids, [0.0] * len(ids), "stop")))
        if inserted is None:
            assert i == len(turns) - 1
            break
        tokens += inserted
        mask += [0] * len(inserted)
    return request.prompt_ids, tokens, mask, call.rows[0]


def test_a_tool_result_is_inserted_as_qwens_user_turn_of_tool_responses_with_mask_0(agent):
    tok = agent.tokenizer
    prompt, tokens, mask, row = play(agent, [CALL, "12*34 = 408.\n#### 408"])
    sampled = [t for t, m in zip(tokens, mask) if m]
    inserted = [t for t, m in zip(tokens, mask) if not m]
    # what the template renders between the sampled <|im_end|> and the next assistant header
    assert text(tok, inserted) == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert text(tok, sampled) == f"{CALL}<|im_end|>12*34 = 408.\n#### 408<|im_end|>"
    assert row.env.stats.tool_calls == 1 and row.env.stats.tool_errors == 0
    assert [m["role"] for m in row.messages] == ["user", "assistant", "tool", "assistant"]
    # the trajectory is token for token what the template renders for the whole chat (less the
    # newline after the last turn's <|im_end|>): the model trains on what it will be shown
    whole = tok.apply_chat_template(row.messages, tools=row.env.tool_schemas, tokenize=True, return_dict=False)
    assert list(whole) == prompt + tokens + tok("\n", add_special_tokens=False).input_ids
    assert row.final_text == "12*34 = 408.\n#### 408"


def test_two_calls_in_one_turn_are_one_user_turn_of_two_tool_responses(agent):
    tok = agent.tokenizer
    two = CALL + "\n" + CALL.replace("12*34", "1+")
    _, tokens, mask, row = play(agent, [two, "#### 408"])
    inserted = [t for t, m in zip(tokens, mask) if not m]
    rendered = text(tok, inserted)
    assert rendered.startswith("\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\nerror: ")
    assert rendered.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n") and rendered.count("<|im_start|>") == 2
    assert row.env.stats.tool_calls == 2 and row.env.stats.tool_errors == 1


def test_a_tokenizer_whose_eos_is_not_the_end_of_an_assistant_turn_is_refused(tmp_path):
    """Qwen2.5-Instruct's tokenizer_config.json says eos <|im_end|>, the token that ends its turns. A
    tokenizer that says <|endoftext|> (a base model's) would let no turn end where the template's
    next turn starts: the loop refuses it when it is built, not at the first tool call."""
    path = build_qwen_like_tokenizer(tmp_path, eos="<|endoftext|>")
    cfg = load_config(EXAMPLE, [f"model.name_or_path={path}"])
    with pytest.raises(EnvError, match="does not end an assistant turn with the tokenizer's EOS token"):
        AgentLoop.from_config(cfg, load_tokenizer(path))
