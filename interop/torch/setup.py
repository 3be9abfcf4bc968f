"""Builds mpx_torch, the PyTorch extension over mpx's unscale-and-check and fused Adam.

    pip install --no-build-isolation interop/torch        # into the current environment
    python3 interop/torch/setup.py build_py --build-lib DIR build_ext --build-lib DIR --build-temp TMP

The extension is one translation unit. MPX_TORCH_CUDA chooses the executor(s) it is
built for: 'auto' (the default) builds the CUDA path when nvcc is found, PyTorch was built
with CUDA and sees a GPU; '1' builds it anyway (a compile check on a machine without a
GPU); '0' builds for the CPU only. MPX_CUDA (default /usr/local/cuda) is the toolkit whose
headers mpx needs in either case; TORCH_CUDA_ARCH_LIST picks the GPU architectures as
usual. CXX=/usr/lib/ccache/g++ and PYTORCH_NVCC="ccache nvcc" reuse earlier compiles.
"""

import os
import shutil
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

here = Path(__file__).resolve().parent
root = here.parent.parent
cuda_home = Path(os.environ.get("MPX_CUDA", "/usr/local/cuda"))
if not (cuda_home / "include" / "cuda_fp16.h").exists():
    sys.exit(f"mpx_torch: mpx needs the CUDA toolkit's headers; none under {cuda_home} (set MPX_CUDA)")


def want_cuda():
    choice = os.environ.get("MPX_TORCH_CUDA", "auto")
    if choice not in ("auto", "0", "1"):
        sys.exit(f"mpx_torch: MPX_TORCH_CUDA must be auto, 0 or 1, not '{choice}'")
    if choice == "0":
        return False
    nvcc = shutil.which("nvcc") or (cuda_home / "bin" / "nvcc").exists()
    possible = bool(nvcc) and torch.version.cuda is not None
    if choice == "1" and not possible:
        sys.exit("mpx_torch: MPX_TORCH_CUDA=1 needs nvcc and a PyTorch built with CUDA")
    return possible and (choice == "1" or torch.cuda.is_available())


include_dirs = [str(root / "include"), str(cuda_home / "include" / "cccl"), str(cuda_home / "include")]
cxx_flags = ["-std=c++20", "-O2", "-g0"]  # -g0: Python's own flags ask for -g, which doubles the compile time
if want_cuda():
    os.environ.setdefault("CUDA_HOME", str(cuda_home))
    # PyTorch adds -D__CUDA_NO_HALF_CONVERSIONS__ and friends for its own kernels; mpx's
    # types use CUDA's half and bfloat16 conversions as CUDA ships them.
    # 3189: PyTorch's headers name a variable "module", which C++20 nvcc notes each time.
    nvcc_flags = ["-std=c++20", "-O2", "-lineinfo", "-diag-suppress=3189",
                  "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
    extension = CUDAExtension("mpx_torch._C", ["csrc/mpx_torch.cu"], include_dirs=include_dirs,
                              extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags})
else:
    extension = CppExtension("mpx_torch._C", ["csrc/mpx_torch_host.cpp"], include_dirs=include_dirs,
                             extra_compile_args={"cxx": cxx_flags})

os.chdir(here)  # setuptools wants source paths relative to setup.py
setup(
    name="mpx_torch",
    version="0.1.0",
    description="mpx's multi-tensor unscale-and-check and fused Adam/AdamW for PyTorch tensors",
    packages=["mpx_torch"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
)
