#!/usr/bin/env python3
"""PyTorch eager's training throughput on char_lm's GPT-2-small model, beside mpx's.

The model is examples/char_lm's under --preset gpt2-small (bench/torch_char_lm.py's
model_class, whose blocks this reuses): a 256-byte vocabulary, token and learned position
embeddings (context 1024), 12 pre-norm blocks (x + attention(LN(x)), then x + MLP(LN(x)),
layer norms with epsilon 1e-3), attention as a packed QKV Linear(768, 2304), 12 causal
heads of width 64 through scaled_dot_product_attention, and Linear(768, 768); the MLP as
Linear(768, 3072), the exact (erf) gelu that mpx's activation::gelu is, and Linear(3072,
768); a final layer norm and Linear(768, 256); the cross-entropy in float32. GPT-2's
initialisation, batch 8, AdamW(6e-4, betas 0.9/0.999, epsilon 1e-8, weight decay 0.01 on
every parameter; fused on a GPU). Mixed precision as char_lm --policy mixed_bfloat16:
float32 parameters, torch.autocast(bfloat16) over the forward and the loss, no loss
scaling (mpx's mixed_bfloat16 uses a static scale of 1).

Measured: --warmup steps untimed, then --steps steps timed as a whole (wall clock, the
device synchronised before and after); tokens per second = steps x batch x context /
seconds, and the model's FLOP rate as char_lm counts it (6 x parameters + 12 x layers x
context x width per token, every parameter counted, embeddings included). The tokens are
random bytes from a seeded generator, already on the device: throughput only (the loss is
printed as a sanity check: about ln 256 = 5.55 at first). char_lm's own figure starts its
clock after its first step (one warm-up step), fetches each batch from the host with a
synchronisation, and reads its loss history every --log-every steps and at the last: a
few synchronisations PyTorch's loop does not make.

  python3 bench/torch_gpt2.py [--device cuda|cpu] [--steps N] [--warmup W] [--batch B]
      [--context T] [--layers L] [--width D] [--heads H] [--small] [--mpx-log FILE]

--mpx-log reads the table char_lm prints (its mixed_bfloat16 row's tokens / s) and prints
mpx / PyTorch. --small is a seconds-long smoke that runs on the CPU. Without PyTorch it
says so and exits 0.
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_char_lm import model_class  # noqa: E402  (imports no torch itself)

GPT2_SMALL = dict(layers=12, width=768, heads=12, context=1024, batch=8, steps=30, warmup=5)
SMALL = dict(layers=2, width=64, heads=4, context=64, batch=2, steps=3, warmup=1)


def mpx_tokens_per_second(path):
    """The tokens / s of the last mixed_bfloat16 row under a char_lm table header in
    `path` ("policy  validation loss  tokens / s ..."), or None."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found, in_table = None, False
    for line in lines:
        fields = line.split()
        if fields[:1] == ["policy"] and "tokens" in fields:
            in_table = True
        elif in_table and fields[:1] == ["mixed_bfloat16"] and len(fields) >= 3:
            try:
                found = float(fields[2])  # policy, validation loss, tokens / s
            except ValueError:
                pass
    return found


def gpt2_initialise(torch, model, layers):
    """GPT-2's start, as char_lm --init gpt2: N(0, 0.02), zero biases, N(0, 0.02 /
    sqrt(2 x layers)) for the projections that end a residual branch."""
    nn = torch.nn
    residual = {id(b.out) for b in model.blocks} | {id(b.down) for b in model.blocks}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * layers) if id(m) in residual else 0.02)
            nn.init.zeros_(m.bias)
    for e in (model.tokens, model.positions):
        nn.init.normal_(e.weight, 0.0, 0.02)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if PyTorch sees one, else cpu")
    for name in ("steps", "warmup", "batch", "context", "layers", "width", "heads"):
        parser.add_argument(f"--{name}", type=int, help=f"default {GPT2_SMALL[name]} ({SMALL[name]} with --small)")
    parser.add_argument("--small", action="store_true", help="a tiny model for a smoke run (CPU: seconds)")
    parser.add_argument("--mpx-log", metavar="FILE", help="char_lm's output, for the mpx / PyTorch ratio")
    args = parser.parse_args()
    shape = {k: getattr(args, k) if getattr(args, k) is not None else (SMALL if args.small else GPT2_SMALL)[k]
             for k in GPT2_SMALL}
    if any(v < (k != "warmup") for k, v in shape.items()) or shape["width"] % shape["heads"]:
        parser.error("sizes must be positive (--warmup may be 0) and --width a multiple of --heads")
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch_gpt2.py: PyTorch is not installed here (scripts/setup_torch.sh installs it); nothing to compare",
              flush=True)
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"torch_gpt2.py: PyTorch {torch.__version__} sees no CUDA device; nothing to compare", flush=True)
        return 0

    L, W, H, T, B = (shape[k] for k in ("layers", "width", "heads", "context", "batch"))
    steps, warmup = shape["steps"], shape["warmup"]
    Base = model_class(torch, W, H, T, L)

    class GPT(Base):
        def forward(self, x):  # Base's, with the positions taken on the tokens' device
            h = self.tokens(x) + self.positions.weight[: x.shape[1]]
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln(h))

    torch.manual_seed(1)
    model = GPT()
    gpt2_initialise(torch, model, L)
    model.to(device).train()
    parameters = sum(p.numel() for p in model.parameters())
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                  fused=fused)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (warmup + steps, B, T + 1), generator=generator).to(device)

    def step(i):
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    def synchronise():
        if device.type == "cuda":
            torch.cuda.synchronize()

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    print(f"torch {torch.__version__} on {where}", flush=True)
    print(f"model: {L} blocks, width {W}, {H} heads, context {T}; batch {B}; {parameters:,} parameters; "
          f"{warmup} warm-up steps, {steps} timed", flush=True)
    for i in range(warmup):
        step(i)
    synchronise()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = step(i)
    synchronise()
    seconds = time.perf_counter() - start

    tokens_per_second = steps * B * T / seconds
    flops_per_token = 6.0 * parameters + 12.0 * L * T * W
    what = "bf16 autocast, SDPA, " + ("fused AdamW" if fused else "AdamW")
    print(f"loss at step {warmup + steps}: {loss.item():.4f} (random bytes: about ln 256 = 5.55)", flush=True)
    print(f"PyTorch eager ({what}): {tokens_per_second:.0f} tokens/s, "
          f"{tokens_per_second * flops_per_token / 1e12:.3f} model TFLOP/s", flush=True)

    if args.mpx_log:
        mpx = mpx_tokens_per_second(args.mpx_log)
        if mpx is None:
            why = "is missing" if not os.path.isfile(args.mpx_log) else "has no mixed_bfloat16 row in char_lm's table"
            print(f"mpx / PyTorch: {args.mpx_log} {why}; no ratio", flush=True)
        else:
            print(f"mpx / PyTorch tokens per second: {mpx / tokens_per_second:.3f} "
                  f"(mpx {mpx:.0f}, PyTorch {tokens_per_second:.0f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
