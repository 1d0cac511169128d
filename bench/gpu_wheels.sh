#!/usr/bin/env bash
# Download the wheels of bench/gpu_wheels.txt for the GPU machine (CPython 3.12, Linux x86_64)
# into .gpu-wheels/ at the repository root (git-ignored; or the folder given as $1), replacing
# what was there, and print their total size beside the tracked files' (docs/gpu.md: the
# checkout and the wheels travel to that machine together, 64 MiB at most).
#
#   bash bench/gpu_wheels.sh [DEST]        # PYTHON=/path/to/python to use another interpreter's pip
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/.gpu-wheels}"
mkdir -p "$dest"
rm -f "$dest"/*.whl
"${PYTHON:-python}" -m pip download --quiet --no-deps --only-binary=:all: -d "$dest" \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -r "$root/bench/gpu_wheels.txt"
wheels=$(cat "$dest"/*.whl | wc -c)
tracked=$(cd "$root" && git ls-files -z | xargs -0 cat 2>/dev/null | wc -c)
ls -l "$dest"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
awk -v w="$wheels" -v t="$tracked" -v n="$(ls "$dest"/*.whl | wc -l)" 'BEGIN {
    printf "%d wheels: %d bytes (%.1f MiB); tracked files: %.1f MiB; together %.1f MiB of 64 MiB\n", n, w, w / 1048576, t / 1048576, (w + t) / 1048576 }'
