"""The deepspeed strategy (ZeRO-2 and ZeRO-3) at 2 gloo ranks against one process, in subprocesses.

Same yardsticks as tests/test_distributed.py: gradients within 1e-6 of one process's, weights after
3 AdamW steps no further from one process than two single-process runs that only split the
micro-batches differently (the noise floor, measured here). Under ZeRO the gradients live in flat
fp32 partitions and are complete only inside the engine's step, so the gradient compared is the one
the optimizer is handed at the first step (tests/distributed_learner.py, DeepSpeedGradients).

Nothing here needs environment variables: the strategy sets DS_ACCELERATOR from the trainer's device
and skips the shared-memory op DeepSpeed would otherwise JIT-compile on CPU (~1 min), so a fresh CI
environment pays no compile.

Run as a module (`python -m tests.test_deepspeed divisor-contract`) it checks, at one rank, the
DeepSpeed behaviour `set_gradient_divisor` relies on.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from tests.conftest import learner_run, max_diff
from tidal.config import TrainerConfig

ROOT = Path(__file__).resolve().parent.parent

if find_spec("deepspeed") is None:  # in the test extra: a missing install is an error, not a skip
    raise ImportError("tests/test_deepspeed.py needs DeepSpeed: pip install -e '.[test]' (it includes deepspeed)")


def zero_run(out: Path, stage: int, *args: str) -> dict:
    return learner_run(out, 2, "--strategy", "deepspeed", "--zero-stage", str(stage), *args)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The single-process references, run once for both stages."""
    base = tmp_path_factory.mktemp("one-process")
    learner_run(base / "single", 1, "--strategy", "single")
    learner_run(base / "split", 1, "--strategy", "single", "--token-budget", "60")  # the noise floor
    learner_run(base / "uneven", 1, "--strategy", "single", "--uneven", "--token-budget", "40")
    return base


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_gradients_weights_and_resume_match_one_process(tmp_path, one_process, stage):
    counts = zero_run(tmp_path, stage, "--resume-check")
    single = json.loads((one_process / "single" / "counts.json").read_text())
    assert counts["world_size"] == 2 and all(n >= 1 for n in counts["micro_batches_per_rank"])  # both ranks trained
    assert max_diff(one_process / "single" / "grads.safetensors", tmp_path / "grads.safetensors") < 1e-6
    assert counts["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)  # DeepSpeed's global norm, unscaled
    floor = max_diff(one_process / "single" / "weights.safetensors", one_process / "split" / "weights.safetensors")
    moved = max_diff(one_process / "single" / "weights.safetensors", tmp_path / "weights.safetensors")
    assert 0 < floor < 1e-4 and moved <= floor, (moved, floor)
    # optimizer shards through safetensors into a fresh learner: it ends exactly where this one does
    for rank in (0, 1):
        shard = load_file(str(tmp_path / f"optimizer-rank{rank}.safetensors"))
        moments = [v for k, v in shard.items() if k.endswith("::exp_avg")]
        assert moments and all(v.abs().sum() > 0 for v in moments), sorted(shard)
        assert int(shard["__scheduler_step__"]) == 2
    assert max_diff(tmp_path / "weights.safetensors", tmp_path / "resumed.safetensors") == 0.0


@pytest.mark.parametrize("stage", [2, 3])
def test_uneven_micro_batches_neither_hang_nor_lose_exactness(tmp_path, one_process, stage):
    """2 vs 3 micro-batches: the short rank's zero-gradient micro-batch gives ZeRO's per-backward
    reduce-scatter (and ZeRO-3's gathers) the same count on both ranks."""
    counts = zero_run(tmp_path, stage, "--uneven", "--token-budget", "40")
    per_rank = counts["micro_batches_per_rank"]
    assert per_rank[0] != per_rank[1], per_rank
    assert max_diff(one_process / "uneven" / "grads.safetensors", tmp_path / "grads.safetensors") < 1e-6
    assert max_diff(one_process / "uneven" / "weights.safetensors", tmp_path / "weights.safetensors") < 5e-5


def test_zero3_frozen_copies_reference_and_old_policy(tmp_path):
    """A KL reference and an old policy (two steps per iteration): under ZeRO-3 both are
    partitioned inference engines and the old policy is re-copied from the policy's partitions
    at every iteration."""
    learner_run(tmp_path / "single", 1, "--strategy", "single", "--frozen")
    zero_run(tmp_path / "zero3", 3, "--frozen")
    assert max_diff(tmp_path / "single" / "grads.safetensors", tmp_path / "zero3" / "grads.safetensors") < 1e-6
    assert max_diff(tmp_path / "single" / "weights.safetensors", tmp_path / "zero3" / "weights.safetensors") < 5e-5


def test_gradient_divisor_contract():
    proc = subprocess.run([sys.executable, "-m", "tests.test_deepspeed", "divisor-contract"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "contract holds" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_tidal_owned_keys_pass_through_or_contradict_clearly():
    from tidal.trainer.deepspeed_config import deepspeed_config

    user = {"zero_optimization": {"reduce_bucket_size": 1000, "stage": 3}, "gradient_clipping": 0.5, "wall_clock_breakdown": True}
    merged = deepspeed_config(TrainerConfig(strategy="deepspeed", zero_stage=3, max_grad_norm=0.5, deepspeed=user), world_size=4)
    assert merged["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 3} and merged["wall_clock_breakdown"] is True
    assert (merged["train_batch_size"], merged["train_micro_batch_size_per_gpu"], merged["gradient_accumulation_steps"]) == (4, 1, 1)
    assert merged["managed_gradient_accumulation"] is False and merged["gradient_clipping"] == 0.5
    contradictions = [
        (
            {"zero_stage": 2, "deepspeed": {"zero_optimization": {"stage": 3}}},
            "trainer.deepspeed.zero_optimization.stage is 3 but Tidal sets it to 2 from trainer.zero_stage",
        ),
        ({"deepspeed": {"gradient_clipping": 0.5}}, "trainer.deepspeed.gradient_clipping is 0.5 but Tidal sets it to 1.0 from trainer.max_grad_norm"),
        (
            {"deepspeed": {"gradient_accumulation_steps": 8}},
            "trainer.deepspeed.gradient_accumulation_steps is 8 but Tidal sets it to 1 from Tidal streams",
        ),
        ({"deepspeed": {"bf16": {"enabled": True}}}, "trainer.deepspeed.bf16.enabled is True but Tidal sets it to False from trainer.param_dtype"),
        (
            {"param_dtype": "bfloat16", "deepspeed": {"bf16": {"check_grad_overflow": False}}},
            "trainer.deepspeed.bf16.check_grad_overflow is False but Tidal sets it to True from trainer.max_skipped_steps",
        ),
        ({"deepspeed": {"optimizer": {"type": "Adam"}}}, "trainer.deepspeed.optimizer cannot be set: Tidal builds the optimizer"),
        ({"param_dtype": "float16"}, "float16 is not supported by trainer.strategy 'deepspeed'"),
    ]
    for fields, message in contradictions:
        with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
            TrainerConfig(strategy="deepspeed", **fields)
    with pytest.raises(ValidationError, match="trainer.deepspeed is set but trainer.strategy is 'fsdp2'"):
        TrainerConfig(strategy="fsdp2", deepspeed={})
    with pytest.raises(ValueError, match="trainer.deepspeed.train_batch_size is 8 but Tidal sets it to 2"):
        deepspeed_config(TrainerConfig(strategy="deepspeed", deepspeed={"train_batch_size": 8}), world_size=2)


def test_a_missing_deepspeed_names_the_extra(monkeypatch):
    import importlib.util

    from tidal.trainer.distributed import SINGLE
    from tidal.trainer.strategy import build_strategy

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "deepspeed" else real(name, *a, **k))
    with pytest.raises(ImportError, match=r"pip install 'tidal\[deepspeed\]'"):
        build_strategy(TrainerConfig(strategy="deepspeed", device="cpu"), SINGLE)


def divisor_contract() -> None:
    """What set_gradient_divisor relies on, at one rank, ZeRO-2 and ZeRO-3, with SGD(lr=1) so the
    update *is* the gradient: two backward passes accumulate the unscaled sum; a step after
    set_gradient_divisor(D) applies sum/D and reports ||sum||/D as the global norm; with clipping the
    update's norm is the clip and the reported norm is still the pre-clip one; back at divisor 1 the
    next step applies the plain sum."""
    from tidal.trainer.deepspeed_config import deepspeed_config
    from tidal.trainer.deepspeed_strategy import import_deepspeed, set_gradient_divisor
    from tidal.trainer.distributed import SINGLE, ensure_process_group

    deepspeed = import_deepspeed("cpu")
    ensure_process_group(SINGLE, "cpu")
    os.environ.setdefault("LOCAL_RANK", "0")
    for stage in (2, 3):
        for clip in (1e9, 1e-3):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
            reference = [p.detach().clone() for p in model.parameters()]
            x1, x2 = torch.randn(5, 4), torch.randn(7, 4)
            plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
            plain.load_state_dict(model.state_dict())
            (plain(x1).pow(2).sum() + plain(x2).pow(2).sum()).backward()
            grads = [p.grad for p in plain.parameters()]
            norm = torch.sqrt(sum((g * g).sum() for g in grads)).item()
            extra = {"deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}} if stage == 3 else {}
            cfg = TrainerConfig(strategy="deepspeed", zero_stage=stage, max_grad_norm=clip, device="cpu", **extra)
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=deepspeed_config(cfg, 1))
            set_gradient_divisor(engine.optimizer, 1.0)
            engine.backward(engine(x1).pow(2).sum())
            engine.backward(engine(x2).pow(2).sum())
            set_gradient_divisor(engine.optimizer, 4.0)
            engine.step()
            set_gradient_divisor(engine.optimizer, 1.0)
            after = [deepspeed.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
            updates = [r - a for r, a in zip(reference, after)]
            reported = float(engine.get_global_grad_norm())
            assert abs(reported - norm / 4) < 1e-5 * norm, (stage, clip, reported, norm / 4)
            if clip > 1:
                worst = max((u - g / 4).abs().max().item() for u, g in zip(updates, grads))
                assert worst < 1e-6, (stage, "the step did not apply sum/D", worst)
            else:
                update_norm = torch.sqrt(sum((u * u).sum() for u in updates)).item()
                assert abs(update_norm - clip) < 1e-3 * clip, (stage, "the step did not clip by the unscaled norm", update_norm)
                continue
            engine.backward(engine(x1).pow(2).sum())  # divisor back at 1: the plain gradient
            engine.step()
            final = [deepspeed.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
            check = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
            with torch.no_grad():
                for p, value in zip(check.parameters(), after):
                    p.copy_(value)
            check(x1).pow(2).sum().backward()
            worst = max((a - f - p.grad).abs().max().item() for a, f, p in zip(after, final, check.parameters()))
            # the update is read back as a difference of weights: float32 rounding of their size, not of the update's
            rounding = 4 * torch.finfo(torch.float32).eps * max(1.0, *(a.abs().max().item() for a in after + final))
            assert worst < rounding, (stage, "at divisor 1 the step did not apply the plain gradient", worst, rounding)
            # a finite loss whose gradient is inf: the engine's step must leave the weights alone and
            # report a non-finite norm, which is what the learner's guard counts as a skipped step
            poison = next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
            loss = engine(x1).pow(2).sum()
            assert torch.isfinite(loss)
            engine.backward(loss)
            engine.step()
            poison.remove()
            untouched = [deepspeed.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(final, untouched)), (stage, "a step with an inf gradient norm changed the weights")
            assert not math.isfinite(float(engine.get_global_grad_norm())), (stage, engine.get_global_grad_norm())
    print("contract holds")


if __name__ == "__main__" and sys.argv[1:] == ["divisor-contract"]:
    divisor_contract()
