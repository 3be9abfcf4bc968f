#!/usr/bin/env bash
# Builds mpx's two libFuzzer harnesses with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer: the file readers' (fuzz/fuzz_reader.cpp) and the public
# API's (fuzz/fuzz_api.cpp, shapes and values through every kernel and layer, in
# groups: fuzz/api/groups.hpp). Runs each reader's and each API group's fuzzer for
# SECONDS (default 60), as many at a time as there are cores (MPX_FUZZ_JOBS), on top of
# its stored corpus (fuzz/corpus/<name>/, the API groups' named api_<group>); what it
# finds new goes to build-fuzz/corpus/<name>/, not into the repository. Prints each fuzzer's execution count. Any finding (a crash, a sanitizer
# report, an exception that is not an mpx::error, a result off its float64 reference, a
# slow input, memory past the limit) fails the script and leaves its reproducer in
# build-fuzz/findings/<name>/: fix mpx, then copy the reproducer to
# fuzz/regressions/<name>/, where the host suite replays it
# (tests/model/test_fuzz_corpus.cpp, tests/model/test_fuzz_api.cpp).
#   fuzz/run.sh [SECONDS] [NAME...]  build, then fuzz every reader and API group (or those named)
#   fuzz/run.sh --regenerate    rewrite fuzz/corpus/ and the issue-21 files in fuzz/regressions/
#                               with fuzz/make_corpus.cpp
# CXX picks the compiler; by default the newest of clang++-19, -16, -14 found.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=${MPX_CUDA:-/usr/local/cuda}
out=build-fuzz
mkdir -p "$out"

cxx=${CXX:-}
if [ -z "$cxx" ]; then
  for c in clang++-19 clang++-16 clang++-14 clang++; do
    if command -v "$c" >/dev/null; then cxx=$c; break; fi
  done
fi
[ -n "$cxx" ] || { echo "fuzz/run.sh: no clang++ found (scripts/setup.sh installs clang-19)" >&2; exit 1; }
launcher=()
command -v ccache >/dev/null && launcher=(ccache)
common=(-std=c++20 -I. -Iinclude -isystem "$cuda/include" -isystem "$cuda/include/cccl" -DMPX_HAS_ZLIB=1)

if [ "${1:-}" = "--regenerate" ]; then
  "${launcher[@]}" "$cxx" "${common[@]}" -O1 fuzz/make_corpus.cpp -lz -o "$out/make_corpus"
  "$out/make_corpus" fuzz
  du -sh fuzz/corpus/* fuzz/regressions/*
  exit 0
fi
seconds=${1:-60}
shift || true

echo "== building the fuzzers with $cxx"
sanitize=(-O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)
# Each translation unit is compiled to an object on its own (ccache caches a compile, not
# a compile-and-link), as many at a time as there are cores; then the two links.
# CCACHE_BASEDIR makes the cache key relative to the checkout, so a fresh clone hits.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=true
api_units=(fuzz/fuzz_api.cpp fuzz/api/elementwise.cpp fuzz/api/matmul.cpp fuzz/api/rows.cpp fuzz/api/sequence.cpp fuzz/api/optim.cpp fuzz/api/fp8_layers.cpp)
object() { echo "$out/obj/$(basename "${1%.cpp}").o"; }
mkdir -p "$out/obj"
build_jobs=${MPX_FUZZ_JOBS:-$(nproc)}
for unit in fuzz/fuzz_reader.cpp "${api_units[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$build_jobs" ]; do wait -n || { echo "fuzz/run.sh: a fuzzer did not compile" >&2; exit 1; }; done
  "${launcher[@]}" "$cxx" "${common[@]}" "${sanitize[@]}" -c "$unit" -o "$(object "$unit")" &
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n || { echo "fuzz/run.sh: a fuzzer did not compile" >&2; exit 1; }; done
api_objects=()
for unit in "${api_units[@]}"; do api_objects+=("$(object "$unit")"); done
"$cxx" "${sanitize[@]}" "$(object fuzz/fuzz_reader.cpp)" -lz -o "$out/fuzz_readers" &
"$cxx" "${sanitize[@]}" "${api_objects[@]}" -o "$out/fuzz_api" &
wait -n && wait -n || { echo "fuzz/run.sh: a fuzzer did not link" >&2; exit 1; }

export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# fuzz NAME ENV_VAR VALUE BINARY: one fuzzer for $seconds s on its corpus; its outcome
# goes to $out/NAME.result (the fuzzers run side by side, one per core).
fuzz() {
  local name=$1 variable=$2 value=$3 binary=$4 status=0 runs
  mkdir -p "$out/corpus/$name" "$out/findings/$name"
  # -rss_limit_mb also caps any single allocation (malloc_limit_mb defaults to it):
  # a header that makes a reader ask for gigabytes is a finding.
  env "$variable=$value" "$binary" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 ${seed_flag[@]+"${seed_flag[@]}"} \
    -max_len=16384 -print_final_stats=1 -artifact_prefix="$out/findings/$name/" \
    "$out/corpus/$name" $([ -d "fuzz/corpus/$name" ] && echo "fuzz/corpus/$name") >"$out/$name.log" 2>&1 || status=$?
  runs=$(awk '/stat::number_of_executed_units/ {print $2}' "$out/$name.log")
  printf '%-16s %12s executions  %s\n' "$name" "${runs:-?}" \
    "$([ "$status" -eq 0 ] && echo ok || echo "FOUND (log: $out/$name.log)")" >"$out/$name.result"
}
# MPX_FUZZ_SEED fixes libFuzzer's seed (CI sets it, so a run does not go red on what a
# fresh random seed happens to find that day; explore with fresh seeds by hand).
seed_flag=()
[ -n "${MPX_FUZZ_SEED:-}" ] && seed_flag=(-seed="$MPX_FUZZ_SEED")
wanted=("$@")
jobs=${MPX_FUZZ_JOBS:-$(nproc)}
names=()
start() {  # start NAME ...: the fuzzer in the background, at most $jobs at a time
  if [ ${#wanted[@]} -gt 0 ] && [[ " ${wanted[*]} " != *" $1 "* ]]; then return; fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  echo "== fuzzing $1 for $seconds s"
  names+=("$1")
  rm -f "$out/$1.result"
  fuzz "$@" &
}
for reader in $(MPX_FUZZ_READER=list "$out/fuzz_readers"); do
  start "$reader" MPX_FUZZ_READER "$reader" "$out/fuzz_readers"
done
for group in $(MPX_FUZZ_API=list "$out/fuzz_api"); do
  start "api_$group" MPX_FUZZ_API "$group" "$out/fuzz_api"
done
wait
failed=()
summary=()
for name in "${names[@]}"; do
  result=$(cat "$out/$name.result" 2>/dev/null || echo "$name  did not report")
  summary+=("$result")
  if [[ "$result" != *" ok" ]]; then
    failed+=("$name")
    grep -E "ERROR|SUMMARY|Test unit written|terminate|what\(\)" "$out/$name.log" | head -20 || true
  fi
done
echo "== fuzzers ($seconds s each, $jobs at a time, $cxx)"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz/run.sh: findings in ${failed[*]}; reproducers under $out/findings/" >&2
  exit 1
fi
