#!/usr/bin/env bash
# Builds mpx's PyTorch extension (interop/torch) and runs its tests on CPU tensors:
#  1. installs torch, numpy and pytest when missing (scripts/setup_torch.sh);
#  2. builds the extension for the CPU into build-torch/ (one translation unit, g++
#     through ccache);
#  3. where nvcc is present, compiles the CUDA build too, for sm_90, into
#     build-torch-cuda/: it cannot run without a GPU, but it must compile
#     (MPX_TORCH_CUDA_CHECK=0 skips it);
#  4. runs tests/torch with pytest (arguments are passed on to pytest).
# Prints how long each part took.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source scripts/build_env.sh

start=$SECONDS
scripts/setup_torch.sh
echo "torch: $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null) ($((SECONDS - start)) s to check or install)"

cxx=g++
[ -x /usr/lib/ccache/g++ ] && cxx=/usr/lib/ccache/g++  # ccache under the name torch expects
build() {  # build DIR [ENV...]: builds the extension into DIR/lib
  local dir=$1 log
  shift
  log=$(mktemp)
  if ! (cd interop/torch && env MAX_JOBS=2 CXX="$cxx" "$@" python3 setup.py -q build_py --build-lib "$root/$dir/lib" \
          build_ext --build-lib "$root/$dir/lib" --build-temp "$root/$dir/temp") >"$log" 2>&1; then
    grep -v '^W[0-9]' "$log" | tail -60
    echo "run.sh: building the extension into $dir failed" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

start=$SECONDS
build build-torch MPX_TORCH_CUDA=0
echo "extension (CPU): built in $((SECONDS - start)) s"

cuda=${MPX_CUDA:-/usr/local/cuda}
if [ "${MPX_TORCH_CUDA_CHECK:-1}" != 0 ] && [ -x "$cuda/bin/nvcc" ] &&
   python3 -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
  start=$SECONDS
  build build-torch-cuda MPX_TORCH_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 PYTORCH_NVCC="ccache $cuda/bin/nvcc"
  echo "extension (CUDA, sm_90): compiled in $((SECONDS - start)) s (not run: the tests use CPU tensors)"
fi

PYTHONPATH="$root/build-torch/lib${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider tests/torch "$@"

# bench/torch_attention.py's and torch_gpt2.py's GPU rows sit beside transformer_bench's
# and char_lm's on a GPU machine; here, CPU smokes that they still run against this PyTorch.
python3 bench/torch_attention.py --device cpu --repeat 1 > /dev/null
echo "bench/torch_attention.py: runs (CPU smoke)"
python3 bench/torch_gpt2.py --device cpu --small > /dev/null
echo "bench/torch_gpt2.py: runs (CPU smoke)"
