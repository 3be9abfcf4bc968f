#!/usr/bin/env python3
"""Compiles a snippet that must not compile and checks the compiler's message.

usage: check.py SNIPPET -- COMPILER [ARGS...]
The snippet's first line is `// expect: TEXT`; the compile must fail and its output
must contain TEXT. A snippet that compiles, or fails for another reason, fails the test.
"""
import subprocess
import sys


def main() -> int:
    split = sys.argv.index("--")
    snippet = sys.argv[1]
    compiler = sys.argv[split + 1:]
    with open(snippet, encoding="utf-8") as f:
        first = f.readline().strip()
    prefix = "// expect: "
    if not first.startswith(prefix):
        print(f"{snippet}: first line must be '{prefix}<message>'")
        return 1
    expected = first[len(prefix):]
    result = subprocess.run(compiler + ["-fsyntax-only", snippet], capture_output=True, text=True)
    output = result.stdout + result.stderr
    if result.returncode == 0:
        print(f"{snippet} compiled, but it must be refused with: {expected}")
        return 1
    if expected not in output:
        print(f"{snippet} was refused, but without the message: {expected}\n--- compiler said:\n{output[-4000:]}")
        return 1
    print(f"{snippet}: refused with '{expected}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
