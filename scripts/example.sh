#!/usr/bin/env bash
# The README's main command: install what is missing (Fashion-MNIST included), build,
# and train the small CNN on Fashion-MNIST (examples/fashion_mnist). Arguments go to the
# example: e.g. --policy all, --epochs 5, --executor host. With a GPU and nvcc the
# example is built with nvcc for this machine's GPU; otherwise with the C++ compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build_env.sh
scripts/setup.sh
if command -v nvcc >/dev/null 2>&1 && mpx_gpu_present; then
  mpx_configure build -Dcuda=enabled -Dgpu_architectures="${MPX_GPU_ARCHS:-native}" -Dexamples_optimization=default
else
  mpx_configure build -Dcuda=disabled -Dexamples_optimization=default
fi
mpx_drop_stale_cuda_objects build "$PWD"
meson compile -C build examples/fashion_mnist
build/examples/fashion_mnist "$@"
