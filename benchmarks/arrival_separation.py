"""The arrival check's separation: for each engine (HF, vLLM) and dtype it may serve, how far the probe log-probs of
the right version are from the trainer's, against how far those of wrong versions are, under the check's statistic
(the mean per-token |difference|) and others it could have used. The figure is the margin: the smallest wrong
difference over the largest right one, and how many of each kind of wrong version the default tolerance refuses.

    .venv-vllm/bin/python benchmarks/arrival_separation.py RUN_DIR [--versions A B] [--json out.json]

RUN_DIR is a finished run holding versions A..B (e.g. `tidal run examples/arithmetic.yaml --set
trainer.iterations=4 --set eval.enabled=false`; examples/arithmetic-lora.yaml for adapters). Version B is the
right one; the wrong ones are what a worker could serve while the trainer published B:
  behind-k    version B-k (a stale version, k updates behind), for every k down to A
  base        the base model instead of the adapter (LoRA runs)
  tensor-X    version B with tensor X one update behind (a tensor that did not arrive), each tensor in turn
  noise-X     version B with tensor X perturbed by noise of the size of its last update, each tensor in turn
The trainer's record is computed by the trainer's code (an HF forward) in float32, and for the vLLM rows also in
the serving dtype (what a run whose model.dtype is the serving dtype publishes).

`--devices RECORD:ENGINE ...` (default cpu:cpu) computes the trainer's record on RECORD and the HF engine's side on
ENGINE: cuda:cuda is sync mode on a GPU (the engine shares the trainer's model), cuda:cpu periodic mode with the
trainer on a GPU and HF rollout workers on CPU. `--max-tensors N` builds the tensor-/noise- variants of N tensors
spread over the model, not of every one."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import torch

from tidal.config import config_from_dict, load_config
from tidal.model.loading import load_model_and_tokenizer, load_state_dict_tied
from tidal.model.probe import CALIBRATION_FACTOR, DTYPE_TOLERANCE, arrival_tolerance, make_probe, probe_logprobs, sample_responses
from tidal.rundir import RunDir
from tidal.weights import WeightStore, load_verified, readable_manifest

DTYPES = ("float32", "bfloat16", "float16")


def _flat(logprobs: list[list[float]]) -> torch.Tensor:
    return torch.tensor([v for row in logprobs for v in row], dtype=torch.float64)


# candidate statistics of (record, engine) log-probs; "mean" is the check's (tidal.model.probe.probe_difference)
STATISTICS = {
    "mean": lambda r, e: (e - r).abs().mean(),
    "max": lambda r, e: (e - r).abs().max(),
    "rms": lambda r, e: (e - r).pow(2).mean().sqrt(),
    "median": lambda r, e: (e - r).abs().median(),
    "prob": lambda r, e: (e.exp() - r.exp()).abs().mean(),  # in probability, not log-probability
}


def spread(names: list[str], count: int | None) -> list[str]:
    """`count` of `names` at even steps from the first (all of them when count is None or not smaller)."""
    if count is None or count >= len(names):
        return names
    return [names[i * len(names) // count] for i in range(count)]


def variants(states: dict[int, dict], a: int, b: int, lora: bool, max_tensors: int | None = None) -> dict[str, dict | None]:
    """name -> the weights served (None: the base model, no adapter)."""
    right, previous = states[b], states[b - 1]
    out: dict[str, dict | None] = {"right": right}
    out.update({f"behind-{b - v}": states[v] for v in range(b - 1, a - 1, -1)})
    if lora:
        out["base"] = None
    gen = torch.Generator().manual_seed(0)
    changed = [n for n in sorted(right) if right[n].is_floating_point() and (right[n] - previous[n]).float().abs().max()]
    for name in spread(changed, max_tensors):
        delta = (right[name] - previous[name]).float()
        out[f"tensor-{name}"] = {**right, name: previous[name]}
        noise = torch.randn(delta.shape, generator=gen) * delta.pow(2).mean().sqrt()
        out[f"noise-{name}"] = {**right, name: right[name] + noise.to(right[name].dtype)}
    return out


def cast(state: dict, dtype: str) -> dict:
    return {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in state.items()}


def hf_logprobs(base_dir: Path, cfg, state: dict | None, dtype: str, probe: list[dict], device: str = "cpu") -> list[list[float]]:
    """The trainer's (and the HF engine's) forward of `state` in `dtype` on `device`."""
    model, _ = load_model_and_tokenizer(base_dir, dtype)
    if cfg.model.lora is not None:
        from tidal.model.lora import apply_lora, load_adapter_state_dict

        model = apply_lora(model, cfg.model.lora, cfg.seed)
        if state is None:
            with model.disable_adapter():
                return probe_logprobs(model.to(device).eval(), probe)
        load_adapter_state_dict(model, cast(state, dtype))
    else:
        load_state_dict_tied(model, cast(state, dtype))
    return probe_logprobs(model.to(device).eval(), probe)


async def vllm_logprobs(
    cfg, base_dir: Path, served: dict[str, dict | None], dtype: str, probe: list[dict], adapter: dict | None, scratch: Path
) -> dict:
    from tidal.rollout.vllm_adapter import VLLMEngine

    data = cfg.model_dump(mode="json")
    data["rollout"]["vllm"].update({"dtype": dtype, "kv_cache_memory_gib": 0.5, "enforce_eager": True, "max_model_len": 128})
    engine = VLLMEngine.create(config_from_dict(data), base_dir)
    assert engine.dtype == dtype, (engine.dtype, dtype)
    store = WeightStore(scratch / dtype, base_dir, adapter)
    out = {}
    try:
        for i, (name, state) in enumerate(served.items()):
            if state is None:
                engine.lora_request = None
            else:
                result = await engine.load_weights(store.publish(i, state))
                assert "error" not in result, result
            out[name] = await engine.probe(probe)
    finally:
        engine.shutdown()
    return out


def default_tolerance(engine: str, serving: str, record: str, calibration: float | None) -> float:
    """The tolerance the worker applies (tidal.rollout.arrival.ArrivalCheck): calibrated on the base model where a
    side computes in half precision."""
    tolerance = arrival_tolerance(None, engine, serving, record)
    if calibration is None or tolerance <= DTYPE_TOLERANCE["float32"]:
        return tolerance
    return max(tolerance, CALIBRATION_FACTOR * calibration)


def measure(
    run_dir: Path,
    a: int,
    b: int,
    engines: list[str],
    dtypes: list[str],
    probe_kind: str = "run",
    devices: list[tuple[str, str]] = (("cpu", "cpu"),),
    max_tensors: int | None = None,
) -> dict:
    run = RunDir(run_dir)
    cfg = load_config(run.config)
    manifest = readable_manifest(run.weights / f"v{b:06d}")
    lora = manifest.get("kind") == "lora"
    base_dir = Path(manifest["base_model"]) if lora else run.weights / f"v{b:06d}"
    adapter = json.loads((run.weights / f"v{b:06d}" / "adapter_config.json").read_text()) if lora else None
    states = {v: load_verified(run.weights / f"v{v:06d}") for v in range(a, b + 1)}
    vocab = json.loads((base_dir / "config.json").read_text())["vocab_size"]
    probe = make_probe(cfg.seed, vocab)
    if probe_kind == "run" and "probe" in manifest:
        probe = manifest["probe"]["sequences"]
    elif probe_kind in ("run", "sampled"):  # as the trainer builds it, from the base model (a sync run on the HF engine records none)
        base, _ = load_model_and_tokenizer(base_dir, "float32")
        probe = sample_responses(base.eval(), probe, cfg.seed)
    served = variants(states, a, b, lora, max_tensors)
    record_devices = sorted({r for r, _ in devices})
    records = {(d, dtype): hf_logprobs(base_dir, cfg, states[b], dtype, probe, d) for d in record_devices for dtype in dtypes}
    # the base model (v0 is the base: full weights as loaded, or a zero adapter) and the variant that serves it
    base_name = "base" if lora else f"behind-{b}"
    base_state = None if lora else states.get(0)
    base_records = {(d, dtype): hf_logprobs(base_dir, cfg, base_state, dtype, probe, d) for d in record_devices for dtype in dtypes} if a == 0 else {}
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="tidal-separation-"))
    try:
        for engine in engines:
            # the HF engine runs on each ENGINE device of --devices; vLLM on its own platform, against the first record device
            pairs = list(devices) if engine == "hf" else [(devices[0][0], "vllm")]
            for record_device, engine_device in pairs:
                for dtype in dtypes:
                    if engine == "hf":  # the HF engine serves the trainer's own dtype
                        got = {n: hf_logprobs(base_dir, cfg, s, dtype, probe, engine_device) for n, s in served.items()}
                        against = [dtype]
                    else:
                        got, against = asyncio.run(vllm_logprobs(cfg, base_dir, served, dtype, probe, adapter, scratch)), sorted({"float32", dtype})
                    where = {"record_device": record_device, "engine_device": engine_device}
                    for record in against:
                        for name, logprobs in got.items():
                            r, e = _flat(records[record_device, record]), _flat(logprobs)
                            stats = {stat: float(fn(r, e)) for stat, fn in STATISTICS.items()}
                            rows.append({"engine": engine, "serving": dtype, "record": record, **where, "variant": name, **stats})
                        if base_records:  # what the engine calibrates on: the base against the trainer's record of it
                            r, e = _flat(base_records[record_device, record]), _flat(got[base_name])
                            stats = {stat: float(fn(r, e)) for stat, fn in STATISTICS.items()}
                            rows.append({"engine": engine, "serving": dtype, "record": record, **where, "variant": "calibration", **stats})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"run": str(run_dir), "versions": [a, b], "lora": lora, "rows": rows}


def summarize(result: dict, stat: str = "mean") -> list[dict]:
    """One entry per (engine, serving dtype, record dtype, record device, engine device): the right version's
    distance, the wrong versions', and under the check's statistic (mean) the default tolerance and what it refuses."""
    rows = result["rows"]
    fields = ("engine", "serving", "record", "record_device", "engine_device")
    keys = sorted({tuple(r.get(f, "cpu") for f in fields) for r in rows}, key=lambda k: (k[0], DTYPES.index(k[1]), k[2] != "float32", k[3:]))
    out = []
    for key in keys:
        mine = {r["variant"]: r[stat] for r in rows if tuple(r.get(f, "cpu") for f in fields) == key}
        behind = sorted((int(n.split("-")[1]), v) for n, v in mine.items() if n.startswith("behind-"))
        tensors = [v for n, v in mine.items() if n.startswith("tensor-")]
        noise = [v for n, v in mine.items() if n.startswith("noise-")]
        wrong = [v for n, v in mine.items() if n not in ("right", "calibration")]
        entry = dict(zip(fields, key), statistic=stat, right=mine["right"], calibration=mine.get("calibration"), base=mine.get("base"))
        entry.update(behind_1=behind[0][1], most_behind=behind[-1][1], most_behind_k=behind[-1][0], smallest_wrong=min(wrong))
        entry["margin"] = min(wrong) / mine["right"] if mine["right"] else None  # None: the right version matched exactly
        if stat == "mean":
            tolerance = default_tolerance(*key[:3], mine.get("calibration"))
            entry.update(
                tolerance=tolerance,
                right_refused=mine["right"] > tolerance,
                tensors_refused=[sum(t > tolerance for t in tensors), len(tensors)],
                perturbed_refused=[sum(t > tolerance for t in noise), len(noise)],
                behind_refused=[sum(v > tolerance for _, v in behind), len(behind)],
            )
        out.append(entry)
    return out


def print_table(result: dict, stat: str = "mean") -> None:
    """Under the check's statistic (mean): the default tolerance, its margin over the right version and the wrong
    versions it refuses; under the others, only the distances."""
    kind = "adapter" if result["lora"] else "full weights"
    print(f"\n{result['run']} ({kind}), right version v{result['versions'][1]}; statistic: {stat} per-token |difference|")
    print(
        "| engine | serves | trainer | trainer on | engine on | base (calibration) | right | right / base | 1 behind | most behind | "
        "base instead of adapter | smallest wrong / right | tolerance | tolerance / right | tensors behind refused | tensors perturbed refused |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for e in summarize(result, stat):
        right, calibration = e["right"], e["calibration"]
        cal = "-" if calibration is None else f"{calibration:.2g}"
        ratio = f"{right / calibration:.1f}" if calibration else "-"
        base = f"{e['base']:.2g}" if e["base"] is not None else "-"
        margin = "exact" if e["margin"] is None else f"{e['margin']:.3g}"
        if "tolerance" in e:
            over = f"{e['tolerance'] / right:.0f}x" if right else "exact"
            refused = f"{e['tolerance']:.2g} | {over} | "
            refused += f"{e['tensors_refused'][0]}/{e['tensors_refused'][1]} | {e['perturbed_refused'][0]}/{e['perturbed_refused'][1]}"
        else:
            refused = "- | - | - | -"
        print(
            f"| {e['engine']} | {e['serving']} | {e['record']} | {e['record_device']} | {e['engine_device']} | {cal} | {right:.2g} | {ratio} | "
            f"{e['behind_1']:.2g} | {e['most_behind']:.2g} ({e['most_behind_k']}) | {base} | {margin} | {refused} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--versions", type=int, nargs=2, default=(0, 4), metavar=("A", "B"), help="the oldest wrong version and the right one")
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--statistics", nargs="+", default=["mean", "max"], choices=list(STATISTICS))
    parser.add_argument(
        "--probe", choices=["run", "sampled", "uniform"], default="run", help="the run's own, one built as the trainer does, or uniform tokens"
    )
    parser.add_argument(
        "--devices",
        nargs="+",
        default=["cpu:cpu"],
        metavar="RECORD:ENGINE",
        help="where the trainer's record and the HF engine's side are computed (torch devices), e.g. cuda:cuda cuda:cpu",
    )
    parser.add_argument("--max-tensors", type=int, help="tensor-/noise- variants of this many tensors, spread over the model (default: every one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    devices = [tuple(pair.split(":", 1)) for pair in args.devices]
    if any(len(pair) != 2 or not all(pair) for pair in devices):
        parser.error(f"--devices takes RECORD:ENGINE pairs (e.g. cuda:cpu), got {' '.join(args.devices)}")
    result = measure(args.run_dir, *args.versions, args.engines, args.dtypes, args.probe, devices, args.max_tensors)
    result["summary"] = {stat: summarize(result, stat) for stat in args.statistics}
    for stat in args.statistics:
        print_table(result, stat)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
