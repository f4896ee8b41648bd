"""Multi-turn rollouts (rollout.agent) whose prompts have images, on the HF engine: the image is encoded once per
engine call, in the groups' shared prefill; later turns leave and join the decode batch and continue M-RoPE's text
positions after the image; the trainer's packed forward over prompt + sampled + inserted tokens gives every sampled
token the engine's log-prob (float32), and an unpacked HF forward of the whole sequence agrees too."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoTokenizer

from tests.conftest import mask_runs, read_jsonl, run_cli
from tests.test_vision_packing import EncoderCalls, png
from tidal.config import TrainerConfig, config_from_dict
from tidal.demo.vision import TinyVLMSize, count_image, save_tiny_vlm, write_count_task
from tidal.envs import EnvError
from tidal.model.loading import load_model
from tidal.protocol import WorkItem, decode_group, pack
from tidal.rewards import RewardScorer
from tidal.roles import group_limits
from tidal.rollout.agent import AgentLoop, with_images
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import generate_groups
from tidal.trainer.learner import Learner, as_packing_group, token_logprobs

G, MAX_NEW_TOKENS = 4, 10
VLLM_TINY_VLM = TinyVLMSize(num_heads=2, num_kv_heads=1)  # heads of 32: vLLM's CPU attention takes them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_eos_prone_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def engine(model_dir):
    """The HF engine over the model, float32, with the processor it loads from the model's directory."""
    from tidal.model.vision import load_processor

    tok = load_processor(model_dir).tokenizer
    return HFEngine.for_rollout(load_model(model_dir, "float32").eval(), tok, MAX_NEW_TOKENS, 1.0)


@pytest.fixture(scope="module")
def processor(engine):
    return engine.processor


def save_eos_prone_vlm(directory, size: TinyVLMSize = VLLM_TINY_VLM, boost: float = 1.4):
    """The tiny VLM whose turns end with EOS after a few tokens, on either engine:
    hidden dimension 0 carries a constant (1 in every token's embedding, `boost` in EOS's; no layer writes to it), so
    the tied output layer adds EOS a logit margin at every position. An untrained model rarely samples EOS."""
    from transformers import AutoModelForImageTextToText

    path = save_tiny_vlm(directory, size=size)
    model = AutoModelForImageTextToText.from_pretrained(path)
    text = model.model.language_model
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    with torch.no_grad():
        text.embed_tokens.weight[:, 0] = 1.0
        text.embed_tokens.weight[eos, 0] = boost
        for layer in text.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
    model.save_pretrained(path)
    return path


def agent_config():
    return config_from_dict(
        {
            "rollout": {
                "group_size": G,
                "max_new_tokens": MAX_NEW_TOKENS,
                "agent": {"env": "tests.environments:Chatty", "max_turns": 3, "max_env_tokens_per_turn": 16},
            },
            "trainer": {"prompts_per_iteration": 2},
            "eval": {"enabled": False},
        }
    )


def image_items(seed: int = 3) -> list[WorkItem]:
    import random

    rng = random.Random(seed)
    images = [png(count_image(rng, "red", n, side=side, cell=14)) for n, side in ((2, 56), (1, 84))]
    return [WorkItem(0, i, "how many red squares?", str(i), [image]) for i, image in enumerate(images)]


def hf_forward_logprobs(model, processor, prompt: list[int], images, tokens: list[int]) -> torch.Tensor:
    """Log-probs of `tokens` after `prompt` by HF's own forward of the whole sequence (its own M-RoPE positions)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=torch.tensor(images.pixel_values),
            image_grid_thw=torch.tensor(images.image_grid_thw),
            mm_token_type_ids=(ids == processor.image_token_id).long(),
        ).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_multi_turn_trajectories_with_images_carry_the_trainers_logprobs(engine, processor):
    tok, model = processor.tokenizer, engine.model
    cfg = agent_config()
    agent = AgentLoop.from_config(cfg, tok, 1024)
    calls = EncoderCalls(model)
    try:
        groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), image_items(), cfg, version=0, worker_id="w", agent=agent)
    finally:
        calls.close()
        agent.close()
    assert calls.images == [2]  # both groups' images, once each, in the one prefill; no encoding in later turns
    learner = Learner(TrainerConfig(), copy.deepcopy(model), tok.pad_token_id, device="cpu", max_new_tokens=MAX_NEW_TOKENS)
    limits = group_limits(cfg, learner, 10**7)(0)
    received = [decode_group(pack(g), limits) for g in groups]
    inserted = tok("<t>ok\n<a>", add_special_tokens=False).input_ids
    turns = []
    for group, item in zip(received, image_items(), strict=True):
        expected = processor.process_images(item.images)
        np.testing.assert_array_equal(group.images.pixel_values, expected.pixel_values)
        prompt = group.prompt_ids.tolist()
        assert prompt.count(processor.image_token_id) == expected.tokens(processor.merge_size)
        assert tok.decode(prompt, skip_special_tokens=False).startswith("<u><|vision_start|><|image_pad|>")
        assert tok.decode(prompt, skip_special_tokens=True).endswith("how many red squares?\n<a>")
        for s in group.samples:
            parts = mask_runs(s.loss_mask)
            assert all(s.token_ids[a:b].tolist() == inserted for v, a, b in parts if v == 0)
            turns.append(sum(v for v, _, _ in parts))
    assert max(turns) == 3 and min(turns) < 3  # trajectories of unequal turns: rows left and joined the batch

    checked = 0
    for group in received:
        prompt = group.prompt_ids.tolist()
        for s in group.samples:
            mask = torch.from_numpy(s.loss_mask.astype(bool))
            if processor.image_token_id in s.token_ids.tolist():
                continue  # HF's forward would put image features there; the trainer and the engine keep the token's embedding
            ref = hf_forward_logprobs(model, processor, prompt, group.images, s.token_ids.tolist())
            torch.testing.assert_close(torch.from_numpy(s.logprobs)[mask], ref[mask], atol=1e-5, rtol=0)
            checked += 1
    assert checked >= len(received) * G - 2

    with torch.no_grad():
        packed = token_logprobs(model, [as_packing_group(g) for g in received], 1.0, "segmented", "cpu")
    for group, out in zip(received, packed, strict=True):
        for i, s in enumerate(group.samples):
            mask = torch.from_numpy(s.loss_mask.astype(bool))
            assert torch.equal(out.loss_mask[i, : mask.numel()], mask)
            torch.testing.assert_close(out.logprobs[i, : mask.numel()][mask], torch.from_numpy(s.logprobs)[mask], atol=1e-5, rtol=0)
    for group in received:  # rewards that differ: every group has a gradient
        for i, sample in enumerate(group.samples):
            sample.reward = float(i % 2)
    learner.train_on_groups(received)
    assert learner.step()["logprob_mismatch"] < 1e-5


def test_a_turn_that_samples_an_image_token_ends_its_trajectory(processor):
    """A later turn's prompt (vLLM) would take a sampled image token for an image that is not there: the trajectory ends."""
    from tidal.rollout.agent import placeholder_ids

    tok = processor.tokenizer
    placeholders = placeholder_ids(processor)
    assert processor.image_token_id in placeholders and tok.convert_tokens_to_ids("<|video_pad|>") in placeholders
    assert placeholder_ids(None) == frozenset()
    cfg = agent_config()
    agent = AgentLoop.from_config(cfg, tok, 1024)
    try:
        item = image_items()[0]
        request = engine_request(cfg, item)
        responder = agent.begin([agent.problem(item)], [request], processor)
        from tidal.rollout.trajectory import Turn

        image_turn = Turn(tok("ab", add_special_tokens=False).input_ids + [processor.image_token_id, tok.eos_token_id], [0.0] * 4, "stop")
        assert responder.read(0, image_turn) is None and responder.rows[0].finish_reason == "image_token"
        plain = Turn(tok("ab", add_special_tokens=False).input_ids + [tok.eos_token_id], [0.0] * 3, "stop")
        assert responder.read(1, plain) == "ab" and responder.rows[1].finish_reason is None
    finally:
        agent.close()


def engine_request(cfg, item):
    from tidal.rollout.engine import GroupRequest, group_generator

    return GroupRequest([], cfg.rollout.group_size, group_generator(0, 0, item.prompt_id), image_files=list(item.images))


def test_images_go_before_the_first_user_messages_text_and_a_template_must_render_them(processor):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "user", "content": "r"}]
    out = with_images(messages, 2, "Env")
    assert out[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "q"}]
    assert out[0] == messages[0] and out[2] == messages[2] and messages[1]["content"] == "q"  # the environment's list is not changed
    with pytest.raises(EnvError, match=r"environment Env: reset\(\) gave no user message to hold the problem's 1 image"):
        with_images([{"role": "system", "content": "s"}], 1, "Env")
    cfg = agent_config()
    agent = AgentLoop.from_config(cfg, processor.tokenizer)
    # a template that renders a message's text parts only: the prompt would have no image tokens for its images
    agent.chat_template = "{% for m in messages %}{{ m.content if m.content is string else m.content[-1].text }}{% endfor %}"
    try:
        with pytest.raises(EnvError, match="the chat template rendered 0 image tokens for the first messages' 1 image"):
            agent.begin([agent.problem(image_items()[0])], [engine_request(cfg, image_items()[0])], processor)
    finally:
        agent.close()


def vision_agent_run(tmp_path, model: Path, mode: str, **rollout) -> dict:
    """A `tidal run` config: the square-counting rows with their images, multi-turn through tests.environments:Chatty."""
    data = write_count_task(tmp_path / "data", rows=32)
    return {
        "mode": mode,
        "model": {"name_or_path": str(model)},
        "data": {"task": "jsonl", "path": str(data), "num_train": 28, "num_eval": 4},
        "rollout": {
            "group_size": G,
            "max_new_tokens": MAX_NEW_TOKENS,
            "agent": {"env": "tests.environments:Chatty", "max_turns": 3, "max_env_tokens_per_turn": 16},
            **rollout,
        },
        "trainer": {"prompts_per_iteration": 2, "iterations": 2, "kl_coef": 0.01},  # a KL term: every group is trained
        "eval": {"engine": "hf", "samples_per_prompt": 2, "k": [1, 2]},  # held-out prompts with their images, through the environment
    }


def check_vision_agent_run(run: Path, tolerance: float) -> None:
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    assert all(m["trained_tokens"] > 0 and m["agent_turns_mean"] > 1 for m in metrics), [m["agent_turns_mean"] for m in metrics]
    # every sampled token of every turn: the engine's log-prob (with the image) is the trainer's
    assert max(m["logprob_mismatch"] for m in metrics) < tolerance, [m["logprob_mismatch"] for m in metrics]
    records = read_jsonl(run / "groups.jsonl")
    assert len(records) == 4 and all(r["images"] == 1 for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["staleness_max"] == 0
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_tidal_run_trains_multi_turn_trajectories_on_prompts_with_images(tmp_path, model_dir, mode):
    path = tmp_path / "vision-agent.yaml"
    path.write_text(yaml.safe_dump(vision_agent_run(tmp_path, model_dir, mode)))
    proc = run_cli("run", str(path), "--run-dir", str(tmp_path / "run"), "--no-progress", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_vision_agent_run(tmp_path / "run", 1e-5)


def test_the_recount_environment_asks_again_after_a_wrong_answer():
    """tests.environments:Recount, the verifier of docs/vision.md's multi-turn learning check."""
    from tests.environments import Recount
    from tidal.rollout.agent import Problem

    env = Recount()
    assert env.reset(Problem(0, "how many red squares?", "3")) == [{"role": "user", "content": "how many red squares?"}]
    assert env.step("A: 2") == ([{"role": "user", "content": "count again"}], False)
    assert env.step("A: 3") == ([], True)
