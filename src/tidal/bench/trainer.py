"""Trainer strategies side by side: trained tokens/s and memory per rank for single, fsdp2 and
deepspeed at 1 and 2 ranks, full fine-tuning and LoRA, on the same model and the same groups (one run).

    tidal bench trainer [--strategies single,fsdp2,deepspeed] [--ranks 1,2] [--weights full,lora] [--lora-r 16]
                        [--hidden 256] [--layers 4] [--groups 16] [--group-size 8] [--prompt-len 48]
                        [--response-len 48] [--iterations 4] [--warmup 1] [--sync-reps 5] [--json out.json]
    (or: python benchmarks/trainer.py ...)

A LoRA row (`fsdp2@2+lora`) trains a rank-`--lora-r` adapter on every linear layer of the same model,
as `model.lora` does; a combination the config refuses is listed as skipped with the config's own refusal.

Weight sync per version (`--sync-reps` versions, the median): `snapshot` is the trainer's side (every
rank gathers the weights, or under LoRA the adapter; rank 0 serializes, hashes, signs and renames the
version into place), `load` a rollout worker's (the HF engine verifies, reads and sets the tensors in
place on its model), `version` the bytes of the version's tensor file. `--hidden 128 --layers 4` is the
model of examples/arithmetic.yaml and arithmetic-lora.yaml.

Each configuration runs in its own processes (torchrun for 2 ranks, gloo on CPU). Memory per rank
is what the layout keeps resident: parameters + gradients + optimizer state of this rank's shard
(bytes of the local tensors, at the end of an iteration's accumulation), and the process's peak
RSS. Ratios are against `single` at 1 rank, measured in the same run. On a CPU machine the ranks
share its cores, so tokens/s at 2 ranks shows the cost of sharding, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def synthetic_groups(iteration: int, count: int, group_size: int, prompt_len: int, response_len: int, vocab: int):
    """Fixed-length groups with graded rewards (every group trains): the same on every rank."""
    import numpy as np

    from tidal.protocol import Group, Sample

    rng = np.random.default_rng(iteration)
    groups = []
    for i in range(count):
        prompt = rng.integers(4, vocab, prompt_len, dtype=np.int32)
        samples = [
            Sample(rng.integers(4, vocab, response_len, dtype=np.int32), np.full(response_len, -1.0, dtype=np.float32), float(r))
            for r in rng.permutation(group_size)
        ]
        groups.append(Group(iteration, i, iteration, "bench", prompt, samples))
    return groups


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def resident_bytes(learner) -> dict[str, int]:
    import torch

    params = list(learner.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    optimizer_state = [v for state in learner.optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"param_bytes": local_bytes(params), "grad_bytes": local_bytes(grads), "optimizer_bytes": local_bytes(optimizer_state)}


def worker(args) -> None:
    """One rank: train `iterations` iterations on synthetic groups, write this configuration's figures."""
    import torch

    from tidal.config import TinyModelConfig, TrainerConfig
    from tidal.demo.tiny import build_char_tokenizer
    from tidal.trainer.distributed import all_reduce_max, all_reduce_sum, context_from_env, init_process_group, shutdown
    from tidal.trainer.learner import Learner
    from tidal.trainer.strategy import build_strategy

    ctx = context_from_env()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    init_process_group(ctx, "cpu")
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    tiny = TinyModelConfig(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2, max_position_embeddings=512
    )
    model = fresh_policy(tiny, tok, args.lora_r)
    cfg = TrainerConfig(strategy=args.strategy, device="cpu", warmup_steps=0, token_budget=args.token_budget)
    learner = Learner(cfg, model, tok.pad_token_id, strategy=build_strategy(cfg, ctx), device="cpu")
    vocab = int(model.get_input_embeddings().num_embeddings)
    seconds, tokens, memory = 0.0, 0.0, {}
    for it in range(args.warmup + args.iterations):
        groups = synthetic_groups(it, args.groups, args.group_size, args.prompt_len, args.response_len, vocab)
        learner.begin_iteration(it)
        t0 = time.perf_counter()
        learner.train_on_groups(groups)
        memory = resident_bytes(learner)  # gradients are allocated now, optimizer state from the previous step
        metrics = learner.step()
        elapsed = time.perf_counter() - t0
        if it >= args.warmup:
            seconds += all_reduce_max([elapsed], ctx)[0]
            tokens += metrics["trained_tokens"]
    memory["optimizer_bytes"] = resident_bytes(learner)["optimizer_bytes"]  # after a step: the moments exist
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sync = weight_sync_seconds(learner, lambda: fresh_policy(tiny, tok, args.lora_r), tok, args.sync_reps)
    fields = ["param_bytes", "grad_bytes", "optimizer_bytes", "peak_rss_bytes"]
    mine = [memory["param_bytes"], memory["grad_bytes"], memory["optimizer_bytes"], peak_rss]
    per_rank = all_reduce_sum([v if r == ctx.rank else 0.0 for r in range(ctx.world_size) for v in mine], ctx)
    if ctx.is_main:
        ranks = [dict(zip(fields, per_rank[r * len(fields) : (r + 1) * len(fields)])) for r in range(ctx.world_size)]
        Path(args.out).write_text(json.dumps({"seconds": seconds, "trained_tokens": tokens, "ranks": ranks, **sync}))
    shutdown()


def fresh_policy(tiny, tok, lora_r: int):
    """The base from seed 0, under LoRA wrapped by peft: the trainer's policy, and the model a rollout worker loads versions into."""
    import torch

    from tidal.demo.tiny import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model(tiny, tok)
    if lora_r:
        from tidal.config import LoraConfig
        from tidal.model.lora import apply_lora

        model = apply_lora(model, LoraConfig(r=lora_r, alpha=2.0 * lora_r), seed=0)
    return model


def weight_sync_seconds(learner, worker_model, tok, reps: int) -> dict:
    """Seconds per weight version, the median of `reps`: the trainer's snapshot (every rank gathers,
    rank 0 serializes, hashes, signs and renames into place: `publish_weights`, without the probe) and a
    rollout worker's load of it (the HF engine: verify the sha256s and signature, read, set in place;
    the arrival check's probe forward is not counted). Bytes: the version's tensor file."""
    from statistics import median

    from tidal.model.lora import adapter_config
    from tidal.rollout.engine import HFEngine
    from tidal.trainer.distributed import all_reduce_max, barrier
    from tidal.weights import WeightStore
    from tidal.weights.signing import new_key_pair, trust_public_key

    private, public = new_key_pair()  # signed and checked like a run's versions; the keys live and die with this process
    trust_public_key(public)  # rank 0 alone publishes and loads
    main = learner.ctx.is_main
    with tempfile.TemporaryDirectory(prefix="tidal-bench-sync-") as tmp:
        base = Path(tmp) / "base"
        adapter = adapter_config(learner.peft_model, str(base)) if learner.lora else None
        store = WeightStore(Path(tmp) / "weights", base, adapter, signing_key=private)
        snapshot, paths = [], []
        for rep in range(reps):
            barrier(learner.ctx)
            t0 = time.perf_counter()
            state = learner.full_state_dict()
            if main:
                paths.append(store.publish(rep + 1, state))
            snapshot.append(all_reduce_max([time.perf_counter() - t0], learner.ctx)[0])
        if not main:
            return {}
        engine = HFEngine(worker_model(), tok.eos_token_id, tok.pad_token_id, 1)
        load = []
        for rep, path in enumerate(paths):
            t0 = time.perf_counter()
            engine.load_snapshot(path, rep + 1)
            load.append(time.perf_counter() - t0)
        version_bytes = (paths[0] / store.tensors_file).stat().st_size
    return {"snapshot_seconds": median(snapshot), "load_seconds": median(load), "version_bytes": version_bytes}


def run_configuration(strategy: str, ranks: int, lora_r: int, args, workdir: Path) -> dict:
    out = workdir / f"{strategy}-{ranks}-{lora_r}.json"
    launcher = [sys.executable, "-m"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m"]
    options = ["--hidden", args.hidden, "--layers", args.layers, "--groups", args.groups, "--group-size", args.group_size]
    options += ["--prompt-len", args.prompt_len, "--response-len", args.response_len, "--iterations", args.iterations, "--warmup", args.warmup]
    options += ["--token-budget", args.token_budget, "--lora-r", lora_r, "--sync-reps", args.sync_reps]
    cmd = [*launcher, "tidal.bench.trainer", "--worker", "--strategy", strategy, "--out", str(out), *map(str, options)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))})
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} at {ranks} rank(s) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["tokens_per_s"] = result["trained_tokens"] / result["seconds"]
    result["resident_bytes_per_rank"] = max(r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in result["ranks"])
    result["peak_rss_bytes_per_rank"] = max(r["peak_rss_bytes"] for r in result["ranks"])
    return result


def available(strategy: str, ranks: int = 1, lora: bool = False) -> str | None:
    """Why `strategy` (with LoRA) cannot run here, or None."""
    if lora:
        from tidal.config import ConfigError, config_from_dict

        try:
            config_from_dict({"model": {"lora": {}}, "trainer": {"strategy": strategy, "ranks": ranks}, "mode": "periodic"})
        except ConfigError as err:  # the config's own refusal
            return str(err).removeprefix("invalid config (<dict>): ")
    if strategy == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not installed (pip install 'tidal[deepspeed]')"
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tidal bench trainer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="single,fsdp2,deepspeed")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--weights", default="full,lora", help="full (every weight trains), lora (an adapter), or both")
    ap.add_argument("--lora-r", type=int, default=16, help="the adapter's rank in the lora rows")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--sync-reps", type=int, default=5, help="weight versions written and loaded per configuration (the median is reported)")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    kinds = [k.strip() for k in args.weights.split(",") if k.strip()]
    unknown = sorted(set(kinds) - {"full", "lora"})
    if unknown:
        raise SystemExit(f"--weights: {', '.join(unknown)} is not full or lora")
    configurations = []
    for kind in kinds:
        for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
            for ranks in [int(r) for r in args.ranks.split(",")]:
                if strategy == "single" and ranks > 1:
                    continue  # one process by definition
                configurations.append((strategy, ranks, kind == "lora"))
    cores = os.cpu_count() or 1
    print(f"{cores} CPU core(s); ranks of one configuration share them, so 2 ranks show the cost of sharding here, not a speed-up")
    results, skipped = {}, {}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-trainer-") as tmp:
        for strategy, ranks, lora in configurations:
            name = f"{strategy}@{ranks}" + ("+lora" if lora else "")
            reason = available(strategy, ranks, lora)
            if reason:
                skipped[name] = reason
                continue
            results[name] = run_configuration(strategy, ranks, args.lora_r if lora else 0, args, Path(tmp))
    base = results.get("single@1")
    mib = 1024 * 1024
    for name, r in results.items():
        ratios = ""
        if base:
            ratios = f"  tokens/s x{r['tokens_per_s'] / base['tokens_per_s']:.2f}, resident/rank x{r['resident_bytes_per_rank'] / base['resident_bytes_per_rank']:.2f}"
        print(
            f"{name:17s} {r['tokens_per_s']:8.0f} trained tokens/s  resident/rank {r['resident_bytes_per_rank'] / mib:7.1f} MiB "
            f"(params+grads+optimizer)  peak RSS/rank {r['peak_rss_bytes_per_rank'] / mib:7.1f} MiB  "
            f"version {r['version_bytes'] / mib:6.2f} MiB: snapshot {r['snapshot_seconds'] * 1000:6.1f} ms, load {r['load_seconds'] * 1000:6.1f} ms{ratios}"
        )
    for name, reason in skipped.items():
        print(f"{name:17s} skipped: {reason}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"results": results, "skipped": skipped, "cores": cores, "options": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
