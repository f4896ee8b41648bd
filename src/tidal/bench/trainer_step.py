"""One trainer step against the chip's peak: trained tokens/s and model FLOPs utilisation (MFU) of the trainer's
own step (forward, backward and optimizer step, shared-prompt packing) on a model built from a config.

    tidal bench trainer-step [--model qwen2.5-0.5b|tiny] [--dtype bfloat16] [--device auto] [--groups 16]
                             [--group-size 8] [--prompt-len 256] [--response-len 512] [--iterations 3] [--warmup 1]
                             [--token-budget 16384] [--attention auto] [--peak-tflops X] [--json out.json]
    (or: python benchmarks/trainer_step.py ...)

The model is random-initialised from the named architecture (qwen2.5-0.5b: Qwen2.5-0.5B's published config,
494M parameters, its 151936-token vocabulary; tiny: about 0.1M, for a CPU check) and trained by
`tidal.trainer.learner.Learner` on synthetic groups (`tidal bench trainer`'s), every group with graded rewards so
every token trains.

FLOPs are counted the usual way and only where the step needs them: 6 x (the weights of every linear layer) per
token the model processes (a group's prompt once, each response after it), except the output head, counted only
where a log-prob is taken (the trained tokens); plus attention, 12 x layers x (heads x head_dim) per (query, key)
pair a token attends to (causal; each response sees its prompt and its own earlier tokens). MFU is those FLOPs
per second over a peak: `--peak-tflops`, else the dense bf16 Tensor Core figure of NVIDIA's datasheet for a GPU
this module knows (H100 SXM and H200: 989 TFLOP/s, half the 1979 quoted with sparsity), and, always beside it, a
bf16 matmul timed in the same process (`--matmul-size`), what the chip gives a plain matrix product here.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

# dense bf16 Tensor Core TFLOP/s by NVIDIA's datasheets (the sparse figure halved), matched in the device name
DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100 80GB HBM3": 989.0, "H100 SXM": 989.0}


@dataclass(frozen=True)
class Architecture:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int


# Qwen2.5-0.5B's config.json: hidden 896, 24 layers, 14 query / 2 key-value heads, tied embeddings
MODELS = {
    "qwen2.5-0.5b": Architecture(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936),
    "tiny": Architecture(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512),
}


def build_model(arch: Architecture, max_positions: int, dtype, device):
    """A Qwen2 causal LM of `arch`, random weights, built directly on `device` in `dtype`."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=arch.vocab,
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    return model.to(dtype)


def linear_weights(model) -> tuple[int, int]:
    """(weights of the linear layers other than the output head, the output head's)."""
    import torch

    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body, head.weight.numel()


def attended_pairs(prompt_len: int, response_len: int, group_size: int) -> int:
    """(query, key) pairs of one packed group: the prompt causally, each response over the prompt and itself."""
    prompt = prompt_len * (prompt_len + 1) // 2
    response = response_len * prompt_len + response_len * (response_len + 1) // 2
    return prompt + group_size * response


def step_flops(arch: Architecture, body: int, head: int, args) -> tuple[float, int, int]:
    """(model FLOPs of one iteration's groups, tokens processed, tokens trained)."""
    per_group_processed = args.prompt_len + args.group_size * args.response_len
    per_group_trained = args.group_size * args.response_len
    processed, trained = args.groups * per_group_processed, args.groups * per_group_trained
    head_dim = arch.hidden // arch.heads
    attention = 12 * arch.layers * arch.heads * head_dim * args.groups * attended_pairs(args.prompt_len, args.response_len, args.group_size)
    return 6.0 * (body * processed + head * trained) + attention, processed, trained


def measured_matmul_tflops(size: int, dtype, device, repeats: int = 10) -> float:
    """A `size`^3 matrix product in `dtype` on `device`: TFLOP/s, the mean of `repeats` after three warm-ups."""
    import torch

    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - t0) / 1e12


def synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def datasheet_peak(device_name: str) -> float | None:
    return next((tflops for name, tflops in DATASHEET_BF16_TFLOPS.items() if name in device_name), None)


def device_name(device: str) -> str:
    import platform

    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def measure(args) -> dict:
    import torch

    from tidal.bench.trainer import synthetic_groups
    from tidal.config import TrainerConfig
    from tidal.devices import resolve_device
    from tidal.trainer.learner import Learner

    device = resolve_device(args.device, "--device")
    dtype = getattr(torch, args.dtype)
    arch = MODELS[args.model]
    model = build_model(arch, args.prompt_len + args.response_len + 8, dtype, device)
    parameters = sum(p.numel() for p in model.parameters())
    body, head = linear_weights(model)
    cfg = TrainerConfig(device=device, warmup_steps=0, token_budget=args.token_budget, attention=args.attention)
    learner = Learner(cfg, model, pad_id=0, device=device)
    flops, processed, trained = step_flops(arch, body, head, args)
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for it in range(args.warmup + args.iterations):
        groups = synthetic_groups(it, args.groups, args.group_size, args.prompt_len, args.response_len, arch.vocab)
        synchronize(device)
        t0 = time.perf_counter()
        learner.begin_iteration(it)
        learner.train_on_groups(groups)
        metrics = learner.step()
        synchronize(device)
        if it >= args.warmup:
            seconds.append(time.perf_counter() - t0)
        if metrics["trained_tokens"] != trained:
            raise RuntimeError(f"the step trained {metrics['trained_tokens']} tokens, expected {trained}")
    step_seconds = sum(seconds) / len(seconds)
    achieved = flops / step_seconds / 1e12
    name = device_name(device)
    peak = args.peak_tflops or datasheet_peak(name)
    matmul = measured_matmul_tflops(args.matmul_size, dtype, device)
    return {
        "model": args.model,
        "architecture": vars(arch),
        "parameters": parameters,
        "device": name,
        "dtype": args.dtype,
        "attention": args.attention,
        "groups": args.groups,
        "group_size": args.group_size,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "step_seconds": step_seconds,
        "step_seconds_each": seconds,
        "processed_tokens_per_s": processed / step_seconds,
        "trained_tokens_per_s": trained / step_seconds,
        "flops_per_step": flops,
        "achieved_tflops": achieved,
        "peak_tflops": peak,
        "peak_source": "--peak-tflops" if args.peak_tflops else ("NVIDIA datasheet, dense bf16" if peak else None),
        "mfu": achieved / peak if peak else None,
        "matmul_tflops": matmul,
        "matmul_size": args.matmul_size,
        "mfu_of_matmul": achieved / matmul,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if torch.device(device).type == "cuda" else None,
    }


def report(r: dict) -> str:
    mfu = (
        f"MFU {r['mfu']:.1%} of {r['peak_tflops']:.0f} TFLOP/s ({r['peak_source']})" if r["mfu"] is not None else "no datasheet peak for this device"
    )
    return (
        f"{r['model']} ({r['parameters'] / 1e6:.3g}M parameters, {r['dtype']}) on {r['device']}: {r['step_seconds']:.3f} s/step, "
        f"{r['trained_tokens_per_s']:.0f} trained tokens/s ({r['processed_tokens_per_s']:.0f} processed), {r['achieved_tflops']:.1f} TFLOP/s; "
        f"{mfu}; {r['mfu_of_matmul']:.1%} of a {r['matmul_size']}^3 matmul measured here ({r['matmul_tflops']:.1f} TFLOP/s)"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tidal bench trainer-step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--device", default="auto", help="auto: CUDA, else an Ascend NPU, else CPU")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--iterations", type=int, default=3, help="timed steps (the mean is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="steps before the timed ones (kernel compilation, allocator)")
    ap.add_argument("--token-budget", type=int, default=16384, help="tokens per packed micro-batch (trainer.token_budget)")
    ap.add_argument("--attention", default="auto", help="trainer.attention: auto (flex on CUDA), flex, sdpa, segmented")
    ap.add_argument("--peak-tflops", type=float, help="the peak to divide by; default: the datasheet's for a known GPU")
    ap.add_argument("--matmul-size", type=int, default=8192, help="side of the matrix product timed beside the step")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    for name in ("groups", "group_size", "prompt_len", "response_len", "iterations", "token_budget", "matmul_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    result = measure(args)
    print(report(result), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
