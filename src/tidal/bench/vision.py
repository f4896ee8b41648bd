"""Vision-encoder calls, images encoded, forward+backward seconds and peak memory of one group with an image: each sample encoding its own copy (the baseline) vs shared-prompt packing encoding it once per group.

    tidal bench vision                                       # G = 8 and 16, a 112x112 image
    tidal bench vision --group-sizes 8 16 --image-side 224 --vision-depth 8 --json out.json
    (or: python benchmarks/vision.py ...)

The model is a tiny Qwen2-VL built from a config (`tidal.demo.vision`), its vision tower sized by the flags.
The baseline runs G rows ``prompt + response`` in one forward, each with its copy of the image (so the
vision tower encodes G images in one call); the shared layout packs the group in one row and encodes the
image once. Each (group size, layout) runs in a fresh subprocess; peak memory is measured as in
`tidal bench shared-prompt` (CUDA's peak allocation, or the CPU process's resident-set high-water mark).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tidal bench vision", description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--image-side", type=int, default=112, help="pixels of the square image (a multiple of 28)")
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--vision-embed", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", dest="json_path", help="write results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one measurement as JSON
    return parser.parse_args(argv)


def make_group(spec: dict, processor) -> tuple:
    import io
    import random

    from tidal.demo.vision import count_image

    rng = random.Random(0)
    buffer = io.BytesIO()
    count_image(rng, "red", 3, side=spec["image_side"], cell=spec["image_side"] // 4).save(buffer, format="PNG")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many red squares?"}]}]
    ids = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt, images = processor.encode(list(ids), [buffer.getvalue()])
    responses = [[rng.randrange(4, 100) for _ in range(spec["response_len"])] for _ in range(spec["group_size"])]
    return prompt, responses, [None] * spec["group_size"], images


def run_worker(spec: dict) -> dict:
    import torch

    from tidal.bench.shared_prompt import PeakMemory
    from tidal.demo.vision import TinyVLMSize, build_processor, build_tiny_vlm
    from tidal.trainer.vision_packing import naive_vision_token_logprobs, packed_vision_token_logprobs

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    processor = build_processor(max_side=spec["image_side"])
    size = TinyVLMSize(
        hidden_size=spec["hidden"],
        intermediate_size=2 * spec["hidden"],
        num_layers=spec["layers"],
        vision_depth=spec["vision_depth"],
        vision_embed_dim=spec["vision_embed"],
        vision_heads=max(1, spec["vision_embed"] // 32),
    )
    model = build_tiny_vlm(processor.tokenizer, size).to(device).train()
    groups = [make_group(spec, processor)]
    calls: list[int] = []
    model.model.visual.register_forward_hook(lambda m, a, k, o: calls.append(int(k["grid_thw"].shape[0])), with_kwargs=True)

    def step():
        model.zero_grad(set_to_none=True)
        if spec["layout"] == "per_sample":
            outputs = naive_vision_token_logprobs(model, groups)
        else:
            outputs = packed_vision_token_logprobs(model, groups, device)
        (sum(o.logprobs.sum() for o in outputs) / sum(o.mask.sum() for o in outputs)).backward()

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    memory = PeakMemory(device)
    memory.start()
    step()  # the first step also serves as warm-up
    peak = memory.peak()
    encoder_calls, images_encoded = len(calls), sum(calls)
    times = []
    for _ in range(spec["repeats"]):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times),
        "peak_bytes": peak,
        "encoder_calls": encoder_calls,
        "images_encoded": images_encoded,
        "image_patches": int(groups[0][3].pixel_values.shape[0]),
        "device": str(device),
    }


def measure(spec: dict) -> dict:
    result = subprocess.run([sys.executable, "-m", "tidal.bench.vision", "--worker", json.dumps(spec)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"worker for {spec} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def benchmark_group_size(args, group_size: int) -> dict:
    spec = {
        "group_size": group_size,
        "image_side": args.image_side,
        "response_len": args.response_len,
        "vision_depth": args.vision_depth,
        "vision_embed": args.vision_embed,
        "hidden": args.hidden,
        "layers": args.layers,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    per_sample = measure({**spec, "layout": "per_sample"})
    shared = measure({**spec, "layout": "shared"})
    row = {"group_size": group_size, "image_side": args.image_side, "image_patches": shared["image_patches"], "device": shared["device"]}
    for name, result in (("per_sample", per_sample), ("shared", shared)):
        row.update({f"{name}_{k}": result[k] for k in ("encoder_calls", "images_encoded", "seconds", "peak_bytes")})
    row["speedup"] = per_sample["seconds"] / shared["seconds"]
    return row


def report(row: dict) -> None:
    mib = 2**20
    print(
        f"G={row['group_size']} image {row['image_side']}px ({row['image_patches']} patches) on {row['device']}: "
        f"images encoded per sample {row['per_sample_images_encoded']} vs shared {row['shared_images_encoded']} | "
        f"per sample {row['per_sample_seconds']:.3f}s, shared {row['shared_seconds']:.3f}s, speedup {row['speedup']:.2f}x | "
        f"peak per sample {row['per_sample_peak_bytes'] / mib:.0f} MiB, shared {row['shared_peak_bytes'] / mib:.0f} MiB",
        flush=True,
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    results = []
    for group_size in args.group_sizes:
        results.append(benchmark_group_size(args, group_size))
        report(results[-1])
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"results": results}, f, indent=2)


if __name__ == "__main__":
    main()
