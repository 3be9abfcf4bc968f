#!/usr/bin/env python3
"""scripts/plot_run.py on the logs of a real run, and on bad logs.

    test_plot_run.py FASHION_MNIST_EXE PLOT_RUN_PY

1. fashion_mnist --policy all --shadow 3 --plot on a slice of the data (a few seconds on
   the host): three CSV logs next to the PNG, with the shadow's error columns, and a PNG
   of sane size that holds each policy's colour (matplotlib's first three) in its lines
   and the fourth panel of the layers' errors (a log without those columns has three);
2. one log with two steps marked skipped: the plot has the red skip marks, and a plot
   of the unmarked log has none;
3. a missing file, an empty one, a header without mpx::fit's columns and a row with a
   word for a number: each exits 1 with a message naming the file (and the line).
Exits 77 (skipped) when matplotlib cannot be imported.
"""
import os
import struct
import subprocess
import sys
import tempfile

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return struct.unpack(">II", head[16:24])


def colours_present(path, rgbs, tolerance=0.06):
    """For each colour, whether some pixels of the PNG are that colour (lines, not the faint raw ones)."""
    import numpy as np
    import matplotlib.image
    pixels = matplotlib.image.imread(path)[..., :3].reshape(-1, 3)
    return [int((np.abs(pixels - np.array(rgb)).max(axis=1) < tolerance).sum()) for rgb in rgbs]


def main(exe, script):
    try:
        import matplotlib  # noqa: F401
        import matplotlib.colors
    except ImportError:
        print("matplotlib is not importable: skipped")
        return 77
    cycle = ["#1f77b4", "#ff7f0e", "#2ca02c"]  # matplotlib's default first three colours
    red = matplotlib.colors.to_rgb("red")

    with tempfile.TemporaryDirectory(prefix="mpx_plot_run_") as tmp:
        png = os.path.join(tmp, "run.png")
        run = subprocess.run([exe, "--policy", "all", "--train-limit", "640", "--test-limit", "200",
                              "--epochs", "1", "--executor", "host", "--shadow", "3", "--plot", png],
                             capture_output=True, text=True, timeout=240)
        print(run.stdout[-1500:], run.stderr[-1500:])
        check(run.returncode == 0, "fashion_mnist --plot exits 0")
        logs = [os.path.join(tmp, f"run.{p}.csv") for p in ("mixed_float16", "mixed_bfloat16", "float32")]
        check(all(os.path.exists(p) for p in logs), "the three CSV logs are next to the PNG")
        check(os.path.exists(png), "the PNG was written")
        if not os.path.exists(png) or not all(os.path.exists(p) for p in logs):
            return 1
        size = png_size(png)
        check(size is not None and size[0] >= 600 and size[1] >= 1100, f"a PNG of sane dimensions, four panels: {size}")
        check(20_000 < os.path.getsize(png) < 5_000_000, f"a PNG of sane size: {os.path.getsize(png)} bytes")
        found = colours_present(png, [matplotlib.colors.to_rgb(c) for c in cycle])
        check(all(n > 200 for n in found), f"one colour per policy, each drawn: pixels {found}")
        with open(logs[0]) as f:
            rows = f.read().splitlines()
        check(len(rows) == 1 + 10, f"the mixed_float16 log has a row per step: {len(rows) - 1} of 10")
        header = rows[0].split(",")
        check("error/conv2d/output" in header and "error/dense_1/weight_gradient" in header,
              f"the log has the shadow's columns: {header[8:11]}")
        measured = [r for r in rows[1:] if r.split(",")[header.index("error/conv2d/output")]]
        check(len(measured) == 3, f"the shadow's cells are filled on steps 3, 6 and 9: {len(measured)} rows")

        # Without the shadow's columns, three panels.
        plain = os.path.join(tmp, "plain.csv")
        with open(plain, "w") as f:
            f.write("\n".join(",".join(r.split(",")[:8]) for r in rows) + "\n")
        plain_png = os.path.join(tmp, "plain.png")
        r = subprocess.run([sys.executable, script, plain, "-o", plain_png], capture_output=True, text=True)
        plain_size = png_size(plain_png) if os.path.exists(plain_png) else None
        check(r.returncode == 0 and plain_size is not None and plain_size[1] < 1000,
              f"a log without the shadow's columns draws three panels: {plain_size} {r.stderr}")

        # Two steps skipped, as a step with an inf gradient records them.
        marked = os.path.join(tmp, "marked.csv")
        lines = list(rows)
        for i in (3, 7):
            fields = lines[i].split(",")
            fields[2], fields[4] = "inf", "1"
            lines[i] = ",".join(fields)
        with open(marked, "w") as f:
            f.write("\n".join(lines) + "\n")
        for source, expect_red in ((marked, True), (logs[0], False)):
            out = os.path.join(tmp, os.path.basename(source) + ".png")
            r = subprocess.run([sys.executable, script, source, "-o", out, "--label", "a run"],
                               capture_output=True, text=True)
            check(r.returncode == 0 and os.path.exists(out), f"plot_run.py draws {os.path.basename(source)}: {r.stderr}")
            if os.path.exists(out):
                n = colours_present(out, [red])[0]
                check((n > 20) == expect_red, f"red skip marks {'present' if expect_red else 'absent'}: {n} red pixels")

        # Bad logs: a clear message naming the file, exit status 1, no PNG.
        bad = {
            "missing.csv": None,
            "empty.csv": "",
            "other.csv": "time,value\n1,2\n",
            "word.csv": "\n".join(rows[:2] + [",".join(rows[2].split(",")[:2] + ["abc"] + rows[2].split(",")[3:])]) + "\n",
            "header_only.csv": rows[0] + "\n",
        }
        expected = {"missing.csv": "no such file", "empty.csv": "empty", "other.csv": "no column epoch, step",
                    "word.csv": "word.csv:3: loss is not a number: 'abc'", "header_only.csv": "no steps"}
        for name, text in bad.items():
            path = os.path.join(tmp, name)
            if text is not None:
                with open(path, "w") as f:
                    f.write(text)
            out = os.path.join(tmp, name + ".png")
            r = subprocess.run([sys.executable, script, logs[0], path, "-o", out], capture_output=True, text=True)
            check(r.returncode == 1 and path in r.stderr and expected[name] in r.stderr and not os.path.exists(out),
                  f"{name} refused: exit {r.returncode}, {r.stderr.strip()!r}")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
