"""Batch-invariant CPU kernels (C++, built at first use): linear layers, paged attention and the
fused elementwise ops of a layer (residual add + RMSNorm, rotary, SiLU x up).

`available()` builds `csrc/invariant_kernels.cpp`, `csrc/paged_attention.cpp`,
`csrc/fused_ops.cpp`, `csrc/decoder_stack.cpp` and `csrc/gemma_stack.cpp` (a llama / Gemma 3 decoder
stack in one call) and `csrc/sampling.cpp` (the sampler's head of a row, its temperature-only and
top-p-only draws) through `tessera.native` (cached per CPU and torch version) and registers the ops
under `torch.ops.tessera_inv`. Everything here has a pure-torch fallback; callers ask `available()`
first.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tessera.native import load_extension

_SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in (
    "invariant_kernels.cpp", "paged_attention.cpp", "fused_ops.cpp", "fused_avx2.cpp", "f32_gemm_avx2.cpp",
    "decoder_stack.cpp", "gemma_stack.cpp", "stack_common.h", "sampling.cpp", "argmax_rows.h", "silu_rows.h",
    "avx2_kernels.h", "sampling_lanes_avx512.h", "sampling_lanes_avx2.h", "sampling_rows.h"))


@functools.cache
def available() -> bool:
    """True once the invariant kernels are built and loaded (False: use the torch fallbacks)."""
    return load_extension("tessera_invariant", _SOURCES)


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_amx_bf16() -> bool:
    return "amx_bf16" in cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def ops():
    return torch.ops.tessera_inv


def cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def fused(x: torch.Tensor) -> bool:
    """Whether the fused elementwise C++ ops can run on x (CPU): float32 or bfloat16 with AVX-512
    BF16 (Zen 4, Sapphire Rapids and later), float32 with AVX2 and FMA (Zen 3; the same bits)."""
    if x.device.type != "cpu" or not available():
        return False
    if x.dtype == torch.float32:
        return cpu_has_avx512_bf16() or cpu_has_avx2_fma()
    return x.dtype == torch.bfloat16 and cpu_has_avx512_bf16()


def sampling_ops(x: torch.Tensor) -> bool:
    """Whether sampling.cpp's vectorized ops (softmax, nucleus, seeded uniforms) can take x: CPU
    float32 on CPUs with AVX2 and FMA (every AVX-512 one has them; sampling.cpp takes its AVX-512
    lanes there, and 8-lane halves with the same bits elsewhere, as on Zen 3)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_has_avx2_fma() and available()
