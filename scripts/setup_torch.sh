#!/usr/bin/env bash
# Installs what the PyTorch extension (interop/torch) and its tests need, from PyPI:
# torch (with the CUDA libraries its PyPI wheel depends on, about 4 GB; about 70 s on a
# fast link), numpy (which torch warns about when missing), pytest. Does nothing when
# they already import. Kept out of scripts/setup.sh so the README's test command does
# not wait for PyTorch. MPX_TORCH_VERSION overrides the pinned version.
set -euo pipefail
python=${PYTHON:-python3}
torch_version=${MPX_TORCH_VERSION:-2.15.0}
if "$python" -c 'import torch, numpy, pytest' >/dev/null 2>&1; then
  exit 0
fi
command -v g++ >/dev/null || { echo "setup_torch.sh: g++ is missing; run scripts/setup.sh first" >&2; exit 1; }
start=$SECONDS
"$python" -m pip install --quiet --no-input --root-user-action=ignore "torch==$torch_version" numpy pytest
echo "setup_torch.sh: installed torch $torch_version, numpy and pytest in $((SECONDS - start)) s"
