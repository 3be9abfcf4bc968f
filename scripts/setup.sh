#!/usr/bin/env bash
# Installs what mpx needs on a fresh Debian 12 machine that has the CUDA toolkit at
# /usr/local/cuda (or $MPX_CUDA): Meson, Ninja, ccache (builds reuse earlier compiles,
# nvcc's included), Catch2 v2, Boost 1.81 (Hana), pkg-config,
# oneDNN and OpenBLAS (optional for the library: mpx::gemm's host path uses oneDNN where
# found, else OpenBLAS), zlib
# (optional: gzip-compressed IDX files), Fashion-MNIST (for the examples and the test
# that loads the real data set), CMake (the CMake package's test), fortunes (the plain-text
# corpus examples/char_lm trains on), Open MPI (data-parallel training on the host, tested
# with mpirun -np 2 and 3), matplotlib (scripts/plot_run.py) and, where nvcc is, NVIDIA's
# cudnn-frontend headers (cuDNN's fused attention; Meson's -Dcudnn finds them).
set -euo pipefail
cuda=${MPX_CUDA:-/usr/local/cuda}
if [ ! -f "$cuda/include/cuda_fp16.h" ]; then
  echo "mpx needs the CUDA toolkit's headers; none found under $cuda (set MPX_CUDA)" >&2
  exit 1
fi
packages=(meson ninja-build ccache catch2 libboost1.81-dev pkg-config python3 g++ libdnnl-dev libopenblas-dev zlib1g-dev
          dataset-fashion-mnist cmake fortunes openmpi-bin libopenmpi-dev)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
# matplotlib draws scripts/plot_run.py's figures (fashion_mnist --plot); pip, not apt:
# python3 here may be another interpreter than Debian's.
python3 -c 'import matplotlib' 2>/dev/null || python3 -m pip install --quiet matplotlib
# cudnn-frontend: header-only, from PyPI (the wheel's include/ lands in site-packages/include).
# Only CUDA builds use it (<mpx/kernels/cudnn_attention.hpp>, with the toolkit's cuDNN 9).
if [ -x "$cuda/bin/nvcc" ] && [ -f "$cuda/include/cudnn.h" ]; then
  python3 -c 'import sys, pathlib; sys.exit(not any((pathlib.Path(p) / "include" / "cudnn_frontend.h").exists() for p in sys.path if p))' ||
    python3 -m pip install --quiet nvidia-cudnn-frontend
fi
