"""The C++ decode GEMV kernels (csrc/gemv.cpp) for int8, int4 and GGUF Q8_0 weights: loading and calling.

At batch 1..NATIVE_MAX_ROWS a decode step is a GEMV that only has to read each weight once; the
torch kernels either dequantize to a float tile first (a write and a re-read of 4 bytes per
weight) or run scalar code. These kernels read the stored codes and dequantize in registers.
They need x86-64 with AVX-512 (csrc/gemv.cpp) or AVX2 + FMA (csrc/gemv_avx2.cpp: the same ops on
8-lane vectors, for Zen 3; checked at run time) and a C++ compiler (built at first use, cached;
tessera/native.py); when either is missing `available()` is False and the QuantLinear classes
keep their torch kernels. Ops: torch.ops.tessera_gemv.{int8, q8_0, int4pack}, with fake (meta)
kernels so torch.compile can trace through them. The int4 op reads torch's packed layout of the
machine: 64-row blocks where torch packs for AVX-512, 32-row blocks on AVX2 (`INT4_BLOCK_ROWS`).
Both builds carry `tessera_gemv.q4x8` and `q8x8` (csrc/gemv_x8.h): GGUF Q4_0/Q4_1 and Q8_0 blocks
on int8-quantized activations (llama.cpp's arithmetic) for any number of rows
(gguf_int8_activations.py).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from tessera.native import load_extension

# Up to this many activation rows the kernels beat the torch ones (benchmarks/quant.py --kernels).
NATIVE_MAX_ROWS = 8
# How far ahead of the weight being read the kernels prefetch, and into which cache (tuning knobs;
# 4096 bytes into L1: the best of 1, 4 and 16 KiB; an L2 hint was no better, on the development Xeon).
PREFETCH_BYTES = int(os.environ.get("TESSERA_GEMV_PREFETCH", "4096"))
PREFETCH_HINT = os.environ.get("TESSERA_GEMV_PREFETCH_HINT", "_MM_HINT_T0")
_CSRC = Path(__file__).parent / "csrc"
# The lm_head forms' greedy argmax, shared with the bf16 and quantized kernels' libraries.
_ARGMAX_ROWS = Path(__file__).parents[1] / "kernels" / "csrc" / "argmax_rows.h"


def cpu_supported() -> bool:
    """Whether this CPU runs the AVX-512 kernels (gemv.cpp)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


def avx2_only() -> bool:
    """Whether this CPU runs gemv_avx2.cpp instead: AVX2 and FMA without AVX-512 (Zen 3)."""
    from tessera.kernels import cpu_has_avx2_fma

    return not cpu_supported() and torch.backends.cpu.get_cpu_capability() == "AVX2" and cpu_has_avx2_fma()


# Rows per block of the int4 layout the native int4pack op reads (torch's on that CPU kind).
INT4_BLOCK_ROWS = 32 if avx2_only() else 64


@functools.cache
def available() -> bool:
    """True when the kernels are built and loaded on a CPU that can run them."""
    if cpu_supported():
        name, sources = "tessera_gemv", (_CSRC / "gemv.cpp", _CSRC / "gemv_x8.h", _ARGMAX_ROWS)
        defines = (f"PREFETCH_BYTES={PREFETCH_BYTES}", f"PREFETCH_HINT={PREFETCH_HINT}")
    elif avx2_only():
        name, sources, defines = "tessera_gemv_avx2", (_CSRC / "gemv_avx2.cpp", _CSRC / "gemv_x8.h", _ARGMAX_ROWS), ()
    else:
        return False
    if not load_extension(name, sources, defines):
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    def out(x: torch.Tensor, rows: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], rows)

    torch.library.register_fake("tessera_gemv::int8")(lambda x, q, scale: out(x, q.shape[0]))
    torch.library.register_fake("tessera_gemv::q8_0")(lambda x, codes, d: out(x, codes.shape[0]))
    torch.library.register_fake("tessera_gemv::int4pack")(lambda x, packed, sz, group: out(x, sz.shape[1]))
    torch.library.register_fake("tessera_gemv::q4x8")(lambda x, qs, d, m: out(x, 8 * qs.shape[0]))
    torch.library.register_fake("tessera_gemv::q8x8")(lambda x, qs, d: out(x, 8 * qs.shape[0]))

    def logits_out(x: torch.Tensor, qs: torch.Tensor, argmax: bool, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return (x.new_empty(x.shape[0], 8 * qs.shape[0] if logits else 0, dtype=torch.float32),
                x.new_empty(x.shape[0] if argmax else 0, dtype=torch.long))

    torch.library.register_fake("tessera_gemv::q4x8_logits")(
        lambda x, qs, d, m, argmax, logits=True: logits_out(x, qs, argmax, logits))
    torch.library.register_fake("tessera_gemv::q8x8_logits")(
        lambda x, qs, d, argmax, logits=True: logits_out(x, qs, argmax, logits))

    def rows_out(qs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return qs.new_empty(ids.shape[0], 32 * qs.shape[1], dtype=torch.float32)

    torch.library.register_fake("tessera_gemv::q4x8_rows")(lambda qs, d, m, ids: rows_out(qs, ids))
    torch.library.register_fake("tessera_gemv::q8x8_rows")(lambda qs, d, ids: rows_out(qs, ids))


def usable(x: torch.Tensor) -> bool:
    """Whether a call with activations x can take a native kernel."""
    return x.device.type == "cpu" and x.shape[0] <= NATIVE_MAX_ROWS and available()


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous()


def _by_chunks(op, x: torch.Tensor, *args) -> torch.Tensor:
    """The op on x in chunks of at most NATIVE_MAX_ROWS rows (the kernels' register budget)."""
    x = _f32(x)
    if x.shape[0] <= NATIVE_MAX_ROWS:
        return op(x, *args)
    return torch.cat([op(c.contiguous(), *args) for c in x.split(NATIVE_MAX_ROWS)])


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (scale[:, None] * q).T in x's dtype (float32 accumulation)."""
    return _by_chunks(torch.ops.tessera_gemv.int8, x, q, scale).to(x.dtype)


def gemv_q8_0(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T for a Q8_0 weight (int8 codes [N, K], float16 d [N, K / 32])."""
    return _by_chunks(torch.ops.tessera_gemv.q8_0, x, codes, d).to(x.dtype)


def gemv_int4pack(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] @ W.T for an int4 weight in torch's 64-row packed layout -> [M, padded rows]."""
    return _by_chunks(torch.ops.tessera_gemv.int4pack, x, packed, scales_zeros, group).to(x.dtype)


def _x8_input(x: torch.Tensor) -> torch.Tensor:
    """x as the int8-activation kernels take it: float32 or bf16 as it is (their output comes in its
    dtype), any other dtype in float32."""
    return x.contiguous() if x.dtype in (torch.float32, torch.bfloat16) else _f32(x)


def gemv_q4x8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T for GGUF Q4 blocks in the q4x8 layout (gguf_int8_activations.py) -> [M, 8 * groups]
    in x's dtype, x quantized to int8 per 32 first; any M (gemv_x8.h)."""
    return torch.ops.tessera_gemv.q4x8(_x8_input(x), qs, d, m).to(x.dtype)


def gemv_q8x8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T for a GGUF Q8_0 weight in the q8x8 layout (gguf_int8_activations.py) -> [M, 8 *
    groups] in x's dtype, x quantized to int8 per 32 first; any M (gemv_x8.h)."""
    return torch.ops.tessera_gemv.q8x8(_x8_input(x), qs, d).to(x.dtype)
