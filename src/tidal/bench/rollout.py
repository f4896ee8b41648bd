"""Rollout throughput: HF engine vs vLLM engine, same model, prompts, G and lengths, in one run.

    tidal bench rollout                         # built-in tiny model (~0.8M parameters)
    tidal bench rollout --size 30m --json out.json
    tidal bench rollout --model-dir PATH        # any HF causal LM directory
    (or: python benchmarks/rollout.py ...)

Reports generated tokens/s and the time to the first finished group for each engine, and the
vLLM/HF ratio. The HF engine generates `--hf-groups-per-batch` groups per call (as the HF worker
does); vLLM keeps `--inflight` groups (n=G requests) in flight. Both run one untimed warm-up round
first (vLLM's first generation compiles and warms up). Needs the vllm extra for the vLLM half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from tidal.config import DataConfig, TinyModelConfig, config_from_dict
from tidal.data import load_dataset
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.model.loading import load_model_and_tokenizer
from tidal.rollout.engine import GroupRequest, HFEngine

SIZES = {  # random-init Qwen2 models with the char tokenizer; head size 32/64 (vLLM CPU needs >= 32)
    "tiny": TinyModelConfig(),
    "30m": TinyModelConfig(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=8, max_position_embeddings=512),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tidal bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="built-in random-init model")
    p.add_argument("--model-dir", help="an HF model directory instead of --size")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--hf-groups-per-batch", type=int, default=4)
    p.add_argument("--inflight", type=int, default=32, help="vLLM: groups in flight")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for the HF engine")
    p.add_argument("--json", dest="json_path", help="write the figures here")
    return p.parse_args(argv)


def model_dir(args, tmp: Path) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    build_tiny_model(SIZES[args.size], tok).save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    return tmp / "model"


def prompts(args, tokenizer) -> list[list[int]]:
    problems = load_dataset(DataConfig(num_train=max(200, args.prompts), num_eval=16), seed=0).train[: args.prompts]
    return [tokenizer(p.prompt, add_special_tokens=False).input_ids for p in problems]


def figures(tokens: int, seconds: float, first_group: float) -> dict:
    return {"generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "first_group_seconds": first_group}


def bench_hf(args, model, tok, prompt_ids: list[list[int]]) -> dict:
    torch.set_num_threads(args.threads)
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, args.max_new_tokens)
    gen = lambda batch: engine.generate([GroupRequest(p, args.group_size, torch.Generator().manual_seed(i)) for i, p in enumerate(batch)])  # noqa: E731
    gen(prompt_ids[: args.hf_groups_per_batch])  # warm-up
    start, first, tokens = time.perf_counter(), None, 0
    for i in range(0, len(prompt_ids), args.hf_groups_per_batch):
        for group in gen(prompt_ids[i : i + args.hf_groups_per_batch]):
            tokens += sum(len(s.token_ids) for s in group)
        first = first or time.perf_counter() - start
    return figures(tokens, time.perf_counter() - start, first)


async def bench_vllm(args, path: Path, prompt_ids: list[list[int]]) -> dict:
    from tidal.rollout.vllm_adapter import VLLMEngine

    cfg = config_from_dict(
        {
            "rollout": {
                "engine": "vllm",
                "group_size": args.group_size,
                "max_new_tokens": args.max_new_tokens,
                "vllm": {"dtype": args.dtype, "kv_cache_memory_gib": args.kv_cache_gib},
            }
        }
    )
    engine = VLLMEngine.create(cfg, path)
    try:
        await engine.complete([GroupRequest(p, args.group_size) for p in prompt_ids[: args.hf_groups_per_batch]])  # warm-up
        slots = asyncio.Semaphore(args.inflight)
        start, finished = time.perf_counter(), []

        async def one(p: list[int]) -> int:
            async with slots:
                samples = await engine.generate_group(GroupRequest(p, args.group_size))
            finished.append(time.perf_counter() - start)
            return sum(len(s.token_ids) for s in samples)

        tokens = sum(await asyncio.gather(*(one(p) for p in prompt_ids)))
        return figures(tokens, time.perf_counter() - start, min(finished))
    finally:
        engine.shutdown()


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args, Path(tmp))
        model, tok = load_model_and_tokenizer(path, args.dtype)
        prompt_ids = prompts(args, tok)
        params = sum(p.numel() for p in model.parameters())
        hf = bench_hf(args, model, tok, prompt_ids)
        del model  # the vLLM half loads its own copy
        vllm = asyncio.run(bench_vllm(args, path, prompt_ids))
    result = {
        "model": args.model_dir or args.size,
        "parameters": params,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "hf": hf,
        "vllm": vllm,
        "tokens_per_s_ratio_vllm_over_hf": vllm["tokens_per_s"] / hf["tokens_per_s"],
        "first_group_ratio_hf_over_vllm": hf["first_group_seconds"] / vllm["first_group_seconds"],
    }
    print(
        f"model {result['model']} ({params / 1e6:.1f}M params), {args.prompts} prompts x G={args.group_size}, up to {args.max_new_tokens} new tokens, {args.dtype}"
    )
    for name in ("hf", "vllm"):
        r = result[name]
        print(
            f"  {name:5s} {r['tokens_per_s']:9.0f} tokens/s   first group after {r['first_group_seconds']:.3f}s   ({r['generated_tokens']} tokens in {r['seconds']:.2f}s)"
        )
    print(
        f"  vLLM / HF tokens/s: {result['tokens_per_s_ratio_vllm_over_hf']:.2f}x   time to first group, HF / vLLM: {result['first_group_ratio_hf_over_vllm']:.2f}x"
    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
