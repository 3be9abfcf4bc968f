#!/usr/bin/env bash
# The README's main command: install what is missing, build, run the main example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
[ -d build ] || meson setup build
meson compile -C build examples/overflow_underflow
build/examples/overflow_underflow "$@"
