#!/usr/bin/env bash
# The README's test command: install what is missing, build, and run every test this
# machine can run.
#   scripts/test.sh            the CUDA suite too where there is a GPU (for this machine's
#                              GPU: -Dgpu_architectures=native), else host only
#   scripts/test.sh --cuda     build the CUDA suite even without a GPU (it then reports
#                              itself skipped); architectures from $MPX_GPU_ARCHS, default 90
#   scripts/test.sh --no-cuda  host only, even with a GPU
# Host: the host suite, the compile-failure snippets, the doc snippets, the examples'
# smoke runs and the GPU kit's dry run. Ends with one line: N passed, N failed, N skipped.
# The benchmarks and the every-header-alone checks are CI's (.ci/run), not built here:
# -Dbenchmarks=true and -Dheader_checks=true turn them on in a build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build_env.sh

want=auto
for arg in "$@"; do
  case "$arg" in
    --cuda) want=cuda ;;
    --no-cuda) want=host ;;
    *) echo "usage: scripts/test.sh [--cuda|--no-cuda]" >&2; exit 2 ;;
  esac
done

scripts/setup.sh

# No benchmarks or every-header checks (CI's stages), the host suite's units at -O0
# but for the arithmetic's own tests (core/, kernels/, attention), which stay at -O1,
# and the examples at -O1 for their smoke runs (scripts/example.sh builds the main
# example at -O2 again): the build is most of this command's ten minutes (bench/NOTES.md).
test_options="-Dbenchmarks=false -Dheader_checks=false -Dtests_optimization=0 -Dexamples_optimization=1"

have_nvcc=false
command -v nvcc >/dev/null 2>&1 && have_nvcc=true
if [ "$want" = cuda ] && ! $have_nvcc; then
  echo "scripts/test.sh --cuda: nvcc is not on PATH" >&2
  exit 2
fi
if [ "$want" = cuda ] || { [ "$want" = auto ] && $have_nvcc && mpx_gpu_present; }; then
  if mpx_gpu_present; then
    archs=${MPX_GPU_ARCHS:-native}
    what="host and CUDA suites (CUDA built for $archs, run on $(mpx_gpu_name))"
  else
    archs=${MPX_GPU_ARCHS:-90}
    what="host suite; CUDA suite built for sm_$archs but not run: no GPU on this machine"
  fi
  mpx_configure build -Dcuda=enabled -Dgpu_architectures="$archs" $test_options
else
  if $have_nvcc; then
    what="host suite only: no GPU on this machine, so the CUDA suite is not built (scripts/test.sh --cuda builds it)"
  else
    what="host suite only: no nvcc on this machine"
  fi
  mpx_configure build -Dcuda=disabled $test_options
fi
echo "== mpx test: $what"

mpx_drop_stale_cuda_objects build "$PWD"
meson compile -C build
rc=0
meson test -C build --print-errorlogs || rc=$?

echo "== mpx test: $what"
python3 - build/meson-logs/testlog.json <<'PY'
import json, sys
passed = failed = skipped = 0
with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        result = json.loads(line)["result"]
        if result in ("OK", "EXPECTEDFAIL"):
            passed += 1
        elif result == "SKIP":
            skipped += 1
        else:
            failed += 1
print(f"{passed} passed, {failed} failed, {skipped} skipped")
PY
exit "$rc"
