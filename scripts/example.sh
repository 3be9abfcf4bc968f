#!/usr/bin/env bash
# The README's main command: install what is missing (Fashion-MNIST included), build,
# and train the small CNN on Fashion-MNIST (examples/fashion_mnist). Arguments go to the
# example: e.g. --policy all, --epochs 5, --executor host.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
[ -d build ] || meson setup build
meson compile -C build examples/fashion_mnist
build/examples/fashion_mnist "$@"
