"""Runs the learner on fixed groups under torchrun (or alone) and writes what the tests compare.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_learner.py OUT_DIR --strategy fsdp2
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_learner.py OUT_DIR --strategy deepspeed --zero-stage 3
    python tests/distributed_learner.py OUT_DIR --strategy single [--token-budget N]

Writes (rank 0): grads.safetensors (full gradients after the first iteration's accumulation and
1/N scaling, before clipping), weights.safetensors (after `--iterations` AdamW steps), and
counts.json (micro-batches run per rank, so a test can check the uneven case really was uneven,
and each step's grad_norm). Under deepspeed the gradients live in ZeRO's flat fp32 partitions and
are only complete inside the engine's step, so grads.safetensors holds the gradient the optimizer is
handed at the first step (captured by a step pre-hook on the torch AdamW, then reassembled per
parameter); with max_grad_norm 1e9 that is the same 1/N-scaled gradient.

--frozen adds a KL reference and an old policy (two optimizer steps per iteration, on halves of the
groups), so the frozen copies' layout and the old policy's per-iteration copy are compared too.

--lora trains a peft LoRA adapter on the tiny model; weights.safetensors (and resumed.safetensors)
then hold the adapter under peft's names, grads.safetensors the adapter's gradients.

--probe publishes every version as the trainer does (`publish_weights`: the weights and the arrival
check's probe log-probs, which every rank computes) into OUT_DIR/weights, v0 before training and each
iteration's after it, then takes the boundary's optimizer snapshot; a twin learner trains beside it
on the same groups and publishes without a probe (the check off) into OUT_DIR/unprobed-weights, its
final weights in unprobed.safetensors. counts.json then records, per probe forward, whether every
rank's policy was left sharded as training leaves it ("sharded_after_probe").

--resume-check (any strategy): after the second iteration, the optimizer shards and full weights go
through safetensors files into a fresh learner (the base model, a new strategy);
it trains the remaining iterations beside the original and its weights are written to
resumed.safetensors (a resumed run must end exactly where the uninterrupted one does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from tidal.config import LoraConfig, TinyModelConfig, TrainerConfig  # noqa: E402
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from tidal.model.lora import adapter_config, apply_lora  # noqa: E402
from tidal.model.probe import make_probe  # noqa: E402
from tidal.protocol import Group, Sample  # noqa: E402
from tidal.trainer.boundary import publish_weights  # noqa: E402
from tidal.trainer.checkpoint import optimizer_snapshot  # noqa: E402
from tidal.trainer.distributed import all_reduce_sum, context_from_env, init_process_group, shutdown  # noqa: E402
from tidal.trainer.learner import Learner  # noqa: E402
from tidal.trainer.strategy import build_strategy  # noqa: E402
from tidal.weights import WeightStore  # noqa: E402

LORA = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


def fixed_groups(iteration: int, count: int = 6) -> list[Group]:
    """Groups of varied prompt and response lengths with graded rewards, the same on every rank."""
    rng = np.random.default_rng(1000 + iteration)
    groups = []
    for i in range(count):
        prompt = rng.integers(4, 60, int(rng.integers(3, 12)), dtype=np.int32)
        samples = []
        for _ in range(4):
            n = int(rng.integers(1, 9))
            samples.append(Sample(rng.integers(4, 60, n, dtype=np.int32), np.full(n, -1.0, dtype=np.float32), float(rng.integers(0, 4))))
        groups.append(Group(iteration, i, iteration, "fixed", prompt, samples))
    return groups


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class DeepSpeedGradients:
    """The gradients ZeRO hands its torch optimizer at the next step, per named parameter.

    Test-only reading of DeepSpeed internals (ZeRO-2: each parameter's `_hp_mapping` fragment of
    the flat fp32 partition; ZeRO-3: parameters' partitions laid end to end in `fp16_groups` order);
    if a DeepSpeed version changes them, the gradient comparison fails rather than passes."""

    def __init__(self, learner: Learner):
        self.engine, self.captured = learner.model.engine, {}
        self.handle = learner.optimizer.register_step_pre_hook(self._capture)

    def _capture(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.captured[id(p)] = p.grad.detach().clone()

    def collect(self) -> dict[str, torch.Tensor]:
        """A collective: every rank calls it after the step; every rank gets the full gradients."""
        self.handle.remove()
        zero, names = self.engine.optimizer, {id(p): n for n, p in self.engine.module.named_parameters()}
        out = {}
        if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
            for flat, params in zip(zero.fp32_partitioned_groups_flat, zero.fp16_groups):
                grad, offset = self.captured[id(flat)], 0
                for p in params:
                    n = p.partition_numel()
                    parts = [torch.empty(n) for _ in range(dist.get_world_size())]
                    dist.all_gather(parts, grad[offset : offset + n].contiguous())
                    out[names[id(p)]] = torch.cat(parts)[: p.ds_numel].view(p.ds_shape)
                    offset += n
        else:  # ZeRO-2
            for flat, params in zip(zero.single_partition_of_fp32_groups, zero.bit16_groups):
                grad = self.captured[id(flat)]
                for p in params:
                    buffer = torch.zeros(p.numel())
                    mapping = getattr(p, "_hp_mapping", None)
                    if mapping is not None:
                        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                        buffer[lp.start : lp.start + lp.numel] = grad[hp.start : hp.start + hp.numel]
                    dist.all_reduce(buffer)
                    out[names[id(p)]] = buffer.view_as(p)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--uneven", action="store_true", help="one huge group: one rank runs more micro-batches than the other")
    ap.add_argument("--zero-stage", type=int, default=2, choices=(2, 3), help="--strategy deepspeed: the ZeRO stage")
    ap.add_argument("--resume-check", action="store_true", help="also resume a fresh learner from the second iteration's shards")
    ap.add_argument("--frozen", action="store_true", help="a KL reference and an old policy: two optimizer steps per iteration")
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute activations in backward")
    ap.add_argument("--lora", action="store_true", help="a LoRA adapter (peft): only it trains; weights.safetensors holds the adapter")
    ap.add_argument("--probe", action="store_true", help="publish each version with the arrival check's probe; a twin publishes without")
    args = ap.parse_args()
    ctx = context_from_env()
    torch.set_num_threads(1)
    init_process_group(ctx, "cpu")
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    tiny = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    lora = LORA if args.lora else None
    model = make_model(tiny, tok, lora)
    extra = {}
    if args.strategy == "deepspeed":
        # every weight of the tiny model is under ZeRO-3's default persistence threshold: partition them all
        extra = {
            "zero_stage": args.zero_stage,
            "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if args.zero_stage == 3 else None,
        }
    if args.frozen:
        extra.update(kl_coef=0.05, updates_per_iteration=2)
    if args.activation_checkpointing:
        extra.update(activation_checkpointing=True)
    cfg = TrainerConfig(strategy=args.strategy, lr=1e-2, warmup_steps=0, max_grad_norm=1e9, token_budget=args.token_budget, device="cpu", **extra)
    learner = Learner(cfg, model, tok.pad_token_id, strategy=build_strategy(cfg, ctx), device="cpu")
    learners = [learner]
    out = Path(args.out)
    micro, norms, sharded = [], [], []
    stores = {}
    if args.probe:
        twin = Learner(cfg, fresh_model(tiny, tok, lora), tok.pad_token_id, strategy=build_strategy(cfg, ctx), device="cpu")
        learners.append(twin)
        # as the trainer builds it (roles.trainer_weight_store): responses sampled by every rank together, the base's record
        probe = learner.sample_probe(make_probe(0, int(model.get_input_embeddings().num_embeddings)), 0)
        stores = {
            learner: weight_store(out / "weights", learner, probe, learner.probe_logprobs(probe)),
            twin: weight_store(out / "unprobed-weights", twin, None),
        }
    for lrn, store in stores.items():
        publish_weights(store, 0, lrn)
        sharded.append(all_sharded(lrn))
    for it in range(args.iterations):
        groups = fixed_groups(it)
        if args.uneven:
            groups[0].samples = [Sample(np.arange(4, 12, dtype=np.int32), np.full(8, -1.0, dtype=np.float32), float(r)) for r in (0, 1, 2, 3)]
        batches = [groups[:3], groups[3:]] if args.frozen else [groups]  # one optimizer step per batch
        for lrn in learners:
            lrn.begin_iteration(it)
            for b, batch in enumerate(batches):
                first = it == 0 and b == 0 and lrn is learner  # the gradients compared: the first learner's
                before = lrn.forwards["policy"]
                lrn.train_on_groups(batch)
                if lrn is learner and b == 0:
                    micro.append(lrn.forwards["policy"] - before)
                if first and args.strategy != "deepspeed":
                    units = all_reduce_sum([lrn.units], ctx)[0]
                    grads = {n: full(p.grad).detach().clone() / units for n, p in lrn.model.named_parameters() if p.grad is not None}
                capture = DeepSpeedGradients(lrn) if first and args.strategy == "deepspeed" else None
                metrics = lrn.step()
                if lrn is learner:
                    norms.append(metrics["grad_norm"])
                if capture is not None:
                    grads = capture.collect()
                if first and ctx.is_main:
                    save_file({n: g.contiguous() for n, g in grads.items()}, str(out / "grads.safetensors"))
        for lrn, store in stores.items():  # what the iteration boundary does
            publish_weights(store, it + 1, lrn)
            sharded.append(all_sharded(lrn))
            optimizer_snapshot(lrn)
        if args.resume_check and it == 1:
            learners.append(resumed_learner(learner, cfg, ctx, tiny, tok, out, lora))
    weights = learner.full_state_dict()
    resumed = learners[-1].full_state_dict() if args.resume_check else {}
    unprobed = learners[1].full_state_dict() if args.probe else {}
    # real micro-batches per rank in the first iteration (padding ones are not counted)
    per_rank = all_reduce_sum([float(micro[0]) if r == ctx.rank else 0.0 for r in range(ctx.world_size)], ctx)
    if ctx.is_main:
        tied_alias = [k for k in weights if k.startswith("lm_head.") and model.config.tie_word_embeddings]
        save_file({k: v.detach().clone().contiguous() for k, v in weights.items() if k not in tied_alias}, str(out / "weights.safetensors"))
        if resumed:
            save_file({k: v.detach().clone().contiguous() for k, v in resumed.items() if k not in tied_alias}, str(out / "resumed.safetensors"))
        if unprobed:
            save_file({k: v.detach().clone().contiguous() for k, v in unprobed.items() if k not in tied_alias}, str(out / "unprobed.safetensors"))
        counts = {"micro_batches_per_rank": per_rank, "world_size": ctx.world_size, "grad_norms": norms, "sharded_after_probe": sharded}
        (out / "counts.json").write_text(json.dumps(counts))
    if ctx.distributed:
        # every rank leaves together, and without the interpreter's teardown: under load a rank has aborted
        # there ("terminate called without an active exception", a C++ thread of gloo or DeepSpeed destroyed
        # while joinable) after its results were complete, failing a run that had nothing wrong with it
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    shutdown()


def make_model(tiny: TinyModelConfig, tok, lora: LoraConfig | None) -> torch.nn.Module:
    """The tiny model from seed 0; with `lora`, wrapped by peft (the adapter's A from seed 0 too)."""
    model = build_tiny_model(tiny, tok)
    return apply_lora(model, lora, seed=0) if lora is not None else model


def fresh_model(tiny: TinyModelConfig, tok, lora: LoraConfig | None) -> torch.nn.Module:
    """The same start as the first learner's: the base model (and adapter) from seed 0 again."""
    torch.manual_seed(0)
    return make_model(tiny, tok, lora)


def weight_store(root: Path, learner: Learner, probe: list | None, base_logprobs: list | None = None) -> WeightStore:
    """A store as the trainer's (adapters under LoRA, on no base directory: nothing loads them here)."""
    return WeightStore(root, None, adapter_config(learner.peft_model, None) if learner.lora else None, probe, base_logprobs)


def all_sharded(learner: Learner) -> bool:
    """Whether every rank's policy parameters are all in their sharded form (each rank's answer, all-reduced):
    fsdp2's registered parameters are DTensors, ZeRO-3's are released to their partitions; one process,
    and ZeRO-2 (which does not partition weights), hold whole parameters by design: True."""
    from torch.distributed.tensor import DTensor

    params = list(learner.model.parameters())
    if learner.strategy.name == "fsdp2":
        mine = all(isinstance(p, DTensor) for p in params)
    elif any(hasattr(p, "ds_status") for p in params):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        mine = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params if hasattr(p, "ds_status"))
    else:
        mine = True
    return all_reduce_sum([0.0 if mine else 1.0], learner.ctx)[0] == 0.0


def resumed_learner(learner: Learner, cfg: TrainerConfig, ctx, tiny: TinyModelConfig, tok, out: Path, lora: LoraConfig | None) -> Learner:
    """What a restarted trainer does: each rank's optimizer shard and rank 0's full weights go
    through safetensors files; a fresh learner over the base model (a new strategy) loads them."""
    shard = out / f"optimizer-rank{ctx.rank}.safetensors"
    save_file(learner.optimizer_tensors(), str(shard))
    weights = learner.full_state_dict()
    if ctx.is_main:
        tied = learner.model.config.tie_word_embeddings
        save_file(
            {k: v.contiguous() for k, v in weights.items() if not (tied and k.startswith("lm_head."))}, str(out / "checkpoint-weights.safetensors")
        )
    if ctx.distributed:
        dist.barrier()
    # the base model again (the reference is a copy of it), then the checkpoint's weights
    fresh = Learner(cfg, fresh_model(tiny, tok, lora), tok.pad_token_id, strategy=build_strategy(cfg, ctx), device="cpu")
    fresh.load_weights(load_file(str(out / "checkpoint-weights.safetensors")))
    fresh.load_optimizer_tensors(load_file(str(shard)))
    return fresh


if __name__ == "__main__":
    main()
