"""Which ops give a row a different result depending on how many rows run with it.

`python -m tests.differential.ops_probe` prints, per op and dtype, the largest difference of
the first row's (or first query's) output between running it alone and running it among M
rows, for the shapes of the tiny model and of SmolLM2-135M. A 0 everywhere is what a
batch-invariant kernel gives; anything else names the op and the M at which it changes. It
is the evidence behind the numeric-variance findings (docs/reproducibility.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = (1, 2, 5, 16, 37, 64, 128, 512)
# (name, K, N) of the linears: tiny model (hidden 64), SmolLM2-135M (hidden 576, 9 heads x 64).
LINEARS = [("tiny qkv", 64, 128), ("tiny mlp down", 128, 64), ("tiny lm_head", 64, 267),
           ("smollm qkv", 576, 960), ("smollm gate_up", 576, 3072), ("smollm down", 1536, 576),
           ("smollm lm_head", 576, 49152)]


def linear_variance(dtype: torch.dtype, k: int, n: int) -> dict[int, float]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype) * k**-0.5
    x = torch.randn(max(ROWS), k, generator=gen).to(dtype)
    alone = F.linear(x[:1], w).float()
    return {m: (F.linear(x[:m], w)[:1].float() - alone).abs().max().item() for m in ROWS}


def prefill_attention_variance(dtype: torch.dtype, heads: int = 9, kv_heads: int = 3, d: int = 64,
                               length: int = 64) -> dict[str, float]:
    """SDPA over a prompt at once vs the same prompt's last rows as a chunk over the cached rest
    (what a prefix-cache hit or a chunk boundary does), compared at the last query row."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, length, d, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, length, d, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, length, d, generator=gen).to(dtype)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, -1:].float()
    out = {}
    for suffix in (1, 5, 16, 37):
        mask = torch.ones(suffix, length, dtype=torch.bool).tril(length - suffix)
        chunk = F.scaled_dot_product_attention(q[:, :, -suffix:], k, v, attn_mask=mask, enable_gqa=True)
        out[f"suffix {suffix}"] = (chunk[:, :, -1:].float() - full).abs().max().item()
    return out


def main() -> None:
    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16):
        print(f"\n{str(dtype).removeprefix('torch.')}: F.linear, max |row 0 among M rows - row 0 alone|")
        print(f"  {'op':<16}" + "".join(f"{'M=' + str(m):>10}" for m in ROWS))
        for name, k, n in LINEARS:
            diffs = linear_variance(dtype, k, n)
            print(f"  {name:<16}" + "".join(f"{diffs[m]:>10.3g}" for m in ROWS))
        diffs = prefill_attention_variance(dtype)
        print("  SDPA last query, chunk over cached context vs whole prompt: "
              + ", ".join(f"{k}: {v:.3g}" for k, v in diffs.items()))


if __name__ == "__main__":
    main()
