#!/usr/bin/env python3
"""examples/char_lm's model and run in PyTorch (float32, on the CPU), batch for batch.

The same corpus read the same way (a directory's regular files in name order, without
fortune's .dat and .u8 files, dot files, symlinks and subdirectories), the same split
(the last 10 % of the bytes for validation), the same training windows in the same order
(mpx::shuffled_order's Fisher-Yates over splitmix64, reproduced here bit for bit), the
same model (byte and position embeddings; 4 pre-norm blocks of causal self-attention and
a gelu MLP; layer norms with epsilon 1e-3, as mpx's and Keras's; a final layer norm and
dense layer), AdamW with the same settings (3e-3, betas 0.9/0.999, epsilon 1e-8, weight
decay 0.01 on every parameter), and the same validation score (the first 40 batches of
the validation text, in order). Only the initial values differ (each library draws its
own), and the arithmetic's rounding.

--init chooses the initial distributions, as char_lm's --init does:
  keras  glorot_uniform kernels, zero biases, embeddings U(-0.05, 0.05)
  torch  PyTorch's own defaults (nn.Linear: U(+-1/sqrt(fan_in)) weight and bias;
         nn.Embedding: N(0, 1))
  gpt2   N(0, 0.02) weights, zero biases, N(0, 0.02/sqrt(2 x blocks)) for the
         projections that end a residual branch

  python3 bench/torch_char_lm.py [--init keras|torch|gpt2] [--seeds 1,2,3] [--steps 300]

It prints one line per seed (validation loss in nats per byte) and their mean: what
char_lm --policy float32 --init <same> should reach, within the spread of the seeds.
Without PyTorch it says so and exits 0.
"""

import argparse
import math
import os
import sys

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix(x):
    """mpx::splitmix64::mix."""
    x = (x + GOLDEN) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class SplitMix64:
    """mpx::splitmix64 as a sequential generator."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def __call__(self):
        x = self.state
        self.state = (self.state + GOLDEN) & MASK64
        return mix(x)

    def below(self, n):
        reject = ((1 << 64) - n) % n
        while True:
            r = self()
            if r >= reject:
                return r % n


def shuffled_order(n, seed, epoch, needed):
    """mpx::shuffled_order(n, seed, epoch), of which only the first `needed` entries are
    returned. Fisher-Yates from the back: the first entries are final only at the end,
    so the whole permutation is drawn."""
    order = list(range(n))
    rng = SplitMix64(SplitMix64(SplitMix64(seed)() ^ epoch)())
    for i in range(n, 1, -1):
        j = rng.below(i)
        order[i - 1], order[j] = order[j], order[i - 1]
    return order[:needed]


def read_corpus(path):
    """mpx::read_text_corpus."""
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            return f.read()
    names = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.islink(full) or not os.path.isfile(full):
            continue
        if name.startswith(".") or name.endswith(".dat") or name.endswith(".u8"):
            continue
        names.append(full)
    data = bytearray()
    for full in sorted(names, key=lambda s: s.encode()):
        with open(full, "rb") as f:
            data += f.read()
    return bytes(data)


def model_class(torch, W, H, L, blocks):
    """char_lm's model in PyTorch: width W, H heads, L tokens, `blocks` pre-norm blocks."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(W, eps=1e-3)
            self.qkv = nn.Linear(W, 3 * W)
            self.out = nn.Linear(W, W)
            self.ln2 = nn.LayerNorm(W, eps=1e-3)
            self.up = nn.Linear(W, 4 * W)
            self.down = nn.Linear(4 * W, W)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(W, dim=-1)
            q, k, v = (z.view(b, t, H, W // H).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, W))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(256, W)
            self.positions = nn.Embedding(L, W)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.ln = nn.LayerNorm(W, eps=1e-3)
            self.head = nn.Linear(W, 256)

        def forward(self, x):
            h = self.tokens(x) + self.positions(torch.arange(x.shape[1]))[None]
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln(h))

    return Model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", choices=["keras", "torch", "gpt2"], default="keras")
    parser.add_argument("--seeds", default="1,2,3", help="initialisation seeds, comma-separated")
    parser.add_argument("--data-seed", type=int, default=1, help="char_lm's --seed: the window order")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=40)
    parser.add_argument("--corpus", default="/usr/share/games/fortunes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's choice)")
    args = parser.parse_args()
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError:
        print("torch_char_lm.py: PyTorch is not installed (scripts/setup_torch.sh installs it); nothing to compare")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    corpus = read_corpus(args.corpus)
    n = len(corpus)
    val = max(1, int(math.floor(0.1 * n + 0.5)))
    train, validation = corpus[: n - val], corpus[n - val :]
    L, B = args.context, args.batch
    stride = L // 2
    windows = (len(train) - L - 1) // stride + 1
    per_epoch = (windows + B - 1) // B
    if args.steps > per_epoch:
        print("torch_char_lm.py: more steps than one epoch holds is not reproduced here", file=sys.stderr)
        return 1
    order = shuffled_order(windows, args.data_seed, 0, min(windows, args.steps * B))
    train_t = torch.tensor(list(train), dtype=torch.long)
    val_t = torch.tensor(list(validation), dtype=torch.long)

    def batch_of(text, starts):
        idx = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(L + 1)[None, :]
        chunk = text[idx]
        return chunk[:, :-1], chunk[:, 1:]

    W, H, blocks = args.width, args.heads, args.blocks
    Model = model_class(torch, W, H, L, blocks)

    def initialise(model, init):
        if init == "torch":
            return  # PyTorch's own
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        ends_branch = {id(b.out) for b in model.blocks} | {id(b.down) for b in model.blocks}
        for m in linears:
            if init == "keras":
                nn.init.xavier_uniform_(m.weight)
            else:
                std = 0.02 / math.sqrt(2 * blocks) if id(m) in ends_branch else 0.02
                nn.init.normal_(m.weight, 0.0, std)
            nn.init.zeros_(m.bias)
        for e in (model.tokens, model.positions):
            if init == "keras":
                nn.init.uniform_(e.weight, -0.05, 0.05)
            else:
                nn.init.normal_(e.weight, 0.0, 0.02)

    losses = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        torch.manual_seed(seed)
        model = Model()
        initialise(model, args.init)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        for step in range(args.steps):
            starts = [w * stride for w in order[step * B : (step + 1) * B]]
            x, y = batch_of(train_t, starts)
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
        total, count = 0.0, 0
        val_windows = (len(validation) - L - 1) // L + 1
        with torch.no_grad():
            for b in range(min(args.eval_batches, (val_windows + B - 1) // B)):
                starts = [w * L for w in range(b * B, min((b + 1) * B, val_windows))]
                x, y = batch_of(val_t, starts)
                total += F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1), reduction="sum").item()
                count += y.numel()
        losses.append(total / count)
        print(f"--init {args.init}  seed {seed}: training loss at step {args.steps} {loss.item():.4f}, "
              f"validation loss {losses[-1]:.4f}", flush=True)
    mean = sum(losses) / len(losses)
    spread = max(losses) - min(losses)
    print(f"PyTorch {torch.__version__}, --init {args.init}: validation loss {mean:.4f} "
          f"(mean of {len(losses)} seeds, spread {spread:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
