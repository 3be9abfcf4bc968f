#!/usr/bin/env bash
# Packs what a lent GPU machine needs to run mpx's GPU checks without building there: the
# CUDA test suite, the examples and the benchmarks of a built CUDA build directory,
# stripped; gpu_probe, a tiny CUDA program built here that gpu_run.sh runs first (and under
# compute-sanitizer, to see whether the sanitizer accepts the device); the shared libraries
# the programs use that a GPU image may lack (OpenBLAS, its Fortran runtime, zlib), plus the
# CUDA runtime as a fallback; and the Fashion-MNIST files. All of it lands in .gpu/ (ignored
# by git), which the device call carries:
#
#   scripts/gpu_kit.sh [BUILD_DIR] [--only tests|perf]
#   then, with the device tool:  run  command="bash scripts/gpu_run.sh tests"  carry=[".gpu"]
#                                run  command="bash scripts/gpu_run.sh perf"   carry=[".gpu"]
#
# BUILD_DIR (default: build-cuda if it exists, else build) is a build directory configured
# as .ci/run configures build-cuda (-Dcuda=enabled -Dgpu_architectures=90 -Dbenchmarks=true
# -Dhost_isa=baseline -Donednn=disabled) whose targets are built. This script builds
# gpu_probe, and rebuilds the CUDA objects of BUILD_DIR that are older than a source: Meson
# 1.0 records no header dependencies for nvcc, so ninja alone never rebuilds them after a
# header or a test file changes, and a kit would pack programs built from older headers
# (or mixing two versions of them). --only packs just what one phase of gpu_run.sh needs, for when the
# whole kit does not fit. The check at the end counts everything the device call sends, the
# working tree (tracked files, untracked files git does not ignore, shared/) and .gpu/,
# against the 64 MiB a call carries.
#
# Hooks for the dry run (tests/scripts/test_gpu_kit_dry_run.sh), unset on a real run:
# GPU_KIT_NVCC (the compiler for gpu_probe; 'none' leaves the probe out), GPU_KIT_DATA (the
# Fashion-MNIST folder), GPU_KIT_LIMIT_MIB (the size limit).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "gpu_kit: $*" >&2; exit 1; }
build='' only=all
while [ $# -gt 0 ]; do
  case $1 in
    --only) [ $# -ge 2 ] || die "--only needs tests or perf"; only=$2; shift 2 ;;
    --only=*) only=${1#--only=}; shift ;;
    -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$build" ] || die "one build directory, not '$build' and '$1'"; build=$1; shift ;;
  esac
done
case $only in all|tests|perf) ;; *) die "--only takes tests or perf, not '$only'" ;; esac
if [ -z "$build" ]; then
  if [ -d build-cuda ]; then build='build-cuda'; else build='build'; fi
fi
[ -d "$build" ] || die "no build directory $build (configure one: meson setup build-cuda -Dcuda=enabled -Dgpu_architectures=90 -Dbenchmarks=true -Donednn=disabled -Dhost_isa=baseline && meson compile -C build-cuda)"
if [ "$only" != perf ] && [ ! -x "$build/tests/mpx_tests_cuda" ]; then
  die "$build has no tests/mpx_tests_cuda: configure it with -Dcuda=enabled and build it (meson compile -C $build), or pass another build directory"
fi

# Build facts from Meson's introspection files, where there are any (a stand-in build
# directory has none): the source tree, the nvcc it used, the GPU architectures.
meson_info() {  # meson_info FILE PYTHON-EXPRESSION-OF-j: prints it, or nothing
  [ -f "$build/meson-info/$1" ] || return 0
  python3 -c 'import json, sys
j = json.load(open(sys.argv[1]))
print(eval(sys.argv[2]))' "$build/meson-info/$1" "$2" 2>/dev/null || true
}
source_dir=$(meson_info meson-info.json 'j["directories"]["source"]')
[ -n "$source_dir" ] || source_dir=$PWD
archs=$(meson_info intro-buildoptions.json '",".join(str(o["value"]) for o in j if o["name"] == "gpu_architectures")')
case ",${archs// /}," in
  ,,|*,90,*) ;;
  ,native,) echo "gpu_kit: warning: $build was built for gpu_architectures=native, the GPUs of the machine that built it, not necessarily sm_90 (H100/H200)" >&2 ;;
  *) echo "gpu_kit: warning: $build has no sm_90 code (gpu_architectures=$archs): on an H100/H200 the driver compiles PTX at start, if there is PTX for an older architecture at all" >&2 ;;
esac
isa=$(meson_info intro-buildoptions.json '",".join(str(o["value"]) for o in j if o["name"] == "host_isa")')
[ -z "$isa" ] || [ "$isa" = baseline ] ||
  echo "gpu_kit: warning: $build compiles its C++ objects with host_isa=$isa (-march=native here), which the GPU machine's CPU may lack: configure it with -Dhost_isa=baseline, as .ci/run does" >&2
# Every CUDA object older than the newest source: deleted and rebuilt.
source "$(dirname "${BASH_SOURCE[0]}")/build_env.sh"
stale=$(mpx_stale_cuda_objects "$build" "$source_dir")
if [ -n "$stale" ]; then
  [ -f "$build/build.ninja" ] || die "$build has CUDA objects older than a source, and no build.ninja to rebuild them with"
  echo "gpu_kit: $(mpx_drop_stale_cuda_objects "$build" "$source_dir")"
  ninja -C "$build" || die "rebuilding $build failed"
fi

kit=.gpu
rm -rf "$kit"
stage=$kit/stage
mkdir -p "$stage/bin" "$stage/lib" "$stage/fallback"
if [ "$only" != perf ]; then
  cp "$build/tests/mpx_tests_cuda" "$stage/bin/"
  [ ! -x "$build/tests/mpx_tests_nccl" ] || cp "$build/tests/mpx_tests_nccl" "$stage/bin/"  # built where MPI is found
  [ ! -x "$build/examples/fashion_mnist" ] || cp "$build/examples/fashion_mnist" "$stage/bin/"  # one epoch in the tests phase
fi
if [ "$only" != tests ]; then
  for e in "$build"/examples/*; do [ -f "$e" ] && [ -x "$e" ] && cp "$e" "$stage/bin/"; done
  for b in "$build"/bench/*_bench; do [ -f "$b" ] && [ -x "$b" ] && cp "$b" "$stage/bin/"; done
  # (scripts/test.sh configures its build without benchmarks: the perf phase needs them)
  compgen -G "$stage/bin/*_bench" >/dev/null ||
    echo "gpu_kit: warning: $build has no benchmarks (configure it with -Dbenchmarks=true and build it): the perf phase will run none" >&2
fi

# gpu_probe: a device, an allocation, a kernel and a copy back, with the runtime linked
# statically, so that it tells a broken driver or device apart from a missing library.
nvcc=${GPU_KIT_NVCC:-}
[ -n "$nvcc" ] || nvcc=$(meson_info intro-compilers.json 'next((e for e in j["host"]["cuda"]["exelist"] if e.endswith("nvcc")), "")')
[ -n "$nvcc" ] || nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; } || true
if [ "$nvcc" = none ] || [ -z "$nvcc" ]; then
  echo "gpu_kit: warning: no nvcc, so no gpu_probe: gpu_run.sh probes the sanitizer with the test suite instead" >&2
else
  cat > "$stage/gpu_probe.cu" <<'EOF'
// gpu_probe (written by scripts/gpu_kit.sh): the smallest complete use of a GPU. gpu_run.sh
// runs it first, and again under compute-sanitizer to learn whether the sanitizer accepts
// the device. Exit 0: everything worked; 77: no usable GPU; 1: a step failed (printed).
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

__global__ void fill(int* out, int n) {
  int const i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = 3 * i + 1;
}

static bool ok(cudaError_t e, char const* what) {
  if (e == cudaSuccess) return true;
  std::printf("gpu_probe: %s failed: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
  return false;
}

int main() {
  int devices = 0;
  cudaError_t const found = cudaGetDeviceCount(&devices);
  if (found != cudaSuccess || devices == 0) {
    std::printf("gpu_probe: no usable GPU (%s)\n", found != cudaSuccess ? cudaGetErrorString(found) : "no devices");
    return 77;
  }
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  cudaDeviceProp p{};
  if (!ok(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties")) return 1;
  std::printf("gpu_probe: %s, sm_%d%d, %d multiprocessors, %.1f GiB; driver %d, runtime %d; %d device(s)\n", p.name,
              p.major, p.minor, p.multiProcessorCount, static_cast<double>(p.totalGlobalMem) / 1073741824.0, driver,
              runtime, devices);
  int const n = 1 << 20;
  int* d = nullptr;
  if (!ok(cudaMalloc(&d, n * sizeof(int)), "cudaMalloc")) return 1;
  fill<<<(n + 255) / 256, 256>>>(d, n);
  if (!ok(cudaGetLastError(), "kernel launch") || !ok(cudaDeviceSynchronize(), "kernel")) return 1;
  std::vector<int> h(n, -1);
  if (!ok(cudaMemcpy(h.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy")) return 1;
  if (!ok(cudaFree(d), "cudaFree")) return 1;
  for (int i = 0; i < n; ++i) {
    if (h[i] != 3 * i + 1) {
      std::printf("gpu_probe: wrong value at %d: %d, expected %d\n", i, h[i], 3 * i + 1);
      return 1;
    }
  }
  std::printf("gpu_probe: kernel ok\n");
  return 0;
}
EOF
  echo "gpu_kit: building gpu_probe with $nvcc"
  "$nvcc" -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=compute_80 \
      -o "$stage/bin/gpu_probe" "$stage/gpu_probe.cu" ||
    echo "gpu_kit: warning: gpu_probe did not build: gpu_run.sh probes the sanitizer with the test suite instead" >&2
  rm -f "$stage/gpu_probe.cu"
fi
strip --strip-unneeded "$stage"/bin/* 2>/dev/null || true

# Shared libraries. The GPU image has a newer glibc and libstdc++ than this machine and its
# own CUDA libraries (cuBLASLt alone is 500 MB), so those stay here; the CUDA runtime
# travels as a fallback that gpu_run.sh uses only where the machine has none; every other
# library the programs load travels and comes first for them.
ldd_out=$(ldd "$stage"/bin/* 2>/dev/null || true)
device_provides=()
while read -r name path; do
  case $name in
    linux-vdso*|ld-linux*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libresolv.so*|libutil.so*|libstdc++.so*|libgcc_s.so*) ;;
    libcudart.so*) cp -L "$path" "$stage/fallback/" ;;
    libcuda.so*|libcublas*|libnvidia-*|libnvrtc*|libnvJitLink*|libcurand*|libcufft*|libcusparse*|libcusolver*|libnccl*|libcudnn*)
      device_provides+=("$name") ;;
    *) cp -L "$path" "$stage/lib/" ;;
  esac
done < <(printf '%s\n' "$ldd_out" | awk '/=> \// {print $1, $3}' | sort -u)
not_here=$(printf '%s\n' "$ldd_out" | awk '/=> not found/ {print $1}' | sort -u | tr '\n' ' ')
case " $(printf '%s\n' "$ldd_out" | awk '{print $1}' | tr '\n' ' ')" in
  *" libdnnl.so"*) echo "gpu_kit: warning: the programs link oneDNN (40 MB, and libgomp): configure $build with -Donednn=disabled, as .ci/run does, or the kit may not fit" >&2 ;;
esac
[ ${#device_provides[@]} -eq 0 ] ||
  echo "gpu_kit: left for the GPU machine to provide: ${device_provides[*]} (gpu_run.sh looks in its CUDA toolkit and Python's nvidia-* packages)"
[ -z "$not_here" ] ||
  echo "gpu_kit: not found on this machine, so not packed (gpu_run.sh looks for them there): $not_here"
echo "gpu_kit: packed libraries: $(cd "$stage" && find lib fallback -type f -printf '%p ')"

# char_lm's corpus, which the suite's text-corpus cases read too (gpu_run.sh links it where
# they look for it): the fortune files themselves (2.6 MB), not fortune's indexes.
mkdir -p "$kit/data/fortunes"
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} "$kit/data/fortunes/" \; 2>/dev/null ||
  echo "gpu_kit: warning: no fortunes under /usr/share/games/fortunes (scripts/setup.sh installs them)" >&2
# Both phases run the main example on Fashion-MNIST.
data=${GPU_KIT_DATA:-/usr/share/datasets/fashion-mnist}
mkdir -p "$kit/data/fashion-mnist"
cp "$data"/*.gz "$kit/data/fashion-mnist/" 2>/dev/null ||
  echo "gpu_kit: warning: no Fashion-MNIST under $data (scripts/setup.sh installs it); gpu_run.sh will skip the example on it" >&2

# What the programs were built from: the build directory's source tree, which is not this
# checkout when BUILD_DIR is another clone's.
{
  commit=$(git -C "$source_dir" rev-parse -q --verify HEAD 2>/dev/null || echo unknown)
  [ "$commit" = unknown ] || git -C "$source_dir" diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
  echo "commit $commit"
  echo "build $(cd "$build" && pwd), packed $(date -u '+%Y-%m-%d %H:%M UTC') for phase $only"
  echo "source $source_dir"  # compiled into the suite's doc-quote cases: gpu_run.sh links it to the device's checkout
  echo "programs $(find "$stage/bin" -type f -printf '%f ')"
} > "$kit/info"
# Programs and libraries shrink about fivefold under xz (the data is gzip already);
# gpu_run.sh unpacks them on the device.
tar -cJf "$kit/programs.tar.xz" -C "$stage" bin lib fallback
rm -rf "$stage"

# The size check: everything the device call sends, not the kit alone.
sum_sizes() {  # NUL-separated paths on stdin -> "BYTES FILES"
  { xargs -0 -r stat -c %s -- 2>/dev/null || true; } | awk '{ s += $1; n += 1 } END { printf "%d %d\n", s, n }'
}
tree_files() {  # NUL-separated: the files of the working tree that travel, .gpu/ among them
  if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard
  else
    echo "gpu_kit: warning: not a git checkout; counting every file but .git/" >&2
    find . -path ./.git -prune -o -type f -printf '%P\0'
  fi
  if [ -d shared ]; then find shared -type f -print0; fi
  find "$kit" -type f -print0
}
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
read -r total_bytes total_files < <(tree_files | sort -zu | sum_sizes)
read -r kit_bytes _ < <(find "$kit" -type f -print0 | sum_sizes)
limit_mib=${GPU_KIT_LIMIT_MIB:-64}
echo "gpu_kit: the device call carries $(mib "$total_bytes") MiB ($total_bytes bytes, $total_files files) of its $limit_mib MiB:" \
  "$(mib $((total_bytes - kit_bytes))) MiB of working tree and $(mib "$kit_bytes") MiB of $kit/"
du -sh "$kit"/* | sed 's/^/  /'
if [ "$total_bytes" -ge $((limit_mib * 1048576)) ]; then
  echo "gpu_kit: too large to carry. The largest files that travel:" >&2
  tree_files | sort -zu | { xargs -0 -r stat -c '%s %n' -- 2>/dev/null || true; } | sort -rn | head -n 8 |
    awk '{ printf "  %8.1f MiB  %s\n", $1 / 1048576, $2 }' >&2
  echo "gpu_kit: pack one phase at a time (--only tests, then --only perf), or ignore or remove large untracked files: they travel too" >&2
  exit 1
fi
echo "gpu_kit: ready. Device tool: run command=\"bash scripts/gpu_run.sh tests\" carry=[\"$kit\"], then the same with perf"
