"""LoRA (model.lora) with real peft models: what trains, the reference policy, the adapter-only weight
store, the arrival check, and `tidal run` end to end."""

import asyncio
import copy
import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import run_cli
from tidal.algo import grpo_advantages, kl_estimate, token_logprobs_from_logits
from tidal.config import ConfigError, LoraConfig, TinyModelConfig, TrainerConfig, config_from_dict
from tidal.config.schema import vllm_max_lora_rank
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.model.lora import adapter_config, adapter_state_dict, apply_lora
from tidal.model.probe import make_probe, probe_logprobs
from tidal.protocol import Group, Sample
from tidal.rollout.arrival import check_arrival
from tidal.rollout.engine import HFEngine
from tidal.trainer.learner import Learner, warmup_then_constant
from tidal.weights import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    CorruptSnapshotError,
    WeightsDidNotArriveError,
    WeightStore,
    load_verified,
    load_verified_with_manifest,
    manifest_signature,
    sha256_of,
)
from tidal.weights.signing import new_key_pair, trust_public_key

LORA = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])


def base_and_tokenizer():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok)
    return model.eval(), tok


def lora_model():
    base, tok = base_and_tokenizer()
    torch.manual_seed(1)
    return apply_lora(copy.deepcopy(base), LORA), base, tok


def make_group(rng, prompt_len, lengths, rewards) -> Group:
    samples = [Sample(np.asarray(rng.integers(4, 90, n), dtype=np.int32), np.zeros(n, dtype=np.float32), r) for n, r in zip(lengths, rewards)]
    return Group(0, 0, 0, "test", np.asarray(rng.integers(4, 90, prompt_len), dtype=np.int32), samples)


def response_logprobs(model, group: Group) -> list[torch.Tensor]:
    prompt = group.prompt_ids.tolist()
    out = []
    for s in group.samples:
        ids = torch.tensor([prompt + s.token_ids.tolist()])
        out.append(token_logprobs_from_logits(model(input_ids=ids).logits[:, len(prompt) - 1 : -1], ids[:, len(prompt) :])[0])
    return out


def nudge_adapter(model, scale: float = 0.05, seed: int = 2) -> None:
    """Moves the adapter off its start (B = 0) so that it changes the model's outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"rollout": {"engine": "vllm"}, "model": {"lora": {"r": 513}}}, "model.lora.r 513 is above the largest rank vLLM serves (512)"),
        ({"rollout": {"engine": "vllm"}, "model": {"lora": {"modules_to_save": ["lm_head"]}}}, "model.lora.modules_to_save ['lm_head']: vLLM"),
        ({"eval": {"engine": "vllm"}, "model": {"lora": {"modules_to_save": ["lm_head"]}}}, "set eval.engine to 'hf'"),
    ],
)
def test_lora_refuses_what_it_does_not_run_on_in_one_line_naming_the_keys(overrides, named):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"lora": {}}, **overrides})
    message = str(err.value)
    assert named in message and "model.lora" in message
    assert len(message.strip().splitlines()) == 1, message


@pytest.mark.parametrize("trainer", [{"strategy": "fsdp2", "ranks": 2}, {"strategy": "deepspeed", "ranks": 2, "zero_stage": 3}, {"ranks": 2}])
def test_a_lora_config_is_accepted_with_several_trainer_ranks(trainer):
    """The config only; the runs themselves, two ranks each: tests/test_arrival_ranks.py (fsdp2, ZeRO-3)."""
    cfg = config_from_dict({"model": {"lora": {}}, "trainer": trainer})
    assert cfg.model.lora is not None and cfg.trainer.ranks == 2


def test_lora_runs_on_vllm_with_the_smallest_max_rank_vllm_accepts_that_holds_r():
    cfg = config_from_dict({"model": {"lora": {"r": 12}}, "rollout": {"engine": "vllm"}})
    assert cfg.model.lora.r == 12 and cfg.eval.engine == "rollout"
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 12, 16, 17, 300, 512)] == [1, 8, 8, 16, 16, 32, 320, 512]
    assert config_from_dict({"model": {"lora": {"modules_to_save": ["lm_head"]}}}).model.lora.modules_to_save == [
        "lm_head"
    ]  # the HF engine serves it


def test_lora_is_off_by_default_and_a_block_turns_it_on():
    assert config_from_dict({}).model.lora is None
    cfg = config_from_dict({"model": {"lora": {"r": 4, "target_modules": ["q_proj"]}}})
    assert cfg.model.lora.r == 4 and cfg.model.lora.target_modules == ["q_proj"]


def test_target_modules_the_model_lacks_are_one_clear_error():
    base, _ = base_and_tokenizer()
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['nonexistent_proj'\]"):
        apply_lora(base, LoraConfig(target_modules=["nonexistent_proj"]))


# ---------------------------------------------------------------- the learner


def test_only_the_adapter_trains_and_holds_optimizer_state():
    model, _, tok = lora_model()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    learner = Learner(TrainerConfig(lr=1e-2, warmup_steps=0), model, tok.pad_token_id)
    names = {id(p): n for n, p in learner.model.named_parameters()}
    in_optimizer = [names[id(p)] for group in learner.optimizer.param_groups for p in group["params"]]
    assert in_optimizer and all("lora_" in n for n in in_optimizer)
    assert len(in_optimizer) == sum("lora_" in n for n in names.values())

    learner.train_on_group(make_group(np.random.default_rng(0), 3, [4, 5, 2], [1.0, 0.0, 0.0]))
    learner.step()
    assert learner.optimizer.state and all("lora_" in names[id(p)] for p in learner.optimizer.state)
    after = dict(learner.model.named_parameters())
    assert all(torch.equal(base_before[n], after[n]) for n in base_before)  # the base did not move
    assert any(after[n].abs().max() > 0 for n in after if "lora_B" in n)  # the adapter did (B starts at 0)
    tensors = learner.optimizer_tensors()  # the checkpoint: the adapter's moments only
    assert all("lora_" in k for k in tensors if "::" in k)


def test_the_reference_is_the_base_with_the_adapter_disabled_not_a_copy():
    model, base, tok = lora_model()
    learner = Learner(TrainerConfig(kl_coef=0.1, lr=1e-2, warmup_steps=0), model, tok.pad_token_id)
    assert learner.reference is None and learner.has_reference  # no second copy of the weights
    group = make_group(np.random.default_rng(1), 3, [4, 4], [1.0, 0.0])
    learner.train_on_group(group)
    assert learner.step()["kl"] == 0.0  # the adapter starts at zero: the policy is the base
    learner.train_on_group(group)
    assert learner.step()["kl"] > 0.0
    from tidal.trainer.learner import as_packing_group
    from tidal.trainer.packing import naive_token_logprobs

    reference = learner._reference_logprobs([as_packing_group(group)])  # the one group's rows
    with torch.no_grad():
        expected = naive_token_logprobs(base, [as_packing_group(group)], 1.0)[0].logprobs
        policy = naive_token_logprobs(learner.model, [as_packing_group(group)], 1.0)[0].logprobs
    torch.testing.assert_close(reference, expected, atol=1e-6, rtol=0)
    assert (policy - expected).abs().max() > 1e-4  # and the adapter is back on afterwards


def test_the_learner_makes_the_update_a_hand_driven_peft_model_makes():
    """Two optimizer steps of GRPO with a KL term against the base, by the learner and by hand (peft
    model, its own loss, torch AdamW over the adapter, clipping, warmup): the adapters agree to a
    thousandth of one Adam step (1e-3 * lr): Adam divides each gradient by its own running magnitude, so
    a gradient that is float noise on both sides still moves its parameter by about lr."""
    rng = np.random.default_rng(3)
    batches = [[make_group(rng, 3, [4, 2, 5], [1.0, 0.0, 0.5]), make_group(rng, 5, [3, 3], [0.0, 1.0])] for _ in range(2)]
    model, base, tok = lora_model()
    hand = copy.deepcopy(model)
    cfg = TrainerConfig(lr=1e-2, kl_coef=0.05, warmup_steps=1, max_grad_norm=0.5)
    learner = Learner(cfg, model, tok.pad_token_id)
    for groups in batches:
        learner.train_on_groups(groups)
        learner.step()

    params = [p for p in hand.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_constant(cfg.warmup_steps))
    hand.train()
    for groups in batches:
        total, count = 0.0, 0
        for g in groups:
            with torch.no_grad():
                ref = response_logprobs(base, g)
            for logp, ref_logp, adv in zip(response_logprobs(hand, g), ref, grpo_advantages(torch.tensor(g.rewards))):
                ratio = torch.exp(logp - logp.detach())
                total = total + (-adv * ratio + cfg.kl_coef * kl_estimate(logp, ref_logp, cfg.kl_estimator)).sum()
                count += logp.numel()
        (total / count).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    trained, expected = adapter_state_dict(learner.model), adapter_state_dict(hand)
    moved = max(expected[k].abs().max().item() for k in expected if "lora_B" in k)
    assert moved > 1e-3
    for name, tensor in expected.items():
        torch.testing.assert_close(trained[name], tensor, atol=1e-3 * cfg.lr, rtol=0, msg=name)


def test_several_updates_per_iteration_keep_the_old_policy_as_a_second_adapter_not_a_copy():
    """updates_per_iteration 2: the old policy is a frozen second adapter on the same base, set from the
    trained adapter at each iteration's start; its log-probs are those of the adapter at that start."""
    from tidal.model.lora import load_adapter_state_dict
    from tidal.trainer.learner import as_packing_group
    from tidal.trainer.packing import naive_token_logprobs

    model, base, tok = lora_model()
    base_numel = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    learner = Learner(TrainerConfig(lr=1e-2, warmup_steps=0, updates_per_iteration=2), model, tok.pad_token_id)
    params = dict(learner.model.named_parameters())
    assert sum(p.numel() for n, p in params.items() if "lora_" not in n) == base_numel  # no second base
    old = [n for n in params if ".old." in n]
    assert len(old) == len([n for n in params if ".default." in n]) and not any(params[n].requires_grad for n in old)
    names = {id(p): n for n, p in params.items()}
    assert not any(".old." in names[id(p)] for group in learner.optimizer.param_groups for p in group["params"])

    rng = np.random.default_rng(4)
    first, second = make_group(rng, 3, [4, 5, 2], [1.0, 0.0, 0.5]), make_group(rng, 4, [3, 6], [0.0, 1.0])
    learner.begin_iteration(0)
    learner.train_on_group(first)
    learner.step()
    start = learner.full_state_dict()  # the adapter at the start of iteration 1, in peft's names
    assert start.keys() == adapter_state_dict(apply_lora(copy.deepcopy(base), LORA)).keys()  # the old adapter is not stored
    learner.begin_iteration(1)
    learner.train_on_group(first)
    assert learner.step()["ratio_max"] == pytest.approx(1.0, abs=1e-6)  # the first step: old == policy
    learner.train_on_group(second)
    assert learner.step()["ratio_max"] > 1.0 + 1e-6  # the second: the policy moved away from the old adapter

    at_start = apply_lora(copy.deepcopy(base), LORA).eval()
    load_adapter_state_dict(at_start, start)
    packing = [as_packing_group(second)]
    with torch.no_grad():
        expected = naive_token_logprobs(at_start, packing, 1.0)[0].logprobs
        policy = naive_token_logprobs(learner.model, packing, 1.0)[0].logprobs
    old_logprobs = learner._frozen_logprobs(learner.old_policy, packing, "cpu", "old")  # the one group's rows
    torch.testing.assert_close(old_logprobs, expected[:, : old_logprobs.shape[1]], atol=1e-5, rtol=0)
    assert (policy - expected).abs().max() > 1e-4  # the trained adapter did move


# ---------------------------------------------------------------- the weight store


@pytest.fixture
def signed():
    """The trainer's private key (publish_adapter's store signs with it); this process trusts its public key, as a
    role does once it read the run's key file (loaders check it)."""
    private, public = new_key_pair()
    trust_public_key(public)
    return private


def publish_adapter(tmp_path, model, version=3, probe=None, signing_key=None):
    base_dir = tmp_path / "base"
    store = WeightStore(tmp_path / "weights", base_dir, adapter_config(model, str(base_dir)), probe, signing_key=signing_key)
    logprobs = probe_logprobs(model, probe) if probe else None
    return store, store.publish(version, adapter_state_dict(model), probe_logprobs=logprobs)


def test_with_nccl_weight_sync_the_trainer_sends_the_adapter_alone_as_the_store_writes_it(tmp_path):
    """The GPU fast path under LoRA: what the trainer broadcasts is the adapter's tensors (no base weight),
    under the names and with the values the store's version holds; what the engine writes from them
    (write_adapter_files, the first worker's write) is byte for byte the store's adapter file."""
    from tidal.rollout.vllm_weights import nccl_update_info
    from tidal.weights import write_adapter_files

    cfg = config_from_dict({"model": {"lora": {}}, "rollout": {"engine": "vllm", "vllm": {"weight_sync": "nccl"}}})
    assert cfg.model.lora is not None and cfg.rollout.vllm.weight_sync == "nccl"  # no longer refused
    model, base, tok = lora_model()
    nudge_adapter(model)
    learner = Learner(TrainerConfig(lr=1e-2, warmup_steps=0), model, tok.pad_token_id)
    sent = learner.pushed_state()
    store, path = publish_adapter(tmp_path, model)
    stored = load_file(str(path / ADAPTER_FILE))
    assert list(sent) == list(adapter_state_dict(model)) and set(sent) == set(stored)
    assert all(torch.equal(sent[k], stored[k]) for k in stored)
    full = sum(t.numel() for t in base.state_dict().values())
    assert sum(t.numel() for t in sent.values()) < full / 10  # megabytes, not the model
    info = nccl_update_info(sent, adapter_config=store.adapter_config)
    assert info["adapter_config"] == json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    assert info["shapes"] == [list(t.shape) for t in sent.values()]
    (tmp_path / "landed").mkdir()
    write_adapter_files(tmp_path / "landed", sent, info["adapter_config"])
    assert sha256_of(tmp_path / "landed" / ADAPTER_FILE) == sha256_of(path / ADAPTER_FILE)
    assert (tmp_path / "landed" / ADAPTER_CONFIG_FILE).read_bytes() == (path / ADAPTER_CONFIG_FILE).read_bytes()

    # full weights: the model's own tensors, not copies (a GPU trainer sends them from where they lie)
    plain = Learner(TrainerConfig(lr=1e-2, warmup_steps=0), copy.deepcopy(base), tok.pad_token_id)
    own = dict(plain.model.named_parameters())
    assert all(t.data_ptr() == own[k].data_ptr() for k, t in plain.pushed_state().items() if k in own)
    assert "adapter_config" not in nccl_update_info(plain.pushed_state())


def test_an_adapter_version_is_peft_files_plus_a_manifest_and_peft_loads_it(tmp_path, signed):
    from peft import PeftModel

    model, base, tok = lora_model()
    nudge_adapter(model)
    base.save_pretrained(tmp_path / "base")
    store, path = publish_adapter(tmp_path, model, signing_key=signed)
    assert sorted(p.name for p in path.iterdir()) == sorted([ADAPTER_FILE, ADAPTER_CONFIG_FILE, MANIFEST_FILE])
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["kind"] == "lora" and manifest["base_model"] == str(tmp_path / "base")
    assert manifest["files"] == {ADAPTER_FILE: sha256_of(path / ADAPTER_FILE), ADAPTER_CONFIG_FILE: sha256_of(path / ADAPTER_CONFIG_FILE)}
    assert json.loads((path / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"] == str(tmp_path / "base")

    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), path).eval()
    ids = torch.tensor([[5, 9, 12, 40, 7, 22]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-6, rtol=0)
        assert (base(input_ids=ids).logits - loaded(input_ids=ids).logits).abs().max() > 1e-4  # the adapter matters

    engine = HFEngine(apply_lora(copy.deepcopy(base), LORA), tok.eos_token_id, tok.pad_token_id, 4)
    base_storage = {n: p.data_ptr() for n, p in engine.model.named_parameters() if "lora_" not in n}
    engine.load_snapshot(path, 3)  # the engine sets the adapter in place on its base
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6, rtol=0)
    assert base_storage == {n: p.data_ptr() for n, p in engine.model.named_parameters() if "lora_" not in n}  # the base was not reloaded


def test_adapter_versions_are_hash_checked_signed_repaired_and_pruned_like_full_ones(tmp_path, signed):
    model, _, _ = lora_model()
    nudge_adapter(model)
    store, path = publish_adapter(tmp_path, model, signing_key=signed)
    state = load_verified(path)
    assert state.keys() == adapter_state_dict(model).keys()

    blob = bytearray((path / ADAPTER_FILE).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (path / ADAPTER_FILE).write_bytes(bytes(blob))
    with pytest.raises(CorruptSnapshotError, match=f"{ADAPTER_FILE} sha256"):
        load_verified(path)
    assert store.repair(3, adapter_state_dict(model)) is True  # rewritten from the trainer's adapter
    assert load_verified(path).keys() == state.keys()

    (path / ADAPTER_CONFIG_FILE).write_text((path / ADAPTER_CONFIG_FILE).read_text().replace('"r": 4', '"r": 5'))
    with pytest.raises(CorruptSnapshotError, match=f"{ADAPTER_CONFIG_FILE} sha256"):
        load_verified(path)
    store.repair(3, adapter_state_dict(model))

    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["base_model"] = "/somewhere/else"  # the signature covers the base it names
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CorruptSnapshotError, match="signature does not verify with this run's trainer key"):
        load_verified(path)

    for v in range(4, 8):
        store.publish(v, adapter_state_dict(model))
    assert store.prune(keep_last=2) == [3, 4, 5] and store.versions() == [6, 7]


# ---------------------------------------------------------------- the arrival check


def test_the_arrival_check_catches_an_engine_that_did_not_apply_a_version(tmp_path, signed):
    """An engine that keeps version 1's adapter when version 2 is published, and one that loads a
    tampered adapter whose manifest was re-signed: both are caught at that version."""
    model, base, tok = lora_model()
    probe = make_probe(0, int(model.get_input_embeddings().num_embeddings))
    nudge_adapter(model, seed=1)
    store, v1 = publish_adapter(tmp_path, model, 1, probe, signed)
    nudge_adapter(model, seed=2)
    _, v2 = publish_adapter(tmp_path, model, 2, probe, signed)

    engine = HFEngine(apply_lora(copy.deepcopy(base), LORA), tok.eos_token_id, tok.pad_token_id, 4)
    state, manifest = load_verified_with_manifest(v1)
    engine.load_state_dict(state)
    assert asyncio.run(check_arrival(engine, manifest.get("probe"), 1, 1e-3, "w0")) < 1e-5  # the right adapter: passes
    _, manifest2 = load_verified_with_manifest(v2)
    with pytest.raises(
        WeightsDidNotArriveError,
        match=r"^weights v2 did not arrive on worker w0: .* by [0-9.e-]+ per token on average, up to [0-9.e-]+ \(weights.arrival_tolerance 0.001, for the mean\)$",
    ):
        asyncio.run(check_arrival(engine, manifest2.get("probe"), 2, 1e-3, "w0"))  # still v1's adapter
    assert asyncio.run(check_arrival(engine, manifest2.get("probe"), 2, 0.0, "w0")) is None  # tolerance 0: the check is off

    tensors = load_file(str(v2 / ADAPTER_FILE))
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name] = tensors[name] + 0.05
    save_file(tensors, str(v2 / ADAPTER_FILE), metadata={"format": "pt"})
    manifest2["files"][ADAPTER_FILE] = sha256_of(v2 / ADAPTER_FILE)
    manifest2["signature"] = manifest_signature(manifest2, signed)
    (v2 / MANIFEST_FILE).write_text(json.dumps(manifest2))
    state, manifest = load_verified_with_manifest(v2)  # consistent and signed: the store cannot tell
    engine.load_state_dict(state)
    with pytest.raises(WeightsDidNotArriveError, match="weights v2 did not arrive"):
        asyncio.run(check_arrival(engine, manifest.get("probe"), 2, 1e-3, "w0"))


# ---------------------------------------------------------------- tidal run


RUN = {
    "model.lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]},
    "rollout.deterministic": True,
    "trainer.lr": 2e-2,
    "trainer.kl_coef": 0.01,
    "eval.enabled": False,
    "reward.functions": [{"name": "exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.1}],
}


def adapter_of(run_dir, version: int) -> dict:
    return load_file(str(run_dir / "weights" / f"v{version:06d}" / ADAPTER_FILE))


def test_a_lora_periodic_run_ends_on_the_adapter_of_a_sync_run_and_resumes_onto_it(tmp_path, write_config):
    config = write_config({**RUN, "trainer.iterations": 3})
    for mode in ("sync", "periodic"):
        proc = run_cli("run", str(config), "--run-dir", str(tmp_path / mode), "--set", f"mode={mode}", "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
    start, sync, periodic = adapter_of(tmp_path / "sync", 0), adapter_of(tmp_path / "sync", 3), adapter_of(tmp_path / "periodic", 3)
    assert not (tmp_path / "sync" / "weights" / "v000003" / "model.safetensors").exists()
    assert max((sync[k] - start[k]).abs().max().item() for k in start) > 1e-3  # training moved the adapter
    for name, tensor in sync.items():
        torch.testing.assert_close(periodic[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    worker_log = (tmp_path / "periodic" / "logs" / "worker-0.log").read_text()
    assert all(
        re.search(
            rf"loaded weights v{v} in [\d.]+s from the weight store \(probe log-probs within [\d.e+-]+ of the trainer's, mean per token\)", worker_log
        )
        for v in range(3)
    )

    # a run stopped after 2 iterations and resumed (adapter and its optimizer state from the checkpoint) ends there too
    resumed = tmp_path / "resumed"
    for iterations in (2, 3):
        proc = run_cli("run", str(config), "--run-dir", str(resumed), "--set", f"trainer.iterations={iterations}", "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
    for name, tensor in periodic.items():
        torch.testing.assert_close(adapter_of(resumed, 3)[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "weights, ranks", [("lora", 1), ("lora", 2), ("full", 2)], ids=["lora-one-rank", "lora-two-fsdp2-ranks", "full-two-fsdp2-ranks"]
)
def test_a_tampered_re_signed_version_stops_the_run_at_that_version(tmp_path, write_config, weights, ranks):
    """A version whose tensors were changed and whose manifest was re-signed with the run's key verifies;
    the probe log-probs the trainer (rank 0 of several too) wrote with it are what give it away."""
    run = RUN if weights == "lora" else {k: v for k, v in RUN.items() if k != "model.lora"}
    config = write_config({**run, "trainer.iterations": 2, "trainer.ranks": ranks})
    run_dir = tmp_path / "run"
    first = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    version = run_dir / "weights" / "v000002"
    assert "probe" in json.loads((version / MANIFEST_FILE).read_text())  # the trainer, on every number of ranks, wrote one
    tensors_file = ADAPTER_FILE if weights == "lora" else WEIGHTS_FILE
    tensors = load_file(str(version / tensors_file))
    name = next(k for k in tensors if ("lora_B" in k if weights == "lora" else k.endswith("mlp.up_proj.weight")))
    tensors[name] = tensors[name] + 0.1
    save_file(tensors, str(version / tensors_file), metadata={"format": "pt"})
    manifest = json.loads((version / MANIFEST_FILE).read_text())
    manifest["files"][tensors_file] = sha256_of(version / tensors_file)
    manifest["signature"] = manifest_signature(manifest, (run_dir / "weights-signing-key").read_text().strip())
    (version / MANIFEST_FILE).write_text(json.dumps(manifest))

    second = run_cli("run", str(config), "--run-dir", str(run_dir), "--set", "trainer.iterations=3", "--no-progress")
    assert second.returncode != 0
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("tidal: rollout worker worker-0 failed: weights v2 did not arrive on worker worker-0"), second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert not (run_dir / "weights" / "v000003").exists()  # nothing was trained on what the engine generated


def test_a_lora_run_on_two_fsdp2_ranks_ends_on_the_adapter_of_one_rank(tmp_path, write_config):
    """Rank 0 gathers the adapter from its shards and publishes it; the reference (adapter disabled) and
    the old adapter (two updates per iteration) run under fsdp2; each rank writes its optimizer shard
    (resuming from the shards: tests/test_distributed.py, test_lora_on_two_ranks_ends_on_the_adapter_of_one_process)."""
    config = write_config({**RUN, "trainer.iterations": 3, "trainer.updates_per_iteration": 2})
    for ranks in (1, 2):
        proc = run_cli("run", str(config), "--run-dir", str(tmp_path / f"r{ranks}"), "--set", f"trainer.ranks={ranks}", "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer rank 1 of 2 on cpu, strategy fsdp2" in (tmp_path / "r2" / "logs" / "trainer.log").read_text()
    start, one, two = adapter_of(tmp_path / "r1", 0), adapter_of(tmp_path / "r1", 3), adapter_of(tmp_path / "r2", 3)
    assert max((one[k] - start[k]).abs().max().item() for k in start) > 1e-3  # training moved the adapter
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    worker_log = (tmp_path / "r2" / "logs" / "worker-0.log").read_text()  # the arrival check ran at every version and passed
    assert all(
        re.search(
            rf"loaded weights v{v} in [\d.]+s from the weight store \(probe log-probs within [\d.e+-]+ of the trainer's, mean per token\)", worker_log
        )
        for v in range(3)
    )
    assert sorted(p.name for p in (tmp_path / "r2" / "checkpoint" / "v000003").iterdir()) == [
        "optimizer-rank0-of-2.safetensors",
        "optimizer-rank1-of-2.safetensors",
        "state.json",
    ]
