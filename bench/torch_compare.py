#!/usr/bin/env python3
"""PyTorch's counterparts of scaling_bench's CUDA rows, timed the same way.

Over the same lists (K tensors of the same seeded uneven sizes, N elements in all; half,
bfloat16 and float) it times, with CUDA events on the current stream, the median of
--repeat runs after a warm-up:

  * torch._amp_foreach_non_finite_check_and_unscale_ (GradScaler's multi-tensor check:
    in place, read + write, 2 * sizeof(T) bytes per element), against mpx's in-place
    unscale_and_check;
  * torch._foreach_norm, a read-only multi-tensor pass (sizeof(T) bytes per element),
    the nearest PyTorch op to mpx's deferred check (which also only reads, and also
    computes per-tensor norms); PyTorch has no read-only finiteness check;
  * torch.optim.Adam(fused=True).step() on parameters of dtype T. PyTorch keeps no
    float master weights: its 16-bit Adam keeps its moments in T too and moves
    7 * sizeof(T) = 14 bytes per element, half of mpx's 28, so for 16-bit T compare
    GB/s, not time. Fused Adam on float32 parameters moves exactly what mpx's
    master-weight Adam moves for any T (28 bytes: read weight, gradient, m, v; write
    weight, m, v, all float but the 16-bit gradient and value): that float32 row is the
    apples-to-apples comparison of time.
  * the check and the fused step back to back (GradScaler.unscale_ then step).
  * the same three through mpx's PyTorch extension (interop/torch, built with CUDA:
    tests/torch/run.sh leaves it in build-torch-cuda/lib, or pip install it), on the
    same tensors and stream: mpx_torch.non_finite_check_and_unscale_ (2 * sizeof(T)
    bytes per element) and mpx_torch.Adam's step with float32 master weights (28 bytes
    per element for every T). Without the extension those rows are left out, and a line
    says why.

GB/s counts every byte read plus every byte written, once; the copy (a device-to-device
copy of N float32 values) counts its read and its write, 8 bytes per element, as
scaling_bench does. Without PyTorch or without a GPU this says so and exits 0.

  python3 bench/torch_compare.py [--elements N] [--tensors K[,K...]] [--repeat R]
"""

import argparse
import struct
import sys
from pathlib import Path

MASK64 = (1 << 64) - 1
CHUNK = 16384  # mpx::detail::multi_tensor_chunk, for the description line only


def f32(x):
    """x rounded to float32, as the C++ float arithmetic of scaling_bench rounds it."""
    return struct.unpack("f", struct.pack("f", x))[0]


class RandomStream:
    """splitmix64, bit for bit the random_stream of scaling_bench.cpp."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self, lo, hi):
        # lo + (hi - lo) * float(next >> 40) * 2^-24, every step in float32 as in C++.
        u = float(self.next() >> 40)
        return f32(lo + f32(f32(f32(hi - lo) * u) * 2.0**-24))


def uneven_sizes(total, count, seed):
    """The sizes scaling_bench.cpp's uneven_sizes draws for the same arguments."""
    if count < 1 or count > total:
        raise ValueError(f"--tensors {count} must lie in [1, --elements {total}]")
    rng = RandomStream(seed)
    weight = []
    s = 0.0
    for _ in range(count):
        w = rng.uniform(0.25, 1.75)
        weight.append(w)
        s += w
    sizes = []
    end = 0
    cumulative = 0.0
    for i in range(count - 1):
        cumulative += weight[i]
        cut = int(float(total) * cumulative / s) // 8 * 8
        if i % 4 == 3:
            cut += 1 + rng.next() % 7
        cut = min(max(cut, end + 1), total - (count - 1 - i))
        sizes.append(cut - end)
        end = cut
    sizes.append(total - end)
    return sizes


def seed_for(k):
    return 20240601 + k  # as scaling_bench.cpp's run_all


def describe(sizes):
    odd = sum(1 for n in sizes if n % 8)
    blocks = sum((n + CHUNK - 1) // CHUNK for n in sizes)
    return (f"list of {len(sizes)} tensors: {min(sizes)} to {max(sizes)} elements, {odd} not a multiple of 8; "
            f"{blocks} blocks of {CHUNK} elements (mpx's chunking)")


def parse_counts(text):
    out = []
    for item in text.split(","):
        if not item.isdigit() or int(item) == 0:
            raise argparse.ArgumentTypeError(f"not a positive count: '{item}'")
        out.append(int(item))
    return out


def main():
    parser = argparse.ArgumentParser(description="PyTorch's counterparts of scaling_bench's CUDA rows.")
    parser.add_argument("--elements", type=int, default=1 << 26, help="gradient elements in all (default 2^26)")
    parser.add_argument("--tensors", type=parse_counts, default=[200], help="K, or a list K1,K2,... (default 200)")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per row; the median is printed")
    parser.add_argument("--sizes-only", action="store_true",
                        help="print each list's description (to compare with scaling_bench's) and stop")
    args = parser.parse_args()
    args.repeat = max(1, args.repeat)
    for k in args.tensors:
        if k > args.elements:
            parser.error(f"--tensors {k} exceeds --elements {args.elements}")

    if args.sizes_only:
        for k in args.tensors:
            print(describe(uneven_sizes(args.elements, k, seed_for(k))))
        return 0

    try:
        import torch
    except ImportError:
        print("torch_compare: PyTorch is not installed here; nothing to compare (pip install torch on a GPU machine).")
        return 0
    if not torch.cuda.is_available():
        print(f"torch_compare: PyTorch {torch.__version__} sees no CUDA device; nothing to compare.")
        return 0
    return run(torch, args)


def load_mpx_torch():
    """mpx_torch built with CUDA, installed or where tests/torch/run.sh builds it; or the
    reason it is not there."""
    root = Path(__file__).resolve().parent.parent
    sys.path.append(str(root / "build-torch-cuda" / "lib"))
    try:
        import mpx_torch
    except ImportError as e:
        return None, f"mpx_torch is not importable ({e}); build it with CUDA (see docs/pytorch.md)"
    if not mpx_torch.built_with_cuda:
        return None, "this mpx_torch was built for the CPU only; rebuild it with MPX_TORCH_CUDA=1"
    return mpx_torch, None


def run(torch, args):
    device = torch.device("cuda")
    mpx_torch, why_not = load_mpx_torch()
    n = args.elements

    def median_seconds(fn):
        fn()  # warm-up: allocator growth, kernel loading, optimizer state creation
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(args.repeat):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        times.sort()
        return times[len(times) // 2]  # the element scaling_bench takes

    copy_gbps = None

    def row(op, dtype_name, k, bytes_per_element, seconds, who="torch"):
        gbps = bytes_per_element * n / seconds / 1e9
        share = 100.0 * gbps / copy_gbps if copy_gbps else 100.0
        print(f"{who:<6} {op:<26} {dtype_name:<9} {k:>7} {n:>11} {bytes_per_element:>6.0f} "
              f"{seconds * 1e3:>10.4f} {gbps:>9.1f} {share:>8.1f}%", flush=True)
        return gbps

    print(f"torch_compare: PyTorch {torch.__version__}, GPU: {torch.cuda.get_device_name(0)}; {n} gradient elements "
          f"in all, in lists of uneven sizes (one allocation each); median of {args.repeat} runs after a warm-up")
    print("GB/s = (bytes read + bytes written) / time, each byte once; the copy counts its read and its write "
          "(8 B per float element), as scaling_bench does.\n"
          "B/elem: check (in place) 2*sizeof(T); foreach_norm sizeof(T) (read only); fused adam 7*sizeof(T) "
          "(no master weights; moments in T): 14 for 16-bit, 28 for float32 (= mpx's adam for every T).")
    print("rows 'mpx': mpx_torch on the same tensors and stream" if mpx_torch else f"no 'mpx' rows: {why_not}")
    print(f"{'exec':<6} {'op':<26} {'dtype':<9} {'tensors':>7} {'elements':>11} {'B/elem':>6} {'ms':>10} "
          f"{'GB/s':>9} {'of copy':>9}")

    src = torch.full((n,), 0.5, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_gbps = row("copy (ceiling)", "float32", 1, 8, median_seconds(lambda: dst.copy_(src)))
    del src, dst

    dtypes = [("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.float32)]
    for k in args.tensors:
        sizes = uneven_sizes(n, k, seed_for(k))
        print(describe(sizes))
        for name, dtype in dtypes:
            size = torch.tensor([], dtype=dtype).element_size()
            gen = torch.Generator(device=device)
            gen.manual_seed(seed_for(k))
            params = [torch.nn.Parameter(torch.empty(s, dtype=dtype, device=device).uniform_(-1, 1, generator=gen))
                      for s in sizes]
            grads = [torch.empty(s, dtype=dtype, device=device).uniform_(-1e-2, 1e-2, generator=gen) for s in sizes]
            for p, g in zip(params, grads):
                p.grad = g
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            # A scale of 1 leaves the gradients as they were, so every repeat reads the same
            # values (scaling_bench's in-place rows do the same).
            inv_scale = torch.ones(1, dtype=torch.float32, device=device)

            def check():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)

            t = median_seconds(check)
            if found_inf.item() != 0:
                raise SystemExit(f"torch_compare: the check found a non-finite {name} gradient; no row printed")
            row("check (in place)", name, k, 2 * size, t)
            row("foreach_norm (read only)", name, k, size, median_seconds(lambda: torch._foreach_norm(grads)))

            optimizer = torch.optim.Adam(params, lr=1e-3, fused=True)
            before = params[0].detach().clone()
            adam_bytes = 7 * size
            label = "fused adam (f32 = mpx)" if dtype == torch.float32 else "fused adam (no master)"
            row(label, name, k, adam_bytes, median_seconds(optimizer.step))

            def check_and_step():
                check()
                optimizer.step()

            row("check + fused adam", name, k, 2 * size + adam_bytes, median_seconds(check_and_step))
            if found_inf.item() != 0:
                raise SystemExit(f"torch_compare: the check found a non-finite {name} gradient; no row printed")
            if torch.equal(before, params[0].detach()):
                raise SystemExit(f"torch_compare: fused Adam on {name} did not change the first parameter")
            if not all(bool(torch.isfinite(p).all()) for p in params):
                raise SystemExit(f"torch_compare: fused Adam on {name} left NaN or inf in the parameters")
            if mpx_torch:
                del optimizer
                mpx_rows(torch, mpx_torch, row, median_seconds, params, grads, found_inf, inv_scale, name, k, size)
            del params, grads
            torch.cuda.empty_cache()
    return 0


def mpx_rows(torch, mpx_torch, row, median_seconds, params, grads, found_inf, inv_scale, name, k, size):
    """mpx_torch's check, Adam step and both, on the tensors torch's rows used."""

    def check():
        mpx_torch.non_finite_check_and_unscale_(grads, found_inf, inv_scale)

    row("check (in place)", name, k, 2 * size, median_seconds(check), who="mpx")
    optimizer = mpx_torch.Adam(params, lr=1e-3)
    before = params[0].detach().clone()
    row("adam (f32 master)", name, k, 28, median_seconds(optimizer.step), who="mpx")

    def check_and_step():
        check()
        optimizer.step()

    row("check + adam", name, k, 2 * size + 28, median_seconds(check_and_step), who="mpx")
    if found_inf.item() != 0:
        raise SystemExit(f"torch_compare: mpx's check found a non-finite {name} gradient")
    if torch.equal(before, params[0].detach()):
        raise SystemExit(f"torch_compare: mpx's Adam on {name} did not change the first parameter")


if __name__ == "__main__":
    sys.exit(main())
