#!/usr/bin/env bash
# The CMake package, end to end: installs mpx (host-only, nothing built) into a
# temporary prefix with `meson install`, then builds this folder's consumer project
# with CMake against it: find_package(mpx CONFIG REQUIRED) + mpx::mpx and nothing else.
#  1. host: g++ builds host.cpp, which runs (casts, stats, a small training run) and
#     prints the MPX_HAS_* defines it saw; they must be the ones the installed mpx.pc
#     gives (pkg-config --cflags mpx);
#  2. CUDA, where nvcc is present: CMake with the CUDA language builds device.cu (a user
#     kernel on mpx's types, mpx::gemm through cuBLASLt) for sm_90: compile and link
#     only, as there is no GPU to run it on here.
# Usage: tests/cmake_consumer/run.sh   (about a minute; MPX_KEEP_TMP=1 keeps the prefix)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mpx_cmake_consumer.XXXXXX")
if [ "${MPX_KEEP_TMP:-0}" = 1 ]; then echo "keeping $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi
launcher=()
if command -v ccache >/dev/null 2>&1; then
  # The prefix changes every run; relative to $tmp the paths do not, so the cache hits.
  export CCACHE_BASEDIR="$tmp" CCACHE_NOHASHDIR=true
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi

echo "== install mpx into $tmp/prefix"
meson setup "$tmp/mpx-build" "$root" --prefix "$tmp/prefix" \
  -Dcuda=disabled -Dhost=false -Dtests=false -Dexamples=false -Dbenchmarks=false >"$tmp/meson-setup.log" ||
  { cat "$tmp/meson-setup.log"; exit 1; }
meson install -C "$tmp/mpx-build" --quiet >/dev/null
config=$(find "$tmp/prefix" -name mpxConfig.cmake)
[ -n "$config" ] || { echo "meson install wrote no mpxConfig.cmake under $tmp/prefix" >&2; exit 1; }
echo "   ${config#"$tmp/prefix/"}"

echo "== host consumer (g++)"
cmake -S "$here" -B "$tmp/host" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_CXX_COMPILER=g++ \
  -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >"$tmp/host-cmake.log" || { cat "$tmp/host-cmake.log"; exit 1; }
cmake --build "$tmp/host" -j 2
"$tmp/host/consumer_host" | tee "$tmp/host-run.log"
seen=$(grep '^define ' "$tmp/host-run.log" | sed 's/^define //' | sort | tr '\n' ' ')
pc_dir=$(dirname "$(find "$tmp/prefix" -name mpx.pc)")
expected=$(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags mpx | tr ' ' '\n' | sed -n 's/^-D//p' | sort | tr '\n' ' ')
if [ "$seen" != "$expected" ]; then
  echo "mpx::mpx gave the defines '$seen'; mpx.pc gives '$expected'" >&2
  exit 1
fi
echo "   defines as in mpx.pc: ${seen:-none}"
# cuDNN's fused attention: mpx-cudnn.pc and mpx::cudnn both, or neither.
has_pc=no has_target=no
[ -n "$(find "$tmp/prefix" -name mpx-cudnn.pc)" ] && has_pc=yes
grep -q 'mpx::cudnn: cuDNN fused attention available' "$tmp/host-cmake.log" && has_target=yes
if [ "$has_pc" != "$has_target" ]; then
  echo "mpx-cudnn.pc installed: $has_pc, but CMake's mpx::cudnn: $has_target" >&2
  exit 1
fi
if [ "$has_pc" = yes ]; then
  cudnn_flags=$(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags --libs mpx-cudnn)
  [[ "$cudnn_flags" == *-lcudnn* && "$cudnn_flags" == *-DMPX_HAS_CUDNN=1* ]] ||
    { echo "mpx-cudnn.pc gives '$cudnn_flags'" >&2; exit 1; }
fi
echo "   cuDNN fused attention (mpx-cudnn.pc, mpx::cudnn): $has_pc"

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  echo "== CUDA consumer ($nvcc, sm_90; compile and link only)"
  cmake -S "$here" -B "$tmp/cuda" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_CXX_COMPILER=g++ \
    -DMPX_CONSUMER_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >"$tmp/cuda-cmake.log" || { cat "$tmp/cuda-cmake.log"; exit 1; }
  cmake --build "$tmp/cuda" --target consumer_cuda -j 2
  # The link must have pulled in cuBLASLt through mpx::mpx (CUDA::cublasLt). ldd's
  # output is read whole first: `ldd | grep -q` under pipefail fails at random when grep
  # stops at the first match and ldd dies of SIGPIPE.
  needed=$(ldd "$tmp/cuda/consumer_cuda")
  if [[ "$needed" != *libcublasLt* ]]; then
    echo "consumer_cuda does not link cuBLASLt" >&2
    exit 1
  fi
  echo "   consumer_cuda built and linked against cuBLASLt"
else
  echo "== CUDA consumer skipped: no nvcc"
fi
echo "== CMake consumer: OK"
