#!/usr/bin/env python3
"""The structure figures bench/NOTES.md tracks for "one math, two executors":
lines of include/ under `#if MPX_HAS_CUDA` (and MPX_HAS_CUDA_RUNTIME), `if constexpr`
branches on is_host_executor_v outside exec/, and __global__ kernels outside kernels/
and exec/. Run from the checkout: bench/dispatch_metrics.py [ROOT]."""
import glob
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "."
headers = sorted(glob.glob(root + "/include/**/*.hpp", recursive=True))


def lines_under(is_cuda_condition):
    total = 0
    for path in headers:
        stack = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                s = line.strip()
                if re.match(r"#\s*if", s):
                    stack.append(bool(is_cuda_condition(s)))
                elif re.match(r"#\s*endif", s):
                    stack.pop()
                elif re.match(r"#\s*el", s):
                    if stack:
                        stack[-1] = False
                elif any(stack):
                    total += 1
    return total


def count(pattern, skip):
    n = 0
    for path in headers:
        if any(f"/{folder}/" in path for folder in skip):
            continue
        with open(path, encoding="utf-8") as f:
            n += sum(1 for line in f if re.search(pattern, line) and not line.strip().startswith("//"))
    return n


negated = re.compile(r"!\s*MPX_HAS_CUDA")
print("lines under #if MPX_HAS_CUDA or MPX_HAS_CUDA_RUNTIME:",
      lines_under(lambda s: "MPX_HAS_CUDA" in s and not negated.search(s)))
print("lines under #if MPX_HAS_CUDA (kernels only):",
      lines_under(lambda s: re.search(r"MPX_HAS_CUDA\b(?!_)", s) and not negated.search(s)))
print("if constexpr on is_host_executor_v outside exec/:", count(r"if constexpr.*is_host_executor_v", ["exec"]))
print("__global__ outside kernels/ and exec/:", count(r"__global__", ["kernels", "exec"]))
