#!/usr/bin/env bash
# Runs on a lent GPU machine, from the repository root, with .gpu/ (scripts/gpu_kit.sh)
# carried: every check that needs a GPU, in one call that fits a 10-minute command.
# Logs go to $OUT (the device tool brings them back); the last lines printed are a
# summary table. Steps:
#   1. the device, as the driver and nvidia-smi report it
#   2. the CUDA test suite
#   3. compute-sanitizer memcheck and racecheck on the model and kernel tests
#   4. the main example, 5 epochs under each policy, eager and with --cuda-graph
#   5. every benchmark on full sizes
# Each step has its own time limit, so a hang in one still leaves the others' results.
#
#   bash scripts/gpu_run.sh [all|tests|perf]   # tests: 1-3; perf: 1, 4-5; all: both
#
# `all` can approach the device's 10-minute limit per command: on a first run, prefer
# `tests` and `perf` as two calls. Every step's limit is cut to what is left of
# GPU_RUN_BUDGET seconds (default 570), so the summary is printed inside that limit.
set -uo pipefail
phase=${1:-all}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mpx-gpu-out}
mkdir -p "$OUT"
kit=$PWD/.gpu
programs=/tmp/mpx-gpu
rm -rf "$programs" && mkdir -p "$programs" && tar -xJf "$kit/programs.tar.xz" -C "$programs" ||
  { echo "gpu_run: cannot unpack $kit/programs.tar.xz (run scripts/gpu_kit.sh and carry .gpu)" >&2; exit 1; }
export LD_LIBRARY_PATH="$programs/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PATH="/usr/local/cuda/bin:$PATH"
bin=$programs/bin
summary=()
budget=${GPU_RUN_BUDGET:-570}

step() {  # step NAME SECONDS COMMAND...: runs it, logs to $OUT/NAME.log, records the outcome
  local name=$1 limit=$2
  shift 2
  local left=$((budget - SECONDS - 5))
  if [ $left -lt 10 ]; then
    summary+=("$(printf '%-28s %-22s' "$name" "not run: out of time")")
    return
  fi
  [ $limit -le $left ] || limit=$left
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -eq 0 ] || verdict="FAILED rc=$rc"
  [ $rc -eq 124 ] && verdict="TIMED OUT after ${limit}s"
  summary+=("$(printf '%-28s %-22s %5ss' "$name" "$verdict" $((SECONDS - start)))")
  tail -n 4 "$OUT/$name.log" | sed "s/^/  [$name] /"
}

echo "kit built from $(cat "$kit/commit" 2>/dev/null | tr '\n' ' ')"
step device 30 nvidia-smi
if [ "$phase" != perf ]; then
step tests_cuda 240 "$bin/mpx_tests_cuda" --reporter compact
if command -v compute-sanitizer > /dev/null; then
  step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/mpx_tests_cuda" "[model],[conv],[lstm],[norm],[dropout],[histogram]" --reporter compact
  step racecheck 150 compute-sanitizer --tool racecheck --error-exitcode 1 "$bin/mpx_tests_cuda" "[numerics],[softmax],[losses],[norm]" --reporter compact
fi
fi
if [ "$phase" != tests ]; then
data=$kit/data/fashion-mnist
if [ -f "$data/train-images-idx3-ubyte.gz" ]; then
  step fashion_mnist 150 "$bin/fashion_mnist" --executor cuda --policy all --epochs 5 --data "$data" --probe
  step fashion_mnist_graph 150 "$bin/fashion_mnist" --executor cuda --policy all --epochs 5 --data "$data" --cuda-graph
fi
for e in binary_classifier unstable_division custom_training_loop user_kernel overflow_underflow lstm_sequences; do
  [ -x "$bin/$e" ] && step "$e" 60 "$bin/$e" --executor cuda
done
[ -x "$bin/numerics_bench" ] && step numerics_bench 60 "$bin/numerics_bench" --executor cuda --repeat 20
[ -x "$bin/scaling_bench" ] && step scaling_bench 90 "$bin/scaling_bench" --executor cuda --tensors 100,200,1000 --repeat 20
[ -x "$bin/activation_bench" ] && step activation_bench 60 "$bin/activation_bench" --executor cuda --repeat 20
[ -x "$bin/gemm_bench" ] && step gemm_bench 90 "$bin/gemm_bench" --executor cuda --repeat 10 --shapes all
[ -x "$bin/layer_bench" ] && step layer_bench 90 "$bin/layer_bench" --executor cuda --repeat 20
# PyTorch's counterparts of scaling_bench's rows, where the machine has PyTorch.
python3 -c "import torch" 2> /dev/null &&
  step torch_compare 90 env PYTHONUNBUFFERED=1 python3 bench/torch_compare.py --tensors 100,200,1000
fi

echo
echo "== summary (full logs in \$OUT)"
printf '%s\n' "${summary[@]}"
