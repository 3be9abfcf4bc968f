"""A rank that hangs or dies must make the job stop soon, with a message naming the rank
(and, for a hang, the collective), never hang forever. Runs tests/dist/failure_drill.cpp
under mpirun with 2 and 3 ranks.  usage: failure_drills.py MPIRUN DRILL"""
import os
import subprocess
import sys
import time

mpirun, drill = sys.argv[1], sys.argv[2]
docs_page = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "data_parallel.md")
failures = 0


def run(ranks, mode):
    start = time.monotonic()
    p = subprocess.run([mpirun, "-np", str(ranks), drill, mode], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - start


def expect(ok, what, output):
    global failures
    if not ok:
        failures += 1
        print(f"FAILED: {what}\n--- output ---\n{output}\n---")
    else:
        print(f"ok: {what}")


for ranks in (2, 3):
    last = ranks - 1
    code, out, seconds = run(ranks, "ok")
    expect(code == 0 and out.count(f"sum {ranks * ranks}") == ranks, f"{ranks} ranks, nobody fails: every rank finishes", out)

    code, out, seconds = run(ranks, "hang")
    expect(code != 0, f"{ranks} ranks, rank {last} hangs: the job fails", out)
    expect(seconds < 30, f"{ranks} ranks, rank {last} hangs: stopped in {seconds:.1f} s (< 30 s; the sleeper sleeps 60 s)", out)
    expect(f"rank {last} did not reach it" in out and "all_reduce (sum of 1000 float32) #2" in out,
           f"{ranks} ranks, rank {last} hangs: the message names rank {last} and the collective", out)
    if ranks == 3:  # docs/data_parallel.md quotes rank 0's message of this drill word for word
        quoted = [line.strip() for line in open(docs_page, encoding="utf-8") if "did not reach it (hung" in line]
        expect(len(quoted) == 1 and quoted[0] in out,
               "docs/data_parallel.md quotes the hang message the drill prints", out + "\nquoted: " + repr(quoted))

    code, out, seconds = run(ranks, "die")
    expect(code != 0, f"{ranks} ranks, rank {last} dies: the job fails", out)
    expect(seconds < 30, f"{ranks} ranks, rank {last} dies: stopped in {seconds:.1f} s", out)
    expect(f"rank {last}" in out, f"{ranks} ranks, rank {last} dies: the message names rank {last}", out)

sys.exit(1 if failures else 0)
