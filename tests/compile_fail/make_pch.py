#!/usr/bin/env python3
"""Precompiles <mpx/mpx.hpp> for the compile-failure snippets.

usage: make_pch.py OUT_DIR STAMP DEPFILE -- COMPILER [ARGS...]
Writes OUT_DIR/mpx/mpx.hpp.gch with exactly the snippets' flags, so each snippet that
includes <mpx/mpx.hpp> first (with -I OUT_DIR ahead of the real include directory)
reads the header's parse instead of redoing it, then touches STAMP; DEPFILE lists every
header it read, so a header's edit makes it again. GCC ignores a header it cannot use
(other flags, another compiler) and parses the real one, so the snippets' verdicts do
not depend on it; only their time does.
"""
import os
import subprocess
import sys


def main() -> int:
    split = sys.argv.index("--")
    out_dir, stamp, depfile = sys.argv[1:split]
    compiler = sys.argv[split + 1:]
    include = next(a[2:] for a in compiler if a.startswith("-I"))
    os.makedirs(os.path.join(out_dir, "mpx"), exist_ok=True)
    gch = os.path.join(out_dir, "mpx", "mpx.hpp.gch")
    result = subprocess.run(compiler + ["-x", "c++-header", os.path.join(include, "mpx", "mpx.hpp"), "-o", gch,
                                        "-MD", "-MF", depfile, "-MT", stamp, "-w"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stdout + result.stderr[-4000:])
        return 1
    with open(stamp, "w", encoding="utf-8") as f:
        f.write("")
    return 0


if __name__ == "__main__":
    sys.exit(main())
