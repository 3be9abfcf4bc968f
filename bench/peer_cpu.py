#!/usr/bin/env python3
"""mpx's host executor beside PyTorch on the CPU: the same models, data and batches.

Two pieces of work, each in float32 and in bfloat16:
  cnn      the main example's CNN (examples/fashion_mnist: conv 32 3x3 relu, max pool 2,
           conv 64 3x3 relu, max pool 2, dense 128 relu, dense 10, float32 softmax),
           Adam(1e-3), batch 64, one epoch over the first --images training images;
           seconds per epoch (mpx's own figure; PyTorch's timed the same way, the
           --test-images evaluation included). bfloat16: mpx's mixed_bfloat16 policy,
           PyTorch's autocast to bfloat16.
  char_lm  examples/char_lm's default model (4 pre-norm blocks, width 128, 4 heads,
           batch 16 x 64 tokens), AdamW(3e-3), --steps steps from a cold start; tokens
           per second of training (mpx's own figure; PyTorch's timed the same way).
           bfloat16: mpx's mixed_bfloat16, PyTorch's autocast.

Each round runs every (work, dtype) pair once in mpx and once in PyTorch, alternating
which goes first, each a fresh process with --threads threads (OPENBLAS_NUM_THREADS for
mpx, torch.set_num_threads for PyTorch). After --rounds rounds it prints the medians and
mpx's ratio: time over PyTorch's time for the CNN (lower is better), tokens per second
over PyTorch's for char_lm (higher is better).

  python3 bench/peer_cpu.py [--rounds 3] [--threads 2] [--build build] [--work cnn,char_lm]
                            [--dtypes float32,bfloat16] [--images 6000] [--steps 40]

Without PyTorch it says so and exits 0. The examples must be built (the README's setup).
"""

import argparse
import gzip
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MPX_POLICY = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return shape, data[4 + 4 * dims :]


def torch_cnn(args, dtype):
    """Seconds for one epoch of the CNN in PyTorch (plus the test images' evaluation)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)

    def load(prefix, limit):
        shape, pixels = read_idx(os.path.join(args.data, prefix + "-images-idx3-ubyte.gz"))
        _, labels = read_idx(os.path.join(args.data, prefix + "-labels-idx1-ubyte.gz"))
        n = min(limit, shape[0])
        x = torch.frombuffer(bytearray(pixels[: n * 784]), dtype=torch.uint8).float().div_(255).view(n, 1, 28, 28)
        y = torch.frombuffer(bytearray(labels[:n]), dtype=torch.uint8).long()
        return x, y

    x, y = load("train", args.images)
    tx, ty = load("t10k", args.test_images)
    model = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    start = time.perf_counter()
    order = torch.randperm(x.shape[0])
    for i in range(0, x.shape[0], 64):
        idx = order[i : i + 64]
        with autocast:
            logits = model(x[idx])
        loss = F.cross_entropy(logits.float(), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad(), autocast:
        for i in range(0, tx.shape[0], 500):
            F.cross_entropy(model(tx[i : i + 500]).float(), ty[i : i + 500])
    return time.perf_counter() - start


def torch_char_lm(args, dtype):
    """Tokens per second of char_lm's training steps in PyTorch."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, HERE)
    import torch_char_lm as lm

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    L, B = 64, 16
    corpus = lm.read_corpus(args.corpus)
    train = corpus[: len(corpus) - max(1, int(0.1 * len(corpus) + 0.5))]
    text = torch.tensor(list(train), dtype=torch.long)
    windows = (len(train) - L - 1) // (L // 2) + 1
    order = lm.shuffled_order(windows, 1, 0, min(windows, args.steps * B))
    model = lm.model_class(torch, 128, 4, L, 4)()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    start = time.perf_counter()
    tokens = 0
    for step in range(args.steps):
        starts = torch.tensor([w * (L // 2) for w in order[step * B : (step + 1) * B]])
        chunk = text[starts[:, None] + torch.arange(L + 1)[None, :]]
        with autocast:
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens += B * L
    return tokens / (time.perf_counter() - start)


def mpx_run(args, work, dtype):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    policy = MPX_POLICY[dtype]
    if work == "cnn":
        cmd = [os.path.join(args.build, "examples", "fashion_mnist"), "--policy", policy, "--epochs", "1",
               "--train-limit", str(args.images), "--test-limit", str(args.test_images), "--executor", "host",
               "--data", args.data]
    else:
        cmd = [os.path.join(args.build, "examples", "char_lm"), "--policy", policy, "--steps", str(args.steps),
               "--corpus", args.corpus]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"peer_cpu.py: {' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    # The summary table's row for the policy: its third column (cnn: after ranks) or
    # the column after the validation loss (char_lm).
    for line in out.stdout.splitlines():
        fields = line.split()
        if fields and fields[0] == policy and len(fields) > 3 and re.fullmatch(r"[0-9.]+", fields[2]):
            return float(fields[2])
    sys.exit(f"peer_cpu.py: no {policy} row in the output of {' '.join(cmd)}")


def torch_run(args, work, dtype):
    cmd = [sys.executable, os.path.abspath(__file__), "--only-torch", work, dtype, "--threads", str(args.threads),
           "--images", str(args.images), "--test-images", str(args.test_images), "--steps", str(args.steps),
           "--data", args.data, "--corpus", args.corpus]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"peer_cpu.py: the PyTorch run failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    return float(out.stdout.split()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    parser.add_argument("--work", default="cnn,char_lm")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--test-images", type=int, default=500)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--corpus", default="/usr/share/games/fortunes")
    parser.add_argument("--only-torch", nargs=2, metavar=("WORK", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("peer_cpu.py: PyTorch is not installed (scripts/setup_torch.sh installs it); nothing to compare")
        return 0
    if args.only_torch:
        work, dtype = args.only_torch
        print((torch_cnn if work == "cnn" else torch_char_lm)(args, dtype))
        return 0
    for name in ("rounds", "threads", "images", "test_images", "steps"):
        if getattr(args, name) < 1:
            sys.exit(f"peer_cpu.py: --{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    works = args.work.split(",")
    dtypes = args.dtypes.split(",")
    for w in works:
        if w not in ("cnn", "char_lm"):
            sys.exit(f"peer_cpu.py: --work takes cnn and char_lm, not {w}")
    for d in dtypes:
        if d not in MPX_POLICY:
            sys.exit(f"peer_cpu.py: --dtypes takes float32 and bfloat16, not {d}")
    results = {}
    for r in range(args.rounds):
        for w in works:
            for d in dtypes:
                sides = [("mpx", mpx_run), ("torch", torch_run)]
                if r % 2:
                    sides.reverse()
                for name, run in sides:
                    v = run(args, w, d)
                    results.setdefault((w, d, name), []).append(v)
                    print(f"round {r + 1}: {w:8s} {d:9s} {name:6s} {v:10.2f}", flush=True)
    print(f"\nmedians of {args.rounds} rounds, {args.threads} threads each, PyTorch {torch.__version__}")
    print(f"{'work':8s} {'dtype':9s} {'unit':9s} {'mpx':>10s} {'PyTorch':>10s}  mpx's ratio")
    for w in works:
        unit = "s/epoch" if w == "cnn" else "tokens/s"
        for d in dtypes:
            m = statistics.median(results[(w, d, "mpx")])
            t = statistics.median(results[(w, d, "torch")])
            what = "time / PyTorch's (lower is better)" if w == "cnn" else "speed / PyTorch's (higher is better)"
            print(f"{w:8s} {d:9s} {unit:9s} {m:10.2f} {t:10.2f}  {m / t:.2f}x  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
