"""The table of benchmarks/device_check.sh: each step's status, wall time and headline figure, appended as the step
ends to OUT/device_check.json and rewritten into OUT/device_check.md. The standard library only, so a broken
install still gets its row.

    python benchmarks/device_check_table.py record --out OUT --step NAME --status ok --seconds S [--result PATH]
                                               (exit 1 unless the step is recorded ok)
    python benchmarks/device_check_table.py check OUT STEP...   (exit 1 unless each STEP is ok with a number)

A step's headline is read from its result (a JSON file, or for a `tidal run` its run directory); a step that
exited 0 but left no readable result is recorded as failed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def env_headline(result: Path) -> tuple[float, str, str]:
    env = json.loads(result.read_text())
    gpus = env.get("cuda_devices") or 0
    device = ", ".join(env.get("cuda_names") or []) or "no CUDA device"
    text = f"{device}; torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')}, Python {env.get('python')}"
    return float(gpus), "CUDA devices", text


def install_headline(result: Path) -> tuple[float, str, str]:
    got = json.loads(result.read_text())
    if not got["installed"]:
        return 0.0, "wheels installed", "every package Tidal imports was already there"
    return float(len(got["installed"])), "wheels installed", f"from {got['wheels']} (pip --no-index --no-deps): {', '.join(got['installed'])}"


def run_headline(result: Path) -> tuple[float, str, str]:
    summary = json.loads((result / "summary.json").read_text())
    warm = ""
    for log in sorted((result / "logs").glob("*.log")):
        found = re.search(r"warm start: (\d+) steps in ([\d.]+)s", log.read_text(errors="replace"))
        if found:
            warm = f"; warm start {found.group(1)} steps in {float(found.group(2)):.1f} s (on CPU, as every tiny warm start)"
    text = (
        f"{summary['mode']}, {summary['iterations']} iterations, {summary['wall_seconds']:.0f} s wall; "
        f"sampled held-out accuracy {pct(summary.get('sampled_accuracy_before'))} -> {pct(summary.get('sampled_accuracy_after'))}, "
        f"greedy {pct(summary.get('accuracy_before'))} -> {pct(summary.get('accuracy_after'))}; "
        f"generate {summary['generate_seconds_mean']:.3f} s, train {summary['train_seconds_mean']:.3f} s, "
        f"weight sync {summary['sync_seconds_mean']:.3f} s per iteration; log-prob mismatch max {summary['logprob_mismatch_max']:.2g}{warm}"
    )
    return summary["iteration_seconds_mean"], "s/iteration", text


def trainer_step_headline(result: Path) -> tuple[float, str, str]:
    r = json.loads(result.read_text())
    text = (
        f"{r['model']} ({r['parameters'] / 1e6:.3g}M parameters, {r['dtype']}, attention {r['attention']}) on {r['device']}: "
        f"{r['step_seconds']:.3f} s/step, {r['trained_tokens_per_s']:.0f} trained tokens/s ({r['processed_tokens_per_s']:.0f} processed), "
        f"{r['achieved_tflops']:.3g} TFLOP/s; {r['mfu_of_matmul']:.1%} of a {r['matmul_size']}^3 {r['dtype']} matmul measured here "
        f"({r['matmul_tflops']:.3g} TFLOP/s)"
    )
    if r.get("peak_memory_bytes"):
        text += f"; peak memory {r['peak_memory_bytes'] / 2**30:.1f} GiB"
    if r["mfu"] is not None:
        text += f"; against {r['peak_tflops']:.0f} TFLOP/s ({r['peak_source']})"
        return r["mfu"], "MFU", text
    return r["mfu_of_matmul"], "MFU of the measured matmul (no datasheet peak for this device)", text


def shared_prompt_headline(result: Path) -> tuple[float, str, str]:
    rows = json.loads(result.read_text())["results"]
    parts = [
        f"P={r['prompt_len']} R={r['response_len']} G={r['group_size']}: per-sample {r['naive_seconds'] * 1000:.1f} ms, "
        f"shared ({r.get('kernel', 'auto')}) {r['shared_seconds'] * 1000:.1f} ms, x{r['speedup']:.2f}; peak memory "
        f"x{r['naive_peak_bytes'] / max(r['shared_peak_bytes'], 1):.2f} lower"
        for r in rows
    ]
    return (
        rows[0]["speedup"],
        "speed-up of shared-prompt over per-sample (first size)",
        f"{rows[0]['device']}, {rows[0].get('dtype', 'float32')}: " + "; ".join(parts),
    )


def arrival_headline(result: Path) -> tuple[float, str, str]:
    got = json.loads(result.read_text())
    entries = got["summary"]["mean"]
    parts = []
    for e in entries:
        verdict = "REFUSED" if e["right_refused"] else "passes"
        parts.append(
            f"{e['serving']} trainer on {e['record_device']}, engine on {e['engine_device']}: right {e['right']:.2g} ({verdict} tolerance "
            f"{e['tolerance']:.2g}), 1 behind {e['behind_1']:.2g}, smallest wrong {e['smallest_wrong']:.2g}, "
            f"wrong refused {e['behind_refused'][0] + e['tensors_refused'][0] + e['perturbed_refused'][0]}/"
            f"{e['behind_refused'][1] + e['tensors_refused'][1] + e['perturbed_refused'][1]}"
        )
    half = [e for e in entries if e["serving"] == "bfloat16"] or entries
    worst = max(half, key=lambda e: e["right"])
    return (
        worst["right"],
        "mean abs log-prob difference of the right version (bf16, worst device pair)",
        f"v{got['versions'][1]}: " + "; ".join(parts),
    )


HEADLINES = {
    "env": env_headline,
    "install": install_headline,
    "run-sync": run_headline,
    "run-periodic": run_headline,
    "trainer-step": trainer_step_headline,
    "trainer-step-sdpa": trainer_step_headline,  # run only when trainer-step (FlexAttention) failed
    "shared-prompt": shared_prompt_headline,
    "shared-prompt-sdpa": shared_prompt_headline,  # likewise
    "arrival": arrival_headline,
}


def last_line(output: Path | None) -> str:
    """The last line a failed step printed: usually the one that says why."""
    if output is None or not output.is_file():
        return ""
    lines = [line.strip() for line in output.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def record(out: Path, step: str, status: str, seconds: float, result: Path | None, command: str, output: Path | None = None) -> dict:
    entry = {
        "step": step,
        "status": status,
        "seconds": round(seconds, 2),
        "command": command,
        "value": None,
        "unit": "",
        "summary": last_line(output),
    }
    if status == "ok":
        try:
            entry["value"], entry["unit"], entry["summary"] = HEADLINES[step](result)
            if not math.isfinite(entry["value"]):
                raise ValueError(f"headline {entry['value']}")
            entry["result"] = json.loads(result.read_text()) if result.is_file() else json.loads((result / "summary.json").read_text())
        except (OSError, KeyError, TypeError, ValueError, IndexError) as err:
            entry.update(status="failed", value=None, summary=f"exited 0 but left no readable result ({type(err).__name__}: {err})")
    path = out / "device_check.json"
    table = json.loads(path.read_text()) if path.is_file() else {"steps": []}
    table["steps"] = [s for s in table["steps"] if s["step"] != step] + [entry]
    path.write_text(json.dumps(table, indent=1))
    (out / "device_check.md").write_text(render(table))
    return entry


def render(table: dict) -> str:
    lines = [
        "# Tidal device check",
        "",
        "| step | status | wall s | figure | what it measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in table["steps"]:
        figure = "-" if s["value"] is None else f"{s['value']:.4g} {s['unit']}"
        cells = [s["step"], s["status"], f"{s['seconds']:.1f}", figure, s["summary"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    smi = next((s.get("result", {}).get("nvidia_smi") for s in table["steps"] if s["step"] == "env"), None)
    if smi:
        lines += ["", "nvidia-smi:", "", "```text", smi.rstrip(), "```"]
    lines += ["", "Each step's command and output: device_check.log; every figure: device_check.json."]
    return "\n".join(lines) + "\n"


def check(out: Path, steps: list[str]) -> list[str]:
    """What is wrong with the table in `out`: a step missing, not ok, or without a number."""
    table = json.loads((out / "device_check.json").read_text())
    by_name = {s["step"]: s for s in table["steps"]}
    problems = []
    for step in steps:
        s = by_name.get(step)
        if s is None:
            problems.append(f"{step}: no row")
        elif s["status"] != "ok" or not isinstance(s["value"], (int, float)) or not math.isfinite(s["value"]):
            problems.append(f"{step}: {s['status']}, figure {s['value']}: {s['summary']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--step", choices=sorted(HEADLINES), required=True)
    rec.add_argument("--status", required=True)
    rec.add_argument("--seconds", type=float, required=True)
    rec.add_argument("--result", type=Path)
    rec.add_argument("--command", default="")
    rec.add_argument("--output", type=Path, help="the step's output, whose last line a failed step's row shows")
    chk = sub.add_parser("check")
    chk.add_argument("out", type=Path)
    chk.add_argument("steps", nargs="+")
    args = ap.parse_args(argv)
    if args.action == "record":
        entry = record(args.out, args.step, args.status, args.seconds, args.result, args.command, args.output)
        figure = "-" if entry["value"] is None else f"{entry['value']:.4g} {entry['unit']}"
        print(f"[device check] {entry['step']}: {entry['status']}, {entry['seconds']:.1f} s, {figure}", flush=True)
        return 0 if entry["status"] == "ok" else 1
    problems = check(args.out, args.steps)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
