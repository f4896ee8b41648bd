#!/usr/bin/env bash
# Builds .device/wheels: the wheels of benchmarks/device_wheels.txt (what `tidal run` needs beyond the GPU machine's
# image) for CPython 3.11 and 3.12 on x86-64 Linux, from the package index, for benchmarks/device_check.sh to install
# there without one. Run it here, from anywhere, before the device call that carries `.device`:
#   bash benchmarks/device_wheels.sh            (DEVICE_WHEELS_DIR=... to write elsewhere)
# It fails when the folder, with the checkout's other files that travel, would pass the device tool's 64 MiB.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
list="$repo/benchmarks/device_wheels.txt"
dest="${DEVICE_WHEELS_DIR:-$repo/.device/wheels}"
python="${PYTHON:-python3}"
limit_mib=64

mapfile -t pins < <(grep -v '^\s*#' "$list" | grep -v '^\s*$')
rm -rf "$dest"
mkdir -p "$dest"
for version in 3.11 3.12; do
  # manylinux2014 (glibc 2.17) and _2_28: the tags these packages publish; pip matches each tag exactly
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$version" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "${pins[@]}"
done

# every pin resolves from the folder alone, for each Python, as the device's `pip install --no-index` will ask
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
for version in 3.11 3.12; do
  "$python" -m pip install --dry-run --quiet --no-index --no-deps --only-binary=:all: --implementation cp \
    --python-version "$version" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --target "$scratch" --find-links "$dest" "${pins[@]}" ||
    { echo "the wheels in $dest do not install on CPython $version" >&2; exit 1; }
done

wheels=$(find "$dest" -name '*.whl' | wc -l)
wheel_bytes=$(du -sb "$dest" | cut -f1)
tree_bytes=$(cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((wheel_bytes + tree_bytes))
awk -v d="$dest" -v n="$wheels" -v w="$wheel_bytes" -v t="$tree_bytes" -v l="$limit_mib" 'BEGIN {
  printf "%s: %d wheels, %.1f MiB; with the %.1f MiB of files that travel anyway, %.1f MiB of the %d MiB a device call carries\n",
    d, n, w / 1048576, t / 1048576, (w + t) / 1048576, l }'
if ((total > limit_mib * 1048576)); then
  echo "too large for one device call: drop wheels from $list or files from the working tree" >&2
  exit 1
fi
