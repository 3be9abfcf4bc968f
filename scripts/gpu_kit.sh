#!/usr/bin/env bash
# Prepares what a lent GPU machine needs to run mpx's GPU checks in one call, without
# building there: the CUDA test suite, the examples and the benchmarks built here by
# nvcc (sm_90), stripped; the shared libraries they use that the GPU image lacks
# (OpenBLAS and its Fortran runtime), packed with xz; and the Fashion-MNIST files.
# Everything lands in .gpu/ (ignored by git), which the device call carries:
#
#   scripts/gpu_kit.sh [BUILD_DIR]      # default: configure and build build-gpu (release)
#   then, with the device tool:  run  command="bash scripts/gpu_run.sh"  carry=[".gpu"]
#
# BUILD_DIR may be any build directory configured with -Dcuda=enabled whose targets are
# built (a fresh clone's CI build, say). The kit must stay under the 64 MiB a call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
if [ $# -eq 0 ]; then
  [ -d "$build" ] || meson setup "$build" -Dcuda=enabled -Dbuildtype=release
  meson compile -C "$build"
fi
[ -x "$build/tests/mpx_tests_cuda" ] || { echo "gpu_kit: $build has no CUDA test suite (configure with -Dcuda=enabled)" >&2; exit 1; }

kit=.gpu
rm -rf "$kit"
mkdir -p "$kit/bin" "$kit/lib" "$kit/data/fashion-mnist"
cp "$build/tests/mpx_tests_cuda" "$kit/bin/"
for e in "$build"/examples/*; do [ -f "$e" ] && [ -x "$e" ] && cp "$e" "$kit/bin/"; done
for b in "$build"/bench/*_bench; do [ -x "$b" ] && cp "$b" "$kit/bin/"; done
strip --strip-unneeded "$kit"/bin/* 2>/dev/null || true

# Libraries the binaries need that are not in the GPU image (which has the CUDA toolkit
# and a newer glibc and libstdc++ than Debian 12's, so only these travel).
for lib in $(ldd "$kit"/bin/* 2>/dev/null | awk '/=> \// {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libopenblas*|libgfortran*|libquadmath*|libz.so*) cp -L "$lib" "$kit/lib/" ;;
  esac
done
cp /usr/share/datasets/fashion-mnist/*.gz "$kit/data/fashion-mnist/" 2>/dev/null ||
  echo "gpu_kit: no Fashion-MNIST under /usr/share/datasets (scripts/setup.sh installs it); the example will be skipped" >&2
# The commit the binaries were built from: the build directory's source tree, which is
# not this checkout when BUILD_DIR is another clone's.
source_dir=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["directories"]["source"])' \
  "$build/meson-info/meson-info.json")
git -C "$source_dir" rev-parse HEAD > "$kit/commit"
if ! git -C "$source_dir" diff --quiet HEAD 2>/dev/null; then echo "dirty" >> "$kit/commit"; fi
# Programs and libraries shrink about fivefold under xz (the data is gzip already);
# gpu_run.sh unpacks them on the device.
tar -cJf "$kit/programs.tar.xz" -C "$kit" bin lib
rm -rf "$kit/bin" "$kit/lib"

size=$(du -sm "$kit" | cut -f1)
echo "gpu_kit: $kit holds ${size} MiB (limit 64):"
du -sh "$kit"/* | sed 's/^/  /'
[ "$size" -lt 64 ] || { echo "gpu_kit: too large to carry" >&2; exit 1; }
