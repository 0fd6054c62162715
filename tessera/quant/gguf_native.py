"""GGUF-native weights: compute from the GGUF file's own quantized blocks instead of float copies.

Block formats (32 weights per block, `d` and `m` float16):
- Q4_0, 18 bytes: d, then 16 bytes of 4-bit codes q; W = d * (q - 8).
- Q4_1, 20 bytes: d, m, then 16 bytes of codes; W = d * q + m.
- Q8_0, 34 bytes: d, then 32 int8 codes; W = d * q.
In Q4 blocks byte j holds weight j in its low nibble and weight j + 16 in its high nibble.

Q4_0 and Q4_1 map onto the int4 kernel's format with group size 32 (scale d, zero point 0 or
m + 8d): the codes are kept as they are, the scales are rounded from float16 to bfloat16 (the
kernel's format: a relative change of at most 2^-8 per block scale, far below the 4-bit step).
Q8_0 keeps its int8 codes and float16 scales as they are and is dequantized in row tiles of about
2 MiB into the activation dtype for each call (no int8 kernel with per-32 scales exists in torch).
Tensors of other types (float ones, K-quants, Q5) keep the float weight the loader made.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from tessera.quant.int4 import Int4Linear
from tessera.quant.linear import QuantLinear, tile_rows_for, tiled_matmul

logger = logging.getLogger("tessera")

BLOCK = 32
NATIVE_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}


def _blocks(raw: np.ndarray, qtype: Q, rows: int) -> np.ndarray:
    """Raw tensor bytes -> uint8 [rows, blocks per row, block bytes]."""
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    return data.reshape(rows, -1, _BLOCK_BYTES[qtype])


def _f16(b: np.ndarray) -> torch.Tensor:
    """Two bytes per entry (last axis) as float16 -> float32 tensor."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 16] packed bytes -> uint8 codes [rows, blocks * 32] (low nibbles first)."""
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(codes).reshape(qs.shape[0], -1))


def decode_q4_0(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (codes uint8 [rows, K] in 0..15, d float32 [rows, K / 32]); W = d * (q - 8)."""
    b = _blocks(raw, Q.Q4_0, rows)
    return _nibbles(b[..., 2:]), _f16(b[..., 0:2])


def decode_q4_1(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (codes uint8 [rows, K], d [rows, K / 32], m [rows, K / 32]); W = d * q + m."""
    b = _blocks(raw, Q.Q4_1, rows)
    return _nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def decode_q8_0(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (codes int8 [rows, K], d float32 [rows, K / 32]); W = d * q."""
    b = _blocks(raw, Q.Q8_0, rows)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
    return torch.from_numpy(codes.copy()), _f16(b[..., 0:2])


class Q8_0Linear(QuantLinear):
    """A GGUF Q8_0 weight: int8 codes with a float16 scale per 32, dequantized in tiles per call."""

    method = "gguf Q8_0"
    kernels = ("dequant",)

    def __init__(self, codes: torch.Tensor, d: torch.Tensor) -> None:
        super().__init__(codes.shape[0], codes.shape[1])
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("d", d.to(torch.float16).contiguous())  # the file's own scales, exactly

    def _fill(self, start: int, end: int, tile: torch.Tensor) -> None:
        tile.copy_(self.codes[start:end])
        tile.view(end - start, -1, BLOCK).mul_(self.d[start:end, :, None].to(tile.dtype))

    def dequantize(self) -> torch.Tensor:
        w = torch.empty(self.out_features, self.in_features)
        self._fill(0, self.out_features, w)
        return w

    def select_kernel(self, num_rows: int) -> str:
        return "dequant"

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel != "dequant":
            raise ValueError(f"unknown Q8_0 kernel {kernel!r}; have {self.kernels}")
        return tiled_matmul(x, self.out_features, tile_rows_for(self.in_features), self._fill)


def _decode(tensor) -> tuple | None:
    """A GGUF tensor as ("int4", codes, scale, zero) or ("q8_0", codes, d); None if not native."""
    rows = int(np.prod(tensor.shape[1:]))  # GGUF lists dims innermost first
    if tensor.tensor_type == Q.Q4_0:
        codes, d = decode_q4_0(tensor.data, rows)
        return ("int4", codes, d, torch.zeros_like(d))
    if tensor.tensor_type == Q.Q4_1:
        codes, d, m = decode_q4_1(tensor.data, rows)
        return ("int4", codes, d, m + 8 * d)
    if tensor.tensor_type == Q.Q8_0:
        return ("q8_0", *decode_q8_0(tensor.data, rows))
    return None


def gguf_linears(model, model_files, descs: list[str]) -> dict[str, QuantLinear]:
    """QuantLinear modules built from the GGUF blocks behind each described weight (see
    CausalLM.linear_slots); a weight whose blocks have no native kernel is left out."""
    from tessera.model.gguf_loader import GGUFModelFiles

    if not isinstance(model_files, GGUFModelFiles):
        raise ValueError(
            "--quantization gguf computes with a GGUF file's own quantized blocks, so --model must be "
            "a .gguf file; for a Hugging Face model use --quantization int8, int4 or w8a8"
        )
    slot_parts = {slot.name: slot.parts for slot in model.linear_slots(quantize_lm_head=True)}
    layers: dict[str, QuantLinear] = {}
    kept_float: dict[str, str] = {}
    for desc in descs:
        names = slot_parts[desc]  # the HF weights fused into this slot, in row order
        tensors = [model_files.source_tensor(n) for n in names]
        kinds = {t.tensor_type for t in tensors}
        decoded = [_decode(t) for t in tensors]
        if any(d is None for d in decoded) or len({d[0] for d in decoded}) != 1:
            kept_float[desc] = "+".join(sorted(k.name for k in kinds))
            continue
        parts = []
        for name, d in zip(names, decoded, strict=True):
            part = d[1:]
            if (transform := model_files.row_transform(name)) is not None:  # as the loader does
                part = tuple(transform(t) for t in part)
            parts.append(part)
        fused = [torch.cat(ts) for ts in zip(*parts, strict=True)]
        if decoded[0][0] == "int4":
            layer = Int4Linear.from_codes(*fused, group_size=BLOCK)
        else:
            layer = Q8_0Linear(*fused)
        layer.method = "gguf " + "+".join(sorted(k.name for k in kinds))
        layers[desc] = layer
    if kept_float:
        kinds = sorted(set(kept_float.values()))
        logger.warning("gguf: %d weight(s) of type(s) %s have no native kernel and stay float (native: %s)",
                       len(kept_float), ", ".join(kinds), ", ".join(t.name for t in NATIVE_TYPES))
    return layers

