#!/usr/bin/env python3
"""Compiles a .cu file with ptxas's resource report and checks that every kernel whose
name matches PATTERN has a stack frame under MAX_BYTES: a kernel that copied a large
parameter (a multi-tensor table of 32 KB) into local memory, as taking its address
where the compiler cannot see through may make it do, shows a frame of that size. At
least one kernel must match, so the check cannot pass on an empty report. No GPU needed.

check_stack_frames.py NVCC SOURCE PATTERN MAX_BYTES NVCC_ARGS..."""
import re
import subprocess
import sys
import tempfile

nvcc, source, pattern, limit, args = sys.argv[1], sys.argv[2], re.compile(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
with tempfile.NamedTemporaryFile(suffix=".o") as obj:
    run = subprocess.run([nvcc, "-std=c++20", "-c", source, "-o", obj.name, "-Xptxas", "-v"] + args,
                         capture_output=True, text=True)
if run.returncode != 0:
    sys.exit(run.stdout + run.stderr)
report = run.stdout + run.stderr
# ptxas says, per entry: "Compiling entry function 'NAME'", then (for the same function)
# "Function properties for NAME" and "N bytes stack frame, ...".
frames = re.findall(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame", report)
matched = [(name, int(bytes_)) for name, bytes_ in frames if pattern.search(name)]
for name, bytes_ in matched:
    print(f"{bytes_:6d} bytes stack frame  {name}")
if not matched:
    sys.exit(f"no kernel matching {pattern.pattern} in ptxas's report:\n{report}")
if any(bytes_ >= limit for _, bytes_ in matched):
    sys.exit(f"a kernel's stack frame reaches {limit} bytes: it keeps something in local memory (a parameter "
             "whose address was taken, such as its tensor table, or an array indexed at run time)")
