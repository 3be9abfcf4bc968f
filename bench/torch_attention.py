#!/usr/bin/env python3
"""PyTorch's causal self-attention at transformer_bench's sizes, timed the same way.

The layer is mpx::causal_self_attention's: a packed QKV projection (Linear(D, 3D)), H heads
of width D/H, a causal softmax over the logits, P V, and an output projection (Linear(D,
D)). Two PyTorch forms of it, forward and forward + backward, median of --repeat runs
after a warm-up, timed with CUDA events:

  * unfused: q k^T / sqrt(d) as a batched matmul, a causal mask, softmax in float32, P V:
    the same products mpx's unfused path issues (mpx stores the logits in the storage
    dtype; PyTorch's autocast does too);
  * sdpa: torch.nn.functional.scaled_dot_product_attention(is_causal=True), which picks a
    fused kernel (FlashAttention, cuDNN's or the memory-efficient one) that never writes
    the T x T matrix: what mpx's fused path (cuDNN's SDPA) runs beside. Which one it
    picks differs between PyTorch versions, so on a GPU two more rows name the backend
    (bfloat16): sdpa-cudnn (SDPBackend.CUDNN_ATTENTION, the kernel family mpx runs) and
    sdpa-flash (SDPBackend.FLASH_ATTENTION).

Every forward is timed as a training forward (autograd recording, the graph discarded),
as transformer_bench times mpx's. PyTorch's SDPA backward is not deterministic by
default (dQ summed with atomics); mpx's cuDNN backward is, which on Hopper costs a dP
workspace written and read in every backward pass.

TFLOP/s counts what transformer_bench counts: the projections (8 N D^2 for N = B T tokens)
and the causal half of the two [T, T] products (2 B T^2 D) forward, backward twice that.
--device cpu runs a small smoke on the host (CI does); its times mean nothing.

  python3 bench/torch_attention.py [--repeat R] [--device cuda|cpu] [--small]
"""

import argparse
import statistics
import time

# transformer_bench's GPU rows: GPT-2 small's width and heads, and width 1,024 with heads
# of 128, at 1,024 to 4,096 tokens, 16,384 tokens a batch.
GPU_SIZES = [(16384 // t, t, d, h) for d, h in ((768, 12), (1024, 8)) for t in (1024, 2048, 4096)]
SMALL_SIZES = [(2, 16, 32, 2)]


def attention(torch, x, qkv, out, heads, fused):
    b, t, d = x.shape
    q, k, v = qkv(x).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    if fused:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (the backend: see forms)
    else:
        s = (q @ k.transpose(-1, -2)) * (1.0 / (d // heads) ** 0.5)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        p = s.float().masked_fill(mask, float("-inf")).softmax(-1).to(x.dtype)
        o = p @ v
    return out(o.transpose(1, 2).reshape(b, t, d))


def timed(torch, device, repeat, fn):
    fn()  # warm-up (kernel selection, allocator)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description="PyTorch's counterpart of transformer_bench's rows.")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="one small size (as transformer_bench --small)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_attention: PyTorch is not installed here; nothing to compare.")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"torch_attention: PyTorch {torch.__version__} sees no CUDA device; nothing to compare.")
        return 0
    device = torch.device(args.device)
    sizes = SMALL_SIZES if args.small or device.type == "cpu" else GPU_SIZES
    unit, scale = ("TFLOP/s", 1e12) if device.type == "cuda" else ("GFLOP/s", 1e9)
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'the CPU'}"
          f"{f', cuDNN {cudnn}' if cudnn else ''}; median of {args.repeat} runs")
    # (form, fused, the SDPA backend it is held to: None lets PyTorch choose)
    forms = [("unfused", False, None), ("sdpa", True, None)]
    backends = None
    if device.type == "cuda":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            backends = sdpa_kernel
            forms += [("sdpa-cudnn", True, SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", True, SDPBackend.FLASH_ATTENTION)]
        except ImportError:
            print("torch_attention: this PyTorch has no torch.nn.attention.sdpa_kernel; the sdpa rows are its choice")
    print(f"{'form':<10} {'dtype':<9} {'B x T x D / heads':<22} {'fwd (ms)':>10} {unit:>9} {'fwd+bwd (ms)':>13} {unit:>9}")
    torch.manual_seed(0)
    for b, t, d, h in sizes:
        for dtype in (torch.bfloat16, torch.float16):
            if device.type == "cpu" and dtype == torch.float16:
                continue  # slow and partial on CPUs; the GPU rows are the point
            qkv = torch.nn.Linear(d, 3 * d, device=device, dtype=dtype)
            out = torch.nn.Linear(d, d, device=device, dtype=dtype)
            x = torch.randn(b, t, d, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(b, t, d, device=device, dtype=dtype) * 0.01
            flops = 8 * b * t * d * d + 2 * b * t * t * d
            for name, fused, backend in forms:
                if backend is not None and dtype != torch.bfloat16:
                    continue  # the named backends in bfloat16 only: the kit's time is short

                def forward():
                    attention(torch, x, qkv, out, h, fused)  # a training forward; the graph is dropped

                def forward_backward():
                    y = attention(torch, x, qkv, out, h, fused)
                    y.backward(dy)

                label = f"{name:<10} {str(dtype).removeprefix('torch.'):<9} {f'{b}x{t}x{d} / {h}':<22}"
                try:
                    if backend is None:
                        fwd = timed(torch, device, args.repeat, forward)
                        both = timed(torch, device, args.repeat, forward_backward)
                    else:
                        with backends(backend):
                            fwd = timed(torch, device, args.repeat, forward)
                            both = timed(torch, device, args.repeat, forward_backward)
                except RuntimeError as e:  # the backend does not take this shape here
                    print(f"{label} not available: {str(e).splitlines()[0][:100]}")
                    continue
                print(f"{label} {fwd * 1e3:>10.3f} {flops / fwd / scale:>9.1f} {both * 1e3:>13.3f} "
                      f"{3 * flops / both / scale:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
