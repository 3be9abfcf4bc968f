"""Helpers of the mpx_torch tests: seeded gradients of awkward sizes, bitwise comparison."""

import torch

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
AWKWARD = [1, 7, 1000, 65537]
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def gradients(sizes, dtype, seed, spread=12):
    """Values of every binade the dtype holds around 1, +-2^spread (float16: down into its
    subnormals), signs mixed, one tensor per size; all finite in dtype."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        mantissa = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5
        exponent = torch.randint(-spread, spread + 1, (n,), generator=gen).to(torch.float64)
        sign = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
        out.append((sign * mantissa * torch.exp2(exponent)).to(dtype))
    return out


def random_sizes(count, seed, largest=3000):
    gen = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(1, largest, (count,), generator=gen)]


def first_bit_mismatch(a, b):
    """None when a and b hold the same bits, else a message naming the first difference."""
    assert a.dtype == b.dtype and a.shape == b.shape
    x, y = a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype])
    bad = (x != y).nonzero()
    if len(bad) == 0:
        return None
    i = int(bad[0, 0])
    return f"{len(bad)} of {a.numel()} elements differ; first at {i}: {a[i].item()!r} vs {b[i].item()!r}"
