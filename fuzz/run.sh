#!/usr/bin/env bash
# Builds the libFuzzer harness of mpx's file readers (fuzz/fuzz_reader.cpp) with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer, and runs each reader's fuzzer for
# SECONDS (default 60) on top of its stored corpus (fuzz/corpus/<reader>/); what it
# finds new goes to build-fuzz/corpus/<reader>/, not into the repository. Prints each
# fuzzer's execution count. Any finding (a crash, a sanitizer report, an exception that
# is not an mpx::error, a slow input, memory past the limit) fails the script and
# leaves its reproducer in build-fuzz/findings/<reader>/: fix the reader, then copy the
# reproducer to fuzz/regressions/<reader>/, where the host suite replays it
# (tests/model/test_fuzz_corpus.cpp).
#   fuzz/run.sh [SECONDS]       build, then fuzz every reader
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

echo "== building the fuzzers with $cxx"
"${launcher[@]}" "$cxx" "${common[@]}" -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  fuzz/fuzz_reader.cpp -lz -o "$out/fuzz_readers"

export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
failed=()
summary=()
for reader in $(MPX_FUZZ_READER=list "$out/fuzz_readers"); do
  mkdir -p "$out/corpus/$reader" "$out/findings/$reader"
  echo "== fuzzing $reader for $seconds s"
  status=0
  # -rss_limit_mb also caps any single allocation (malloc_limit_mb defaults to it):
  # a header that makes a reader ask for gigabytes is a finding.
  MPX_FUZZ_READER=$reader "$out/fuzz_readers" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
    -max_len=16384 -print_final_stats=1 -artifact_prefix="$out/findings/$reader/" \
    "$out/corpus/$reader" "fuzz/corpus/$reader" >"$out/$reader.log" 2>&1 || status=$?
  runs=$(awk '/stat::number_of_executed_units/ {print $2}' "$out/$reader.log")
  if [ "$status" -ne 0 ]; then
    failed+=("$reader")
    grep -E "ERROR|SUMMARY|Test unit written|terminate|what\(\)" "$out/$reader.log" | head -20 || true
  fi
  summary+=("$(printf '%-12s %12s executions  %s' "$reader" "${runs:-?}" "$([ "$status" -eq 0 ] && echo ok || echo "FOUND (log: $out/$reader.log)")")")
done
echo "== fuzzers ($seconds s each, $cxx)"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz/run.sh: findings in ${failed[*]}; reproducers under $out/findings/" >&2
  exit 1
fi
