#!/usr/bin/env bash
# What including mpx costs a user's translation unit: CPU seconds (user + system) of
# nvcc and of g++ for a file that includes one area header and nothing else, for
# <mpx/mpx.hpp>, and for examples/user_kernel (a user's own kernel on mpx's types).
# One architecture, the flags a user would pass (-std=c++20 -O2, no -g). Each compile
# runs `repeat` times (default 3) and the smallest figure is printed: on a shared
# machine the smallest is the least disturbed.
#   bench/compile_times.sh [repeat]      (MPX_COMPILE_UNITS="mpx user_kernel" picks the units)
# A compile that fails prints its log and the figure "failed" (it used to print 0.0).
set -euo pipefail
cd "$(dirname "$0")/.."
repeat=${1:-3}
cuda=${MPX_CUDA:-/usr/local/cuda}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(-std=c++20 -O2 -Iinclude -isystem "$cuda/include" -isystem "$cuda/include/cccl")
[ -d /usr/include/x86_64-linux-gnu/openblas-pthread ] &&
  flags+=(-I/usr/include/x86_64-linux-gnu/openblas-pthread -DMPX_HAS_CBLAS=1)
flags+=(-DMPX_HAS_ZLIB=1)

cpu_seconds() {  # cpu_seconds COMMAND...: the smallest user+system time of `repeat` runs
  local best="" t i
  for ((i = 0; i < repeat; ++i)); do
    if ! /usr/bin/time -o "$work/time" -f '%U %S' "$@" >"$work/log" 2>&1; then
      echo "bench/compile_times.sh: this compile failed: $*" >&2
      cat "$work/log" >&2
      echo failed
      return
    fi
    t=$(awk '{printf "%.1f", $1 + $2}' "$work/time")
    if [ -z "$best" ] || awk -v a="$t" -v b="$best" 'BEGIN { exit !(a < b) }'; then best=$t; fi
  done
  echo "$best"
}

printf '%-28s %10s %10s\n' "translation unit" "nvcc (s)" "g++ (s)"
for what in ${MPX_COMPILE_UNITS:-core exec kernels numerics losses scaling optim layers model data mpx user_kernel}; do
  if [ "$what" = user_kernel ]; then
    src=examples/user_kernel/main.cpp
  else
    src=$work/$what.cpp
    echo "#include <mpx/$what.hpp>" >"$src"
  fi
  # Compiled where it is (a copy elsewhere would lose its relative includes); nvcc is
  # told it is CUDA.
  nv=$(cpu_seconds nvcc "${flags[@]}" -arch=sm_90 -x cu -c "$src" -o "$work/unit.o")
  gx=$(cpu_seconds g++ "${flags[@]}" -x c++ -c "$src" -o "$work/unit.o")
  label="<mpx/$what.hpp>"
  [ "$what" = user_kernel ] && label="examples/user_kernel"
  printf '%-28s %10s %10s\n' "$label" "$nv" "$gx"
done
