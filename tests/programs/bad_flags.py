#!/usr/bin/env python3
"""Drives mpx's programs (the examples and the benchmarks) with bad command lines.

usage: bad_flags.py PROGRAM...
Each program, known here by its file name, gets a table of bad flags: negative numbers,
trailing junk, overflow, zero where a flag needs at least 1, a word for a choice, a
missing value, an unknown flag, a stray argument. Each run must exit with a status
other than 0, not by a signal, and print exactly one line that names the flag, and never
'terminate'. Every flag is refused before any data is read, so the runs take
milliseconds. --help must exit 0 with the usage.
"""
import os
import subprocess
import sys

# Per program: flags taking a whole number >= 1, whole numbers where 0 is allowed
# (seeds), comma-separated lists of whole numbers >= 1, numbers > 0, choices, and
# further bad command lines with the flag their message must name.
PROGRAMS = {
    "fashion_mnist": {
        "whole": ["--epochs", "--batch-size", "--train-limit", "--test-limit"],
        "seed": ["--seed"],
        "choice": ["--policy", "--executor"],
        "text": ["--data", "--csv", "--plot"],
        "more": [(["--epochs", "1001"], "--epochs"), (["--train-limit", "60001"], "--train-limit")],
    },
    "char_lm": {
        "whole": ["--steps", "--batch", "--context", "--width", "--heads", "--sample", "--log-every", "--eval-batches"],
        "seed": ["--seed"],
        "real": ["--lr"],
        "choice": ["--policy", "--executor"],
        "text": ["--corpus"],
        "more": [(["--context", "100000", "--steps", "1"], "--context"), (["--width", "30", "--heads", "4"], "--width")],
    },
    "binary_classifier": {
        "whole": ["--steps"],
        "seed": ["--seed"],
        "real": ["--init-scale", "--learning-rate"],
        "choice": ["--executor"],
    },
    "custom_training_loop": {"whole": ["--steps"], "choice": ["--executor"]},
    "lstm_sequences": {
        "whole": ["--samples", "--epochs"],
        "choice": ["--executor"],
        "more": [(["--samples", "7"], "--samples")],
    },
    "overflow_underflow": {"whole": ["--size"], "choice": ["--executor"]},
    "unstable_division": {"choice": ["--executor"]},
    "user_kernel": {"whole": ["--size"], "real": ["--scale"], "choice": ["--executor"]},
    "activation_bench": {
        "whole": ["--rows", "--cols", "--repeat"],
        "choice": ["--executor"],
        "more": [(["--cols", "999"], "--cols")],
    },
    "gemm_bench": {"whole": ["--repeat", "--max-square"], "choice": ["--executor", "--shapes"]},
    "layer_bench": {
        "whole": ["--repeat", "--rows", "--cols"],
        "list": ["--lstm-steps", "--lstm-units"],
        "choice": ["--executor"],
        "text": ["--only"],
        "more": [(["--only", "norm,bogus"], "--only"), (["--only", ""], "--only")],
    },
    "numerics_bench": {"whole": ["--elements", "--repeat"], "choice": ["--executor"]},
    "transformer_bench": {
        "whole": ["--repeat"],
        "list": ["--tokens"],
        "real": ["--dropout"],
        "choice": ["--executor", "--path"],
        "more": [(["--dropout", "0.95"], "--dropout")],
    },
    "scaling_bench": {
        "whole": ["--elements", "--repeat"],
        "list": ["--tensors"],
        "choice": ["--executor"],
        "more": [(["--elements", "4", "--tensors", "5"], "--tensors")],
    },
}

OVERFLOW = "99999999999999999999"


def cases(spec):
    """(arguments, the text the one line must contain) for a program's table."""
    out = []
    for flag in spec.get("whole", []) + spec.get("seed", []):
        out += [([flag, v], flag) for v in ["-1", "-5", "12x", " 12", "+", "", OVERFLOW, "1e3"]]
        if flag in spec.get("whole", []):
            out.append(([flag, "0"], flag))
    for flag in spec.get("list", []):
        out += [([flag, v], flag) for v in ["-1", "4,", ",4", "4,x", "4,-2", "0", OVERFLOW, ""]]
    for flag in spec.get("real", []):
        out += [([flag, v], flag) for v in ["-1", "0", "1x", "nan", "inf", "1e400", ""]]
    for flag in spec.get("choice", []):
        out += [([flag, v], flag) for v in ["bogus", ""]]
    for flag in spec.get("whole", []) + spec.get("seed", []) + spec.get("list", []) + spec.get("real", []) + \
            spec.get("choice", []) + spec.get("text", []):
        out.append(([flag], flag))  # the value is missing
    out += spec.get("more", [])
    out += [(["--no-such-flag"], "--no-such-flag"), (["stray"], "stray"), (["-x"], "-x")]
    return out


def main() -> int:
    failures = []
    runs = 0
    for path in sys.argv[1:]:
        name = os.path.basename(path)
        if name not in PROGRAMS:
            failures.append(f"{name}: no table of bad flags here: add one to {__file__}")
            continue
        for args, flag in cases(PROGRAMS[name]):
            runs += 1
            shown = " ".join(repr(a) if a == "" or " " in a else a for a in args)
            try:
                r = subprocess.run([path] + args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                failures.append(f"{name} {shown}: still running after 60 s (it should be refused at once)")
                continue
            output = r.stdout + r.stderr
            lines = [line for line in output.splitlines() if line.strip()]
            problems = []
            if r.returncode == 0:
                problems.append("exit status 0")
            elif r.returncode < 0:
                problems.append(f"killed by signal {-r.returncode}")
            if len(lines) != 1:
                problems.append(f"{len(lines)} lines of output, not 1")
            elif flag not in lines[0]:
                problems.append(f"the line does not name {flag}")
            if "terminate" in output:
                problems.append("'terminate' in the output")
            if problems:
                failures.append(f"{name} {shown}: {'; '.join(problems)}\n    output: {output[-600:]!r}")
        r = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        if r.returncode != 0 or "usage:" not in r.stdout:
            failures.append(f"{name} --help: exit status {r.returncode}, output {r.stdout[-300:]!r}")
    for f in failures:
        print(f)
    print(f"{runs} bad command lines over {len(sys.argv) - 1} programs; {len(failures)} failure(s)")
    return 1 if failures or len(sys.argv) < 2 else 0


if __name__ == "__main__":
    sys.exit(main())
