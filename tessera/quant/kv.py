"""A quantized KV cache (--kv-cache-dtype int8 | fp8): more tokens in the same memory.

"auto" keeps K and V in the model dtype. "int8" and "fp8" (float8_e4m3fn) store one byte per
element plus a float32 scale per (token, KV head), in a parallel tensor of the pool: a layer's
cache is then the 4-tuple (k_codes, v_codes, k_scales, v_scales), codes [slots, Hkv, d] and
scales [slots, Hkv, 1], all indexed by the same slots, so block copies (swap, prefix-cache
promotion) move scales with their codes without knowing about them.

Quantized on write, per token and head: scale = max|x| / QMAX (127 for int8, 448, the largest
finite e4m3 value, for fp8), codes = round(x / scale) (int8) or x / scale rounded to e4m3.
The element with the largest magnitude is exact; int8's error is at most scale / 2 per element
(1/254 of the head's largest value), fp8's is relative, up to 2^-4 of the element itself.

Every attention read goes through the dequantized values, including a fresh prompt's own K/V
(see `write_quantized`): so a prompt attends to the same K/V whether they were just computed,
read back from the prefix cache, recomputed after preemption or swapped back in, and those
paths give the same tokens.

Bytes per token and head with head_dim d: d + 4 (float32: 4d). For d = 64 that is 68 vs 256:
3.76x the tokens of a float32 pool, 1.88x a bf16 one.
"""

from __future__ import annotations

import logging

import torch

from tessera import memory
from tessera.config import KV_CACHE_DTYPES, ModelConfig

logger = logging.getLogger("tessera")

# code dtype and the largest code magnitude of each quantized format
_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
}
SCALE_DTYPE = torch.float32
_MIN_AMAX = 1e-20  # an all-zero head row gets this (codes 0), never a zero division

QuantizedKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")


def kv_bytes_per_token(mc: ModelConfig, model_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V (codes and scales) one token takes across all layers."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return mc.kv_bytes_per_token(torch.empty((), dtype=model_dtype).element_size())
    per_head = mc.head_dim * 1 + torch.empty((), dtype=SCALE_DTYPE).element_size()
    return 2 * mc.num_layers * mc.num_kv_heads * per_head


def is_quantized(kv_cache: tuple[torch.Tensor, ...]) -> bool:
    return len(kv_cache) == 4


def allocate_kv_cache(model, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto") -> list:
    """The model's KV pool: `model.allocate_kv_cache` for "auto", else zero-filled codes and
    scales per layer (zero scales keep the padding block finite)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return model.allocate_kv_cache(num_blocks, block_size)
    backend = getattr(model, "attn_backend", None)
    if backend is not None and not backend.supports_quantized_kv:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is implemented in the torch attention backend only, "
                         f"not {backend.name!r}: use --attention-backend torch, or --kv-cache-dtype auto")
    code_dtype, _ = _FORMATS[kv_cache_dtype]
    mc = model.config
    slots = num_blocks * block_size
    shape = (slots, mc.num_kv_heads, mc.head_dim)
    scale_shape = (slots, mc.num_kv_heads, 1)
    device = model.device

    arena = memory.Arena([(shape, code_dtype)] * (2 * mc.num_layers), device)  # resident as used

    def layer() -> QuantizedKV:
        return (arena.take(shape, code_dtype), arena.take(shape, code_dtype),
                torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device),
                torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device))

    logger.info("KV cache %s: %d blocks of %d tokens, %d bytes per token (%d in the model dtype)", kv_cache_dtype,
                num_blocks, block_size, kv_bytes_per_token(mc, model.dtype, kv_cache_dtype),
                kv_bytes_per_token(mc, model.dtype))
    return [layer() for _ in range(mc.num_layers)]


def quantize(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes [..., d] in code_dtype, float32 scales [..., 1]): one scale per row."""
    qmax = _FORMATS["int8" if code_dtype == torch.int8 else "fp8"][1]
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(_MIN_AMAX).div_(qmax)
    y = x / scale
    if code_dtype == torch.int8:
        return y.round_().to(torch.int8), scale
    return y.to(code_dtype), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return codes.to(dtype).mul_(scales.to(dtype))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no CPU kernel for float8: copy its bytes instead.
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def write_quantized(kv_cache: QuantizedKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize k, v [T, Hkv, d] into their slots; return them dequantized in `dtype`, i.e.
    exactly the values a later read of those slots gives."""
    k_codes, v_codes, k_scales, v_scales = kv_cache
    out = []
    for x, codes_cache, scale_cache in ((k, k_codes, k_scales), (v, v_codes, v_scales)):
        codes, scales = quantize(x, codes_cache.dtype)
        _as_bytes(codes_cache).index_copy_(0, slot_mapping, _as_bytes(codes))
        scale_cache.index_copy_(0, slot_mapping, scales)
        out.append(dequantize(codes, scales, dtype))
    return out[0], out[1]
