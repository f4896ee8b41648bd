"""Runs the learner on fixed groups under torchrun (or alone) and writes what the tests compare.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_learner.py OUT_DIR --strategy fsdp2
    python tests/distributed_learner.py OUT_DIR --strategy single [--token-budget N]

Writes (rank 0): grads.safetensors (full gradients after the first iteration's accumulation and
1/N scaling, before clipping), weights.safetensors (after `--iterations` AdamW steps), and
counts.json (micro-batches run per rank, so a test can check the uneven case really was uneven).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from tidal.config import TinyModelConfig, TrainerConfig  # noqa: E402
from tidal.model.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from tidal.protocol import Group, Sample  # noqa: E402
from tidal.trainer.distributed import all_reduce_sum, context_from_env, init_process_group, shutdown  # noqa: E402
from tidal.trainer.learner import Learner  # noqa: E402
from tidal.trainer.strategy import build_strategy  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--uneven", action="store_true", help="one huge group: one rank runs more micro-batches than the other")
    args = ap.parse_args()
    ctx = context_from_env()
    torch.set_num_threads(1)
    init_process_group(ctx, "cpu")
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok)
    cfg = TrainerConfig(strategy=args.strategy, lr=1e-2, warmup_steps=0, max_grad_norm=1e9, token_budget=args.token_budget, device="cpu")
    learner = Learner(cfg, model, tok.pad_token_id, strategy=build_strategy(cfg, ctx), device="cpu")
    out = Path(args.out)
    micro = []
    for it in range(args.iterations):
        learner.begin_iteration(it)
        groups = fixed_groups(it)
        if args.uneven:
            groups[0].samples = [Sample(np.arange(4, 12, dtype=np.int32), np.full(8, -1.0, dtype=np.float32), float(r)) for r in (0, 1, 2, 3)]
        before = learner.forwards["policy"]
        learner.train_on_groups(groups)
        micro.append(learner.forwards["policy"] - before)
        if it == 0:
            units = all_reduce_sum([learner.units], ctx)[0]
            grads = {n: full(p.grad).detach().clone() / units for n, p in learner.model.named_parameters() if p.grad is not None}
            if ctx.is_main:
                save_file({n: g.contiguous() for n, g in grads.items()}, str(out / "grads.safetensors"))
        learner.step()
    weights = learner.full_state_dict()
    # real micro-batches per rank in the first iteration (padding ones are not counted)
    per_rank = all_reduce_sum([float(micro[0]) if r == ctx.rank else 0.0 for r in range(ctx.world_size)], ctx)
    if ctx.is_main:
        tied_alias = [k for k in weights if k.startswith("lm_head.") and model.config.tie_word_embeddings]
        save_file({k: v.detach().clone().contiguous() for k, v in weights.items() if k not in tied_alias}, str(out / "weights.safetensors"))
        (out / "counts.json").write_text(json.dumps({"micro_batches_per_rank": per_rank, "world_size": ctx.world_size}))
    shutdown()


if __name__ == "__main__":
    main()
