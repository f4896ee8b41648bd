"""Forward+backward step time and peak memory: naive GRPO layout vs shared-prompt packing.

    tidal bench shared-prompt                                # default sizes
    tidal bench shared-prompt --prompt-len 512 --response-len 64 --group-size 8 --json out.json
    (or: python benchmarks/shared_prompt.py ...)

Every (size, layout) measurement runs in a fresh subprocess so allocator caches
of one layout cannot hide the other's peak. Peak memory is the growth over the
memory held just before the first training step:
  * CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
  * CPU: the kernel's resident-set high-water mark (``VmHWM`` in
    /proc/self/status), reset by writing 5 to /proc/self/clear_refs. This sees
    every allocation torch makes, unlike tracemalloc, and misses no short peak,
    unlike a sampling thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

DEFAULT_SIZES = [(1024, 128, 16), (256, 512, 8)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tidal bench shared-prompt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--response-len", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 * hidden)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--kernel", default="auto", help="shared-layout attention kernel: auto, sdpa or flex")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="the model's weights and activations")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice); 1 avoids OpenMP spin-wait slowdowns when other processes share the cores",
    )
    parser.add_argument("--json", dest="json_path", help="write results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one measurement as JSON
    return parser.parse_args(argv)


def sizes_from(args) -> list[tuple[int, int, int]]:
    given = (args.prompt_len, args.response_len, args.group_size)
    if all(v is None for v in given):
        return DEFAULT_SIZES
    defaults = DEFAULT_SIZES[0]
    return [tuple(v if v is not None else d for v, d in zip(given, defaults))]


# ---------------------------------------------------------------- worker side


def build_model(spec: dict, device):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"] or 4 * spec["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"],
        max_position_embeddings=spec["prompt_len"] + spec["response_len"] + 16,
    )
    config._attn_implementation = "sdpa"
    return transformers.Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, spec.get("dtype", "float32"))).train()


def make_groups(spec: dict):
    import random

    rng = random.Random(0)
    prompt = [rng.randrange(spec["vocab"]) for _ in range(spec["prompt_len"])]
    responses = [[rng.randrange(spec["vocab"]) for _ in range(spec["response_len"])] for _ in range(spec["group_size"])]
    return [(prompt, responses)]


def make_step(model, groups, layout: str, kernel: str, device):
    from tidal.trainer.packing import naive_token_logprobs, pack_groups, packed_token_logprobs

    def step():
        model.zero_grad(set_to_none=True)
        if layout == "naive":
            outputs = naive_token_logprobs(model, groups)
        else:
            outputs = packed_token_logprobs(model, pack_groups(groups, device=device), kernel=kernel)
        loss = sum((o.logprobs * o.mask).sum() for o in outputs) / sum(o.mask.sum() for o in outputs)
        loss.backward()

    return step


class PeakMemory:
    """Growth of peak memory over what is held when ``start`` is called."""

    def __init__(self, device):
        self.device = device

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.baseline = _proc_status_bytes("VmRSS")

    def peak(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return _proc_status_bytes("VmHWM") - self.baseline


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_worker(spec: dict) -> dict:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(spec, device)
    step = make_step(model, make_groups(spec), spec["layout"], spec["kernel"], device)

    memory = PeakMemory(device)
    memory.start()
    step()  # the first step also serves as warm-up
    peak = memory.peak()

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for _ in range(spec["repeats"]):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_bytes": peak, "device": str(device)}


# ---------------------------------------------------------------- parent side


def measure(spec: dict) -> dict:
    result = subprocess.run([sys.executable, "-m", "tidal.bench.shared_prompt", "--worker", json.dumps(spec)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"worker for {spec} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def benchmark_size(args, prompt_len: int, response_len: int, group_size: int) -> dict:
    spec = dict(
        prompt_len=prompt_len,
        response_len=response_len,
        group_size=group_size,
        repeats=args.repeats,
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        heads=args.heads,
        vocab=args.vocab,
        kernel=args.kernel,
        dtype=args.dtype,
        threads=args.threads,
    )
    naive = measure({**spec, "layout": "naive"})
    shared = measure({**spec, "layout": "shared"})
    return {
        "prompt_len": prompt_len,
        "response_len": response_len,
        "group_size": group_size,
        "device": naive["device"],
        "dtype": args.dtype,
        "kernel": args.kernel,
        "naive_seconds": naive["seconds"],
        "shared_seconds": shared["seconds"],
        "speedup": naive["seconds"] / shared["seconds"],
        "naive_peak_bytes": naive["peak_bytes"],
        "shared_peak_bytes": shared["peak_bytes"],
    }


def report(row: dict) -> None:
    mib = 2**20
    print(
        f"P={row['prompt_len']} R={row['response_len']} G={row['group_size']} on {row['device']}: "
        f"naive {row['naive_seconds']:.3f}s, shared {row['shared_seconds']:.3f}s, "
        f"speedup {row['speedup']:.2f}x | peak naive {row['naive_peak_bytes'] / mib:.0f} MiB, "
        f"shared {row['shared_peak_bytes'] / mib:.0f} MiB, "
        f"ratio {row['naive_peak_bytes'] / max(row['shared_peak_bytes'], 1):.2f}x",
        flush=True,
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    results = []
    for size in sizes_from(args):
        results.append(benchmark_size(args, *size))
        report(results[-1])
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"results": results}, f, indent=2)


if __name__ == "__main__":
    main()
