#!/usr/bin/env python3
"""A build tree serves pkg-config users: with PKG_CONFIG_PATH at its meson-uninstalled/
folder, `pkg-config --cflags --libs mpx` (which picks mpx-uninstalled.pc) gives what a
program that includes <mpx/mpx.hpp> needs to compile, link and run.

check_pkg_config.py BUILD_ROOT COMPILER..."""
import os
import subprocess
import sys
import tempfile

PROGRAM = r"""
#include <mpx/mpx.hpp>
#include <cstdio>
int main() {
  mpx::host_executor exec;
  auto x = mpx::make_tensor<mpx::half>(exec, {1000});
  mpx::fill(exec, x, mpx::cast<mpx::half>(1e-8f));  // below float16's smallest normal: stored subnormal or 0
  std::printf("%zu of 1000 finite\n", mpx::stats(exec, x).size - mpx::count_nonfinite(exec, x));
  return mpx::all_finite(exec, x) ? 0 : 1;
}
"""


def main():
    build_root, compiler = sys.argv[1], sys.argv[2:]
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(build_root, "meson-uninstalled"))
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "mpx"], env=env, check=True,
                           capture_output=True, text=True).stdout.split()
    print("pkg-config --cflags --libs mpx:", " ".join(flags))
    with tempfile.TemporaryDirectory() as work:
        source, program = os.path.join(work, "uses_mpx.cpp"), os.path.join(work, "uses_mpx")
        with open(source, "w") as f:
            f.write(PROGRAM)
        built = subprocess.run(compiler + ["-std=c++20", source, "-o", program] + flags, capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit("compiling with the flags mpx-uninstalled.pc gives failed:\n" + built.stderr[-3000:])
        ran = subprocess.run([program], capture_output=True, text=True)
        print(ran.stdout, end="")
        if ran.returncode != 0 or "1000 of 1000 finite" not in ran.stdout:
            sys.exit("the program built through pkg-config did not run as expected (exit %d)" % ran.returncode)


main()
