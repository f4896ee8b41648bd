"""The arrival check's rule (tidal.model.probe): the mean per-token difference against a tolerance per dtype, a probe
whose responses are the model's own samples, vLLM's serving dtype on CPU, and vLLM's output kept off the terminal
of the process that logs to a file (the launcher). The separation it rests on is measured by
benchmarks/arrival_separation.py (docs/vllm.md#the-arrival-check)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tidal.config import config_from_dict
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.model.probe import (
    DTYPE_TOLERANCE,
    HF_TOLERANCE,
    arrival_tolerance,
    largest_difference,
    make_probe,
    probe_difference,
    probe_logprobs,
    sample_responses,
    trainer_compute_dtypes,
)
from tidal.rollout.arrival import compare_probe
from tidal.rollout.vllm_args import serving_dtype
from tidal.weights import WeightsDidNotArriveError


def test_the_statistic_is_the_mean_so_a_few_far_tokens_pass_and_a_moved_distribution_does_not():
    trainer = [[-2.0, -3.0, -9.0, -1.0, -4.0, -6.0] for _ in range(3)]
    # half precision: most tokens within rounding, one low-probability token far off (what a maximum refused)
    right = [[x + 0.01 for x in row] for row in trainer]
    right[1][2] += 0.8
    # a wrong version: every token moved a little
    wrong = [[x + (0.45 if i % 2 else -0.45) for i, x in enumerate(row)] for row in trainer]
    tolerance = DTYPE_TOLERANCE["bfloat16"]
    assert largest_difference(trainer, right) > tolerance > probe_difference(trainer, right)
    assert compare_probe({"logprobs": trainer}, right, 3, tolerance, "w0") == pytest.approx((17 * 0.01 + 0.81) / 18)
    with pytest.raises(WeightsDidNotArriveError, match=r"^weights v3 did not arrive on worker w0: .* by 0\.45 per token on average, up to 0\.45 "):
        compare_probe({"logprobs": trainer}, wrong, 3, tolerance, "w0")
    assert probe_difference(trainer, trainer[:2]) == float("inf")  # another shape is never a pass


def test_the_default_tolerance_follows_the_dtypes_both_sides_compute_in():
    assert config_from_dict({}).weights.arrival_tolerance is None
    # the HF engine in the trainer's own dtype runs the trainer's code: exact up to HF_TOLERANCE, whatever the dtype
    for dtype in DTYPE_TOLERANCE:
        assert arrival_tolerance(None, "hf", dtype, dtype, dtype) == HF_TOLERANCE
    # ... but a trainer computing under fsdp2/DeepSpeed mixed precision is another dtype: its tolerance
    mixed = config_from_dict({"trainer": {"param_dtype": "bfloat16"}})
    assert trainer_compute_dtypes(mixed.model.dtype, mixed.trainer.param_dtype) == ("float32", "bfloat16")
    assert arrival_tolerance(None, "hf", *trainer_compute_dtypes(mixed.model.dtype, mixed.trainer.param_dtype)) == DTYPE_TOLERANCE["bfloat16"]
    assert trainer_compute_dtypes(config_from_dict({}).model.dtype, config_from_dict({}).trainer.param_dtype) == ("float32", "float32")
    # vLLM: the coarsest of the engine's dtype and the trainer's
    assert arrival_tolerance(None, "vllm", "float32", "float32") == DTYPE_TOLERANCE["float32"]
    assert arrival_tolerance(None, "vllm", "float16", "float32") == DTYPE_TOLERANCE["float16"]
    assert arrival_tolerance(None, "vllm", "float32", "bfloat16") == DTYPE_TOLERANCE["bfloat16"]
    assert DTYPE_TOLERANCE["float32"] < DTYPE_TOLERANCE["float16"] < DTYPE_TOLERANCE["bfloat16"]
    assert arrival_tolerance(0.02, "vllm", "bfloat16") == 0.02 and arrival_tolerance(0.0, "hf") == 0.0  # as set; 0: off


def test_vllm_on_cpu_serves_the_trainers_dtype_unless_told_and_a_gpu_keeps_vllms_choice():
    cfg = config_from_dict({"rollout": {"engine": "vllm"}})
    assert cfg.rollout.vllm.dtype == "auto"
    assert serving_dtype(cfg, "cpu") == "float32"  # vLLM's own 'auto' would serve this float32 model in bfloat16
    assert serving_dtype(config_from_dict({"model": {"dtype": "bfloat16"}, "rollout": {"engine": "vllm"}}), "cpu") == "bfloat16"
    assert serving_dtype(cfg, "cuda") == "auto"
    pinned = config_from_dict({"rollout": {"engine": "vllm", "vllm": {"dtype": "bfloat16"}}})
    assert serving_dtype(pinned, "cpu") == serving_dtype(pinned, "cuda") == "bfloat16"


@pytest.fixture(scope="module")
def trained_tiny():
    """A tiny model taught one continuation, so that its distribution is far from uniform."""
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    tiny = config_from_dict({"model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}}})
    model = build_tiny_model(tiny.model.tiny, tok)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([tok("1+2=3;4+5=9;" * 3, add_special_tokens=False).input_ids])
    for _ in range(60):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def test_the_probe_responses_are_the_models_own_samples_and_the_same_on_every_call(trained_tiny):
    vocab = trained_tiny.get_input_embeddings().num_embeddings
    uniform = make_probe(0, vocab)
    sampled = sample_responses(trained_tiny, uniform, seed=0)
    assert [s["prompt_ids"] for s in sampled] == [s["prompt_ids"] for s in uniform]
    assert [len(s["response_ids"]) for s in sampled] == [len(s["response_ids"]) for s in uniform]
    assert sample_responses(trained_tiny, uniform, seed=0) == sampled  # every trainer rank draws the same tokens
    assert sample_responses(trained_tiny, uniform, seed=1) != sampled
    # tokens the model finds likely, where half precision moves log-probs least; uniform ones it finds unlikely
    mean = lambda logprobs: sum(map(sum, logprobs)) / sum(map(len, logprobs))  # noqa: E731
    assert mean(probe_logprobs(trained_tiny, sampled)) > mean(probe_logprobs(trained_tiny, uniform)) + 1.0


def test_a_process_that_logs_to_a_file_keeps_its_children_and_its_teardown_off_the_terminal(tmp_path):
    """What vLLM does in the launcher: engine processes started inside output_to_log inherit the log as
    stdout/stderr, a library's console handler is moved into the log, and what the interpreter's teardown prints
    (triton's nanobind leak report) goes there too; the process's own prints stay on the terminal."""
    log = tmp_path / "launcher.log"
    script = textwrap.dedent(
        f"""
        import atexit, logging, os, subprocess, sys
        atexit.register(lambda: os.write(2, b"nanobind: leaked 4 instances!\\n"))  # runs last: at teardown
        from tidal.logs import library_logs_to_log, output_to_log, setup_logging
        setup_logging({str(log)!r})
        noisy = logging.getLogger("noisy_library")
        noisy.addHandler(logging.StreamHandler(sys.stdout))
        print("before", flush=True)
        with output_to_log():
            subprocess.run([sys.executable, "-c", "import sys; print('engine core up'); print('engine warning', file=sys.stderr)"])
            library_logs_to_log("noisy_library")
        noisy.warning("engine shutting down")
        print("Tidal run finished", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["before", "Tidal", "run", "finished"] and proc.stderr == ""
    written = log.read_text()
    for line in ("engine core up", "engine warning", "engine shutting down", "nanobind: leaked 4 instances!"):
        assert line in written, written


def test_in_half_precision_an_engine_calibrates_its_tolerance_on_the_base_model_and_refuses_a_base_that_is_not_the_trainers():
    from tidal.model.probe import BASE_BOUND, CALIBRATION_FACTOR
    from tidal.rollout.arrival import ArrivalCheck

    base = [[-1.0, -2.0, -0.5] for _ in range(3)]
    trained = [[x - 0.5 for x in row] for row in base]
    record = {"sequences": [], "logprobs": trained, "base_logprobs": base}
    shifted = lambda rows, by: [[x + by for x in row] for row in rows]  # noqa: E731
    # float32 on both sides: the table's tolerance, nothing to calibrate
    exact = ArrivalCheck(None, "vllm", ("float32", "float32", "float32"), "w0")
    assert not exact.wants_base(record) and exact.tolerance == DTYPE_TOLERANCE["float32"]
    # bfloat16 serving, a quiet base (0.01 per token): the dtype's tolerance stands
    quiet = ArrivalCheck(None, "vllm", ("bfloat16", "float32", "float32"), "w0")
    assert quiet.wants_base(record) and not quiet.wants_base({"sequences": [], "logprobs": trained})  # an older run's record
    assert quiet.calibrate(record, shifted(base, 0.01)) == pytest.approx(0.01) and not quiet.wants_base(record)
    assert quiet.tolerance == DTYPE_TOLERANCE["bfloat16"]
    # a noisier engine (a deeper model, other kernels): 0.06 on the base, so versions get CALIBRATION_FACTOR x that
    noisy = ArrivalCheck(None, "vllm", ("bfloat16", "float32", "float32"), "w1")
    noisy.calibrate(record, shifted(base, 0.06))
    assert noisy.tolerance == pytest.approx(CALIBRATION_FACTOR * 0.06) and noisy.tolerance > DTYPE_TOLERANCE["bfloat16"]
    assert noisy.check(record, shifted(trained, 0.2), 1) == pytest.approx(0.2)  # over the dtype's tolerance: passes here
    with pytest.raises(
        WeightsDidNotArriveError,
        match=rf"^weights v2 did not arrive on worker w1: .* by 0\.5 per token .*calibrated on the base model \({CALIBRATION_FACTOR}x its 0\.06\)",
    ):
        noisy.check(record, base, 2)  # the engine still serves the base
    # a base that is another model: the engine stops before its first version
    other = ArrivalCheck(None, "vllm", ("bfloat16", "float32", "float32"), "w2")
    with pytest.raises(
        WeightsDidNotArriveError,
        match=rf"^the base model did not arrive on worker w2: .* by 2 per token on average \(at most {BASE_BOUND['bfloat16']:g} in bfloat16\)",
    ):
        other.calibrate(record, shifted(base, -2.0))
    # a tolerance the user set is theirs: no calibration
    assert not ArrivalCheck(0.05, "vllm", ("bfloat16", "float32"), "w0").wants_base(record)
