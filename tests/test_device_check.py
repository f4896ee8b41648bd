"""benchmarks/device_check.sh, the prepared GPU check, kept working: its short mode runs every step on CPU in tiny
sizes, and the figures it tabulates are counted the way its docs say."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from benchmarks.device_check_table import check, record

from tests.conftest import ROOT
from tidal.bench.trainer_step import MODELS, attended_pairs, build_model, linear_weights, step_flops

STEPS = ["env", "install", "run-sync", "trainer-step", "shared-prompt", "arrival", "run-periodic"]


def test_the_device_check_runs_every_step_on_cpu_in_short_mode_and_tabulates_a_number_for_each(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "DEVICE_CHECK_PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", "benchmarks/device_check.sh", "--cpu-short"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (out / "device_check.log").read_text()
    assert check(out, STEPS) == [], log[-4000:]
    table = json.loads((out / "device_check.json").read_text())
    assert [s["step"] for s in table["steps"]] == STEPS
    steps = {s["step"]: s for s in table["steps"]}
    # each figure is the one its step measured, read from that step's own result
    assert steps["env"]["value"] == 0 and steps["env"]["result"]["torch"] == torch.__version__
    assert steps["install"]["result"]["installed"] == []  # this environment has every package; the device's gets wheels
    for mode in ("sync", "periodic"):
        run = steps[f"run-{mode}"]
        assert run["result"]["mode"] == mode and run["result"]["iterations"] == 3
        assert run["value"] == run["result"]["iteration_seconds_mean"] > 0
    trainer = steps["trainer-step"]["result"]
    assert trainer["model"] == "tiny" and trainer["dtype"] == "bfloat16" and trainer["mfu"] is None  # no datasheet peak for a CPU
    assert steps["trainer-step"]["value"] == trainer["mfu_of_matmul"] > 0
    shared = steps["shared-prompt"]["result"]["results"][0]
    assert steps["shared-prompt"]["value"] == shared["speedup"] == shared["naive_seconds"] / shared["shared_seconds"]
    arrival = steps["arrival"]["result"]
    assert arrival["versions"] == [1, 3]
    assert {(e["serving"], e["record_device"], e["engine_device"]) for e in arrival["summary"]["mean"]} == {
        ("float32", "cpu", "cpu"),
        ("bfloat16", "cpu", "cpu"),
    }
    # the md table has one row per step, and the whole log came back
    md = (out / "device_check.md").read_text()
    assert all(f"| {step} | ok |" in md for step in STEPS), md
    assert all(f"=== {step}: ok" in log for step in STEPS)
    assert not list(tmp_path.glob("tidal-device-check.*")), "the scratch folder is removed"


def test_a_failed_or_missing_step_is_a_problem_of_the_table(tmp_path):
    smi = tmp_path / "env.json"
    smi.write_text(json.dumps({"python": "3.12.3", "torch": "2.11.0+cu130", "cuda": "13.0", "cuda_devices": 1, "cuda_names": ["NVIDIA H200"]}))
    assert record(tmp_path, "env", "ok", 1.5, smi, "environment")["value"] == 1
    output = tmp_path / "run-sync.out"
    output.write_text("starting\ntidal: error: trainer.device is 'cuda' but this process sees no cuda device\n\n")
    failed = record(tmp_path, "run-sync", "failed (exit 2)", 3.0, tmp_path / "missing", "tidal run ...", output)
    assert failed["summary"] == "tidal: error: trainer.device is 'cuda' but this process sees no cuda device"
    empty = record(tmp_path, "trainer-step", "ok", 2.0, tmp_path / "missing.json", "tidal bench trainer-step")
    assert empty["status"] == "failed" and "no readable result" in empty["summary"]
    assert check(tmp_path, ["env", "run-sync", "trainer-step", "arrival"]) == [
        "run-sync: failed (exit 2), figure None: tidal: error: trainer.device is 'cuda' but this process sees no cuda device",
        f"trainer-step: failed, figure None: {empty['summary']}",
        "arrival: no row",
    ]
    assert "| env | ok | 1.5 | 1 CUDA devices | NVIDIA H200;" in (tmp_path / "device_check.md").read_text()


def test_the_half_billion_model_has_qwen25_05bs_published_parameter_count():
    model = build_model(MODELS["qwen2.5-0.5b"], 1024, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B: 0.49B, tied embeddings


def test_the_linear_weights_are_counted_layer_by_layer():
    arch = MODELS["tiny"]
    model = build_model(arch, 64, torch.float32, "meta")
    kv = arch.kv_heads * arch.hidden // arch.heads
    attention = 2 * arch.hidden * arch.hidden + 2 * arch.hidden * kv  # q, o; k, v
    mlp = 3 * arch.hidden * arch.intermediate
    assert linear_weights(model) == (arch.layers * (attention + mlp), arch.vocab * arch.hidden)


@pytest.mark.parametrize("prompt_len, response_len, group_size", [(5, 3, 4), (1, 1, 2), (16, 7, 3)])
def test_attended_pairs_are_those_the_packed_mask_allows(prompt_len, response_len, group_size):
    from tidal.trainer.packing import dense_attention_mask, pack_groups

    group = (list(range(prompt_len)), [list(range(response_len))] * group_size)
    packed = pack_groups([group])
    assert attended_pairs(prompt_len, response_len, group_size) == int(dense_attention_mask(packed).sum())


def test_step_flops_add_six_per_weight_per_token_and_the_attention():
    arch = MODELS["tiny"]

    class Args:
        groups, group_size, prompt_len, response_len = 2, 4, 10, 6

    body, head = 1000, 300
    flops, processed, trained = step_flops(arch, body, head, Args)
    assert (processed, trained) == (2 * (10 + 4 * 6), 2 * 4 * 6)
    pairs = 2 * attended_pairs(10, 6, 4)
    assert math.isclose(flops, 6 * body * processed + 6 * head * trained + 12 * arch.layers * arch.hidden * pairs)
