"""Loading a weight version into vLLM: an adapter version hot-loaded (model.lora: add_lora, the previous
one removed) against a full snapshot (tidal_load_weights), on examples/arithmetic-lora.yaml's model,
and the arrival check's probe: the engine's log-probs against the trainer's (HF / peft) at each version.

    python benchmarks/vllm_lora_load.py --reps 5 --json /tmp/vllm_lora_load.json

One engine at a time (full weights, then LoRA): the two never share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tidal.config import config_from_dict, load_config
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.model.lora import adapter_config, adapter_state_dict, apply_lora
from tidal.model.probe import make_probe, probe_difference, probe_logprobs
from tidal.weights import WeightStore

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "arithmetic-lora.yaml"
ENGINE = {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 128}


def nudged(model: torch.nn.Module, seed: int, scale: float, only_lora: bool) -> None:
    """Moves the weights (or the adapter alone) as a training step would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (not only_lora and p.dim() > 1) or "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if not only_lora else 1.0))


async def timed_loads(engine, store: WeightStore, versions: list[int]) -> tuple[list[float], list[float]]:
    """Seconds per load (in order), and per version the largest |engine - trainer| over the probe."""
    seconds, differences = [], []
    for v in versions:
        t0 = time.perf_counter()
        result = await engine.load_weights(store.path(v))
        seconds.append(time.perf_counter() - t0)
        assert "error" not in result, result
        probe = result["probe"]
        differences.append(probe_difference(probe["logprobs"], await engine.probe(probe["sequences"])))
    return seconds, differences


def run(cfg_dict: dict, base_dir: Path, store: WeightStore, versions: list[int]) -> tuple[list[float], list[float]]:
    from tidal.rollout.vllm_adapter import VLLMEngine

    cfg = config_from_dict(cfg_dict)

    async def main():
        engine = VLLMEngine.create(cfg, base_dir)
        try:
            await engine.probe(store.probe)  # warm-up: the first request compiles and allocates
            return await timed_loads(engine, store, versions)
        finally:
            engine.shutdown()

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5, help="versions loaded per kind (each a new version)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the engine's (the trainer's stays float32)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    example = load_config(EXAMPLE)
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    base = build_tiny_model(example.model.tiny, tok).eval()
    out: dict = {"model": example.model.tiny.model_dump(), "lora": example.model.lora.model_dump(), "reps": args.reps, "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base.save_pretrained(root / "base")
        tok.save_pretrained(root / "base")
        probe = make_probe(0, int(base.get_input_embeddings().num_embeddings))
        cfg_dict = {
            "model": {"tiny": example.model.tiny.model_dump()},
            "rollout": {"engine": "vllm", "vllm": {**ENGINE, "dtype": args.dtype}},
            "eval": {"enabled": False},
        }

        full = WeightStore(root / "full", root / "base", probe=probe)
        model = copy.deepcopy(base)
        for v in range(args.reps):
            nudged(model, v, 0.05, only_lora=False)
            full.publish(v, model.state_dict(), probe_logprobs=probe_logprobs(model, probe))
        out["full_bytes"] = (full.path(0) / "model.safetensors").stat().st_size
        out["full_seconds"], out["full_probe_difference"] = run(cfg_dict, root / "base", full, list(range(args.reps)))

        peft = apply_lora(copy.deepcopy(base), example.model.lora)
        lora = WeightStore(root / "lora", root / "base", adapter_config(peft, str(root / "base")), probe)
        for v in range(args.reps):
            nudged(peft, v, 0.02, only_lora=True)
            lora.publish(v, adapter_state_dict(peft), probe_logprobs=probe_logprobs(peft, probe))
        out["adapter_bytes"] = (lora.path(0) / "adapter_model.safetensors").stat().st_size
        cfg_dict["model"]["lora"] = example.model.lora.model_dump()
        out["adapter_seconds"], out["adapter_probe_difference"] = run(cfg_dict, root / "base", lora, list(range(args.reps)))
    for kind in ("full", "adapter"):
        print(
            f"{kind:8s} {out[f'{kind}_bytes'] / 2**20:7.2f} MiB  load median {statistics.median(out[f'{kind}_seconds']) * 1e3:8.1f} ms "
            f"(each: {', '.join(f'{s * 1e3:.1f}' for s in out[f'{kind}_seconds'])})  probe |engine - trainer| per token, mean (largest over loads) {max(out[f'{kind}_probe_difference']):.2e}"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
