#!/usr/bin/env bash
# The README's test command: install what is missing, build the host and (where nvcc is
# present) CUDA suites, run them. Without a GPU the CUDA suite reports itself skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
[ -d build ] || meson setup build
meson compile -C build
meson test -C build --print-errorlogs
