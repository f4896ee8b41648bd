"""Thinking models, token-exact: examples/agent-qwen3.yaml (Qwen3-1.7B, vLLM, a GPU: it cannot run here)
and the path its turns take with Qwen3's real chat template (tests/data/qwen3-chat-template.jinja, see
tests/data/README.md) on a small tokenizer built here, with Qwen3's special and added tokens. That
template is not append-only: rendering a chat, it drops the reasoning of assistant turns before the last
user message and writes an empty reasoning block into a last turn that has none. A trajectory is never
re-rendered: the tokens trained are the tokens the engine sampled and the tokens inserted after each
turn, turn by turn, which is what the policy saw."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import torch

from tidal.config import TrainerConfig, load_config
from tidal.envs import EnvError
from tidal.model.loading import load_tokenizer
from tidal.protocol import WorkItem, decode_group, pack
from tidal.rewards import RewardScorer
from tidal.roles import group_limits
from tidal.rollout.agent import _BASE, AgentLoop
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import generate_groups
from tidal.trainer.learner import Learner, as_packing_group

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "agent-qwen3.yaml"
QWEN3_TEMPLATE = Path(__file__).parent / "data" / "qwen3-chat-template.jinja"
QWEN3_TEMPLATE_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>'
ITEM = WorkItem(0, 0, "12*34=", "408")
# what the tiny policy is taught to sample: reasoning in every turn, a tool call, an answer, and a
# second answer after the user (tests.environments:Reviewed) asks for a check
TURNS = [
    "<think>\nI need the product.\n</think>\n\n" + CALL,
    "<think>\nThe tool says 408.\n</think>\n\n#### 408",
    "<think>\n12*34 is 408.\n</think>\n\n#### 408",
]
TOOL_RESULT = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
EMPTY_REASONING = "<think>\n\n</think>\n\n"


def build_qwen3_like_tokenizer(path: Path, template: str | None = None) -> Path:
    """A byte-level BPE trained on a few lines, with Qwen3's special tokens, its added (not special)
    tokens <think> </think> <tool_call> </tool_call> <tool_response> </tool_response>, Qwen3's chat
    template and, as in Qwen3's tokenizer_config.json, eos <|im_end|> and pad <|endoftext|>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    published = QWEN3_TEMPLATE.read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([published, CALL, "Compute 12*34=\nUse the calc tool.", *TURNS, "Check it once more."], trainer)
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
        ]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template or published)
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return build_qwen3_like_tokenizer(tmp_path_factory.mktemp("qwen3"))


def agent_loop(path: Path, *overrides: str, cls=AgentLoop) -> AgentLoop:
    cfg = load_config(EXAMPLE, [f"model.name_or_path={path}", *overrides])
    return cls.from_config(cfg, load_tokenizer(path), cfg.rollout.vllm.max_model_len)


def text(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_the_template_is_qwen3s_published_one():
    """Byte for byte the published template (tests/data/README.md says where it comes from)."""
    assert hashlib.sha256(QWEN3_TEMPLATE.read_bytes()).hexdigest() == QWEN3_TEMPLATE_SHA256


def test_the_example_is_a_thinking_model_on_vllm_and_passes_the_template_check(qwen3_dir):
    cfg = load_config(EXAMPLE)
    assert cfg.model.name_or_path == "Qwen/Qwen3-1.7B" and cfg.rollout.engine == "vllm" and cfg.eval.engine == "hf"
    assert (cfg.rollout.agent.env, cfg.rollout.agent.tools, cfg.rollout.agent.chat_template_kwargs) == ("tools", ["calc"], {})
    scorer = RewardScorer.from_config(cfg.reward)
    assert scorer.score("<think>\nok\n</think>\n\n12*34 = 408.\n#### 408", "408")[0] == pytest.approx(1.1)
    for overrides in ([], ["rollout.agent.chat_template_kwargs={enable_thinking: false}"]):
        loop = agent_loop(qwen3_dir, *overrides)  # the start-up check passes, in both modes
        try:
            assert loop.chat_template is None  # a named model renders with its tokenizer's own template
            prompt = text(loop.tokenizer, loop.first_prompt(ITEM))
            assert prompt.startswith("<|im_start|>system\n# Tools\n") and prompt.endswith(
                '<|im_start|>user\nCompute 12*34=\nUse the calc tool. End your answer with the line "#### <number>".<|im_end|>\n<|im_start|>assistant\n'
                + (EMPTY_REASONING if overrides else "")
            )
        finally:
            loop.close()


def test_template_variables_that_are_rendering_arguments_are_refused_by_name():
    with pytest.raises(Exception, match=r"\['add_generation_prompt', 'tools'\] are set by Tidal's own rendering, not template variables"):
        load_config(EXAMPLE, ["rollout.agent.chat_template_kwargs={tools: x, add_generation_prompt: false, enable_thinking: false}"])


def test_qwen3s_template_is_not_append_only(qwen3_dir):
    """What re-rendering frameworks trip on: a turn renders differently once messages follow it."""
    tok = load_tokenizer(qwen3_dir)
    alone = tok.apply_chat_template(_BASE, tokenize=False)
    followed = tok.apply_chat_template([*_BASE, {"role": "tool", "content": "t"}], tokenize=False)
    assert alone.endswith(f"<|im_start|>assistant\n{EMPTY_REASONING}a<|im_end|>\n")  # last: an empty reasoning block
    assert "<|im_start|>assistant\na<|im_end|>\n<|im_start|>user\n<tool_response>" in followed  # followed: none
    assert not followed.startswith(alone)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": TURNS[1]}, {"role": "user", "content": "Check it once more."}]
    assert "The tool says" not in tok.apply_chat_template(chat, tokenize=False)  # reasoning before the last query: dropped


@pytest.mark.parametrize("thinking", [True, False])
def test_a_tool_result_inserts_exactly_what_the_template_renders_after_the_unmodified_turn(qwen3_dir, thinking):
    """After the sampled <|im_end|>: the newline the template puts at the boundary, the tool result as a
    user turn of <tool_response>, and the generation prompt (enable_thinking: false closes an empty
    reasoning block). The whole chat, rendered, ends with the sampled turn as sampled, then exactly that."""
    loop = agent_loop(qwen3_dir, *([] if thinking else ["rollout.agent.chat_template_kwargs={enable_thinking: false}"]))
    try:
        tok, tools = loop.tokenizer, loop.factory().tool_schemas
        observation = [{"role": "tool", "content": "408"}]
        inserted = loop.inserted_tokens(observation, tools)
        assert text(tok, inserted) == TOOL_RESULT + ("" if thinking else EMPTY_REASONING)
        chat = [{"role": "user", "content": "Compute 12*34="}, {"role": "assistant", "content": TURNS[0]}, *observation]
        whole = loop.render(chat, tools, True)
        assert text(tok, whole).endswith(f"<|im_start|>assistant\n{TURNS[0]}<|im_end|>" + text(tok, inserted))
        assert whole[-len(inserted) - 1 :] == [tok.eos_token_id, *inserted]
    finally:
        loop.close()


BROKEN = {
    # the verl #6921 kind: no newline after a turn with reasoning, one after a turn without
    "newline": (
        "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
        "{{- '<|im_end|>' + ('' if reasoning_content else '\\n') }}\n    {%- elif message.role == \"tool\" %}",
    ),
    # a tool result numbered by its place in the chat
    "numbered": ("{{- '\\n<tool_response>\\n' }}", "{{- '\\n<tool_response n=' ~ loop.index0 ~ '>\\n' }}"),
}


@pytest.mark.parametrize(
    ("broken", "boundary"), [("newline", "a first turn with reasoning and a tool call"), ("numbered", "a second turn with reasoning")]
)
def test_a_template_whose_boundary_depends_on_the_turns_before_is_refused_in_one_line(tmp_path, broken, boundary):
    old, new = BROKEN[broken]
    published = QWEN3_TEMPLATE.read_text()
    assert published.count(old) == 1
    path = build_qwen3_like_tokenizer(tmp_path, published.replace(old, new))
    with pytest.raises(EnvError) as refused:
        agent_loop(path)
    message = str(refused.value)
    assert message.startswith(f"rollout.agent: the chat template cannot be continued token-exactly: after {boundary}") and "\n" not in message
    assert "depends on the turns before it" in message


def test_a_conversation_the_template_refuses_to_render_is_not_checked(tmp_path):
    """A template that raises on a user message after the first (no run of it can have one) is still
    checked on the conversations it renders, and accepted."""
    from jinja2 import TemplateError

    published = QWEN3_TEMPLATE.read_text()
    start = "{%- for message in messages %}\n"
    refusing = published.replace(
        start, start + '    {%- if message.role == "user" and loop.index0 > 1 %}{{ raise_exception("one question") }}{%- endif %}\n', 1
    )
    assert refusing != published
    loop = agent_loop(build_qwen3_like_tokenizer(tmp_path, refusing))
    try:
        with pytest.raises(TemplateError, match="one question"):
            loop.render([*_BASE, {"role": "user", "content": "again"}], [], True)
        assert text(loop.tokenizer, loop.inserted_tokens([{"role": "tool", "content": "408"}], [])) == TOOL_RESULT
    finally:
        loop.close()


# --- the trajectory: a tiny Qwen3 policy, the HF engine, the trainer ----------------------------------


class Recorded:
    """A loop's responder, recording what crossed it turn by turn: the ids the engine sampled (and their
    log-probs) and the ids it was given to insert."""

    def __init__(self, inner):
        self.inner, self.turns = inner, {}

    @property
    def rows(self):
        return self.inner.rows

    def record(self, row, turn, answer):
        self.turns.setdefault(row, []).append((list(turn.token_ids), list(turn.logprobs), None if answer is None else list(answer)))
        return answer

    def respond_all(self, turns):
        answers = self.inner.respond_all(turns)
        return {row: self.record(row, turn, answers[row]) for row, turn in turns.items()}

    async def respond(self, row, turn):
        return self.record(row, turn, await self.inner.respond(row, turn))


class RecordingLoop(AgentLoop):
    def begin(self, problems, requests, processor=None):
        self.recorded = Recorded(super().begin(problems, requests, processor))
        return self.recorded


def scripted_sequence(loop: AgentLoop) -> tuple[list[int], list[int]]:
    """The prompt and the script's turns with what the loop inserts between them, and the loss mask."""
    tok, tools = loop.tokenizer, loop.factory().tool_schemas
    observations = [[{"role": "tool", "content": "408"}], [{"role": "user", "content": "Check it once more."}]]
    ids, mask = loop.first_prompt(ITEM), []
    mask = [0] * len(ids)
    for i, turn in enumerate(TURNS):
        sampled = tok(turn, add_special_tokens=False).input_ids + [tok.eos_token_id]
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        if i < len(observations):
            inserted = loop.inserted_tokens(observations[i], tools)
            ids, mask = ids + inserted, mask + [0] * len(inserted)
    return ids, mask


def taught_policy(tok, ids: list[int], mask: list[int]):
    """A tiny Qwen3 built from a config, trained on the script's sampled tokens until it samples them."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # vLLM's CPU attention needs >= 32
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs = torch.tensor([ids])
    labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one sequence of a 2-layer model: more threads only contend
    try:
        for _ in range(400):
            loss = model(input_ids=inputs, labels=labels).loss
            if loss.item() < 1e-3:
                break
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 1e-3
    return model.eval()


TRAJECTORY_SETTINGS = [
    "rollout.agent.env=tests.environments:Reviewed",
    "rollout.group_size=2",
    "rollout.max_new_tokens=48",
    "rollout.deterministic=true",
    "eval.enabled=false",
]


def assert_trained_is_generated_and_inserted(loop: RecordingLoop, group, model, mismatch: float) -> None:
    """The group's trajectories as the trainer decodes and packs them are, turn by turn, the tokens the
    engine sampled and the tokens the loop gave it to insert; the trainer's forward over them gives the
    engine's log-probs (within `mismatch`, mean per token); a re-render of the same chat differs."""
    cfg, tok = loop.cfg, loop.tokenizer
    learner = Learner(TrainerConfig(), copy.deepcopy(model), tok.pad_token_id, max_new_tokens=cfg.rollout.max_new_tokens)
    decoded = decode_group(pack(group), group_limits(cfg, learner, 10**6)(0))
    prompt, trained, masks = as_packing_group(decoded)  # what the trainer packs and trains on
    assert prompt == loop.first_prompt(ITEM)
    recorded, rows = loop.recorded.turns, loop.recorded.rows
    assert sorted(recorded) == [0, 1]
    for row, sample in enumerate(decoded.samples):
        turns = recorded[row]
        # the policy sampled the script: reasoning in every turn, the call, the answer, the answer again
        assert [text(tok, sampled) for sampled, _, _ in turns] == [t + "<|im_end|>" for t in TURNS]
        assert [text(tok, inserted) for _, _, inserted in turns[:2]] == [
            TOOL_RESULT,
            "\n<|im_start|>user\nCheck it once more.<|im_end|>\n<|im_start|>assistant\n",
        ]
        # trained = generated + inserted, turn by turn, with the engine's log-probs on the generated tokens
        expected, logprobs, mask = [], [], []
        for k, (sampled, behaviour, inserted) in enumerate(turns):
            expected, logprobs, mask = expected + sampled, logprobs + behaviour, mask + [1] * len(sampled)
            if inserted is not None and k + 1 < len(turns):
                expected, logprobs, mask = expected + inserted, logprobs + [0.0] * len(inserted), mask + [0] * len(inserted)
        assert trained[row] == expected and masks[row] == mask
        assert sample.logprobs.tolist() == pytest.approx(logprobs, abs=1e-6)
        # a re-render of the same chat is not what the policy saw: it drops the first two turns' reasoning
        rerendered = tok.apply_chat_template(rows[row].messages, tools=rows[row].env.tool_schemas, tokenize=True, return_dict=False)
        assert list(rerendered)[: len(prompt) + len(expected)] != prompt + expected
        assert "I need the product." in text(tok, expected) and "I need the product." not in text(tok, rerendered)
    # the trainer's forward over those tokens gives the engine's log-probs: the same context, token for token
    learner.train_on_groups([decoded])
    assert learner.tokens == sum(len(sampled) for turns in recorded.values() for sampled, _, _ in turns)
    assert learner.step()["logprob_mismatch"] < mismatch


def test_qwen3_trajectories_train_on_the_tokens_generated_and_inserted_turn_by_turn(qwen3_dir):
    # the taught policy samples at temperature 1: under seed 0 the HF engine's per-row noise of the
    # second turn draws one token off the script
    loop = agent_loop(qwen3_dir, "rollout.engine=hf", *TRAJECTORY_SETTINGS, "seed=1", cls=RecordingLoop)
    try:
        cfg, tok = loop.cfg, loop.tokenizer
        model = taught_policy(tok, *scripted_sequence(loop))
        engine = HFEngine.for_rollout(model, tok, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
        (group,) = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), [ITEM], cfg, version=0, worker_id="w", agent=loop)
        assert_trained_is_generated_and_inserted(loop, group, model, mismatch=1e-5)
    finally:
        loop.close()
