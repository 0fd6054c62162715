"""GGUF-native weights: compute from the GGUF file's own quantized blocks instead of float copies.

Block formats (32 weights per block, `d` and `m` float16):
- Q4_0, 18 bytes: d, then 16 bytes of 4-bit codes q; W = d * (q - 8).
- Q4_1, 20 bytes: d, m, then 16 bytes of codes; W = d * q + m.
- Q8_0, 34 bytes: d, then 32 int8 codes; W = d * q.
In Q4 blocks byte j holds weight j in its low nibble and weight j + 16 in its high nibble.

Q4_0 and Q4_1: on AMX CPUs the KQ tiles of gguf_tiles.py (GGUFBlockLinear), W computed in float32
as the file's own dequantization and rounded to bf16 per tile, as the bf16 engine rounds its weight,
so the mode gives that engine's tokens from a third of the memory (session 29). On other x86 CPUs
with the native kernels (Zen 3 and Zen 4; AVX2 is enough) the file's codes and scales
(Q4BlocksLinear, and Q8BlocksLinear for Q8_0): activations quantized to int8 per 32 and integer dot
products, as llama.cpp and vLLM's GGUF kernels compute (gguf_int8_activations.py). On Zen 4 that
read the default model's 120 layer linears at one row in 1.2-2.0 ms against 4.7 for the grouped INT4
AVX-512 arithmetic it replaced there (session 40). Without the native kernels they map onto the
int4 kernel's format with group size 32 (scale d, zero point 0 or m + 8d): the codes are kept as
they are, the scales rounded from float16 to bfloat16 (a relative change of at most 2^-8 per block
scale, far below the 4-bit step).
Q8_0 (where not on int8 activations as above) keeps its int8 codes and float16 scales as they are:
the batch-invariant kernel where it exists, the float32 C++ GEMV at decode sizes, else row tiles of
about 2 MiB dequantized into the activation dtype for each call.
Q5_0, Q4_K and Q6_K tensors go on int8 activations too where Q4_0 / Q4_1 / Q8_0 do
(gguf_int8_activations.kquant_parts: Q5_0 and Q6_K as int8 codes on q8x8, Q4_K on q4x8). Elsewhere,
and Q5_1 / Q5_K everywhere, they keep their file bytes and decode per tile (gguf_kquant.py). A fused slot (qkv, gate_up) whose parts have different block types becomes a
`ConcatLinear` of one layer per part. Float tensors keep the float weight the loader made.
In gguf mode the lm_head is always built from the file's blocks (token_embd when tied), and the
embedding lookup dequantizes only the rows it looks up (gguf_embedding.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from tessera.quant import invariant, native_gemv
from tessera.quant.gguf_int8_activations import Q4BlocksLinear, Q8BlocksLinear, decode_q4_blocks, kquant_parts
from tessera.quant.gguf_kquant import KQUANT_TYPES, GGUFBlockLinear
from tessera.quant.int4 import Int4Linear
from tessera.quant.linear import QuantLinear, tile_rows_for, tiled_matmul

logger = logging.getLogger("tessera")

BLOCK = 32
NATIVE_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, *KQUANT_TYPES)
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
    """A GGUF Q8_0 weight: int8 codes with a float16 scale per 32. On AVX-512 BF16 CPUs every call
    takes the batch-invariant kernel (invariant.py: codes and scales in tile order, W = d q rounded to bf16
    in registers); elsewhere decode-sized calls take the C++ GEMV (native_gemv.py) when it is
    built and others dequantize in tiles per call (neither is batch-invariant)."""

    method = "gguf Q8_0"

    @property
    def kernels(self) -> tuple[str, ...]:  # "native" only where the C++ extension is built
        if self.invariant:
            return ("invariant",)
        return (("native",) if native_gemv.available() else ()) + ("dequant",)

    def __init__(self, codes: torch.Tensor, d: torch.Tensor) -> None:
        super().__init__(codes.shape[0], codes.shape[1])
        self.invariant = invariant.enabled(codes.device)
        d = d.to(torch.float16)  # the file's own scales, exactly
        if self.invariant:  # tile order is the only copy
            self.register_buffer("tiles", invariant.pack_tiles(codes))
            self.register_buffer("tile_d", invariant.pack_blocks(d))
        else:
            self.register_buffer("codes", codes.contiguous())
            self.register_buffer("d", d.contiguous())

    def _codes_and_d(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.invariant:
            n, k = self.out_features, self.in_features
            return invariant.unpack_tiles(self.tiles, n, k), invariant.unpack_blocks(self.tile_d, n)
        return self.codes, self.d

    def _fill(self, start: int, end: int, tile: torch.Tensor) -> None:
        codes, d = self._codes_and_d()
        tile.copy_(codes[start:end])
        tile.view(end - start, -1, BLOCK).mul_(d[start:end, :, None].to(tile.dtype))

    def dequantize(self) -> torch.Tensor:
        w = torch.empty(self.out_features, self.in_features)
        self._fill(0, self.out_features, w)
        return w

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as float32 [*ids.shape, in_features], exactly as dequantize()."""
        flat = ids.reshape(-1)
        if self.invariant:
            codes = invariant.tile_rows(self.tiles, flat, self.in_features)
            d = self.tile_d[flat // 16, :, flat % 16]
        else:
            codes, d = self.codes[flat], self.d[flat]
        w = codes.float().view(flat.numel(), -1, BLOCK).mul_(d[:, :, None].float())
        return w.view(*ids.shape, self.in_features)

    def select_kernel(self, num_rows: int) -> str:
        if self.invariant:
            return "invariant"
        if self.codes.device.type == "cpu" and num_rows <= native_gemv.NATIVE_MAX_ROWS and native_gemv.available():
            return "native"
        return "dequant"

    def logits_argmax(self, x: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.invariant:
            return None
        return invariant.qgemm_logits(x, self.tiles, self.tile_d, None, invariant.Q8_0, self.out_features, True, logits)

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "invariant" and self.invariant:
            return invariant.qgemm(x, self.tiles, self.tile_d, None, invariant.Q8_0, self.out_features)
        if kernel == "native":
            return native_gemv.gemv_q8_0(x, self.codes, self.d)
        if kernel != "dequant":
            raise ValueError(f"unknown Q8_0 kernel {kernel!r}; have {self.kernels}")
        return tiled_matmul(x, self.out_features, tile_rows_for(self.in_features), self._fill)


def raw_rows(tensor) -> torch.Tensor:
    """A GGUF tensor's block bytes as uint8 [rows, bytes per row] (a copy: the file is read-only)."""
    rows = int(np.prod(tensor.shape[1:]))  # GGUF lists dims innermost first
    return torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1).copy())


def slot_block_rows(files, parts: list[str], types) -> tuple[Q, torch.Tensor] | None:
    """A weight slot's GGUF tensors (its HF parts, in order) as (their one block type, their block
    bytes uint8 [rows, bytes per row] in the loader's row order), or None where the parts' types
    differ or their type is not one of `types`."""
    tensors = [files.source_tensor(n) for n in parts]
    qtypes = {t.tensor_type for t in tensors}
    if len(qtypes) != 1 or (qtype := qtypes.pop()) not in types:
        return None
    raw = []
    for name, t in zip(parts, tensors, strict=True):
        rows = raw_rows(t)  # a row's blocks are its own, so the loader's row order applies to them
        raw.append(transform(rows) if (transform := files.row_transform(name)) is not None else rows)
    return qtype, torch.cat(raw)


def on_int8_activations() -> bool:
    """Whether Q4_0 / Q4_1 / Q8_0 tensors run on int8 activations here (gguf_int8_activations.py):
    where the native GEMV kernels are built and there is no AMX (whose tiles give the bf16
    engine's tokens instead, above)."""
    return native_gemv.available() and not (invariant.enabled() and invariant.cpu_has_amx())


def _decode(tensor) -> tuple | None:
    """A GGUF tensor as ("int4", codes, scale, zero), ("q8_0", codes, d), ("q4_blocks", codes, d, m),
    ("q8_blocks", codes, d), one of kquant_parts' kinds or (type name, raw block bytes uint8 [rows,
    bytes per row]); None if not native."""
    rows = int(np.prod(tensor.shape[1:]))  # GGUF lists dims innermost first
    if tensor.tensor_type in KQUANT_TYPES:
        raw = raw_rows(tensor)
        if on_int8_activations() and (parts := kquant_parts(raw, tensor.tensor_type)) is not None:
            return parts
        return (tensor.tensor_type.name, raw)
    if tensor.tensor_type in (Q.Q4_0, Q.Q4_1) and invariant.enabled() and invariant.cpu_has_amx():
        # The KQ kernel on AMX: W = d q (- 8 d | + m) in float32, the file's own dequantization
        # exactly, then bf16 per tile, as the bf16 engine's weight (so the same tokens as
        # --quantization none); INT4's scale and zero would round d and m to bf16 first.
        return (tensor.tensor_type.name, raw_rows(tensor))
    if on_int8_activations():
        if tensor.tensor_type in (Q.Q4_0, Q.Q4_1):
            return ("q4_blocks", *decode_q4_blocks(_blocks(tensor.data, tensor.tensor_type, rows), tensor.tensor_type))
        if tensor.tensor_type == Q.Q8_0:
            return ("q8_blocks", *decode_q8_0(tensor.data, rows))
    if tensor.tensor_type == Q.Q4_0:
        codes, d = decode_q4_0(tensor.data, rows)
        return ("int4", codes, d, torch.zeros_like(d))
    if tensor.tensor_type == Q.Q4_1:
        codes, d, m = decode_q4_1(tensor.data, rows)
        return ("int4", codes, d, m + 8 * d)
    if tensor.tensor_type == Q.Q8_0:
        return ("q8_0", *decode_q8_0(tensor.data, rows))
    return None


def _layer(kind: str, parts: list[torch.Tensor]) -> QuantLinear:
    """One QuantLinear from decoded parts of one kind."""
    if kind == "int4":
        return Int4Linear.from_codes(*parts, group_size=BLOCK)
    if kind == "q8_0":
        return Q8_0Linear(*parts)
    if kind == "q4_blocks":
        return Q4BlocksLinear(*parts)
    if kind == "q8_blocks":
        return Q8BlocksLinear(*parts)
    if kind == "q8_blocks16":
        return Q8BlocksLinear(*parts, scale_dtype=torch.float32)
    if kind == "q4_codes":
        return Q4BlocksLinear(*parts, scale_dtype=torch.float32)
    return GGUFBlockLinear(*parts, Q[kind])


class ConcatLinear(QuantLinear):
    """A fused weight whose parts (q, k, v or gate, up) have different GGUF block types: each part
    runs its own kernel and the outputs are concatenated."""

    kernels = ("parts",)

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__(sum(p.out_features for p in parts), parts[0].in_features)
        self.parts = torch.nn.ModuleList(parts)
        self.method = "+".join(p.method for p in parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def select_kernel(self, num_rows: int) -> str:
        return "parts"

    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _count(tally: dict, kind: str, native: bool, nbytes: int) -> None:
    entry = tally.setdefault((kind, native), [0, 0])
    entry[0] += 1
    entry[1] += nbytes


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
    tally: dict[tuple[str, bool], list[int]] = {}  # (GGUF type, native) -> [tensors, bytes]
    for desc in descs:
        # The HF weights fused into this slot, in row order; the untied embedding table is no slot.
        names = slot_parts[desc] if desc in slot_parts else ["model.embed_tokens.weight"]
        tensors = [model_files.source_tensor(n) for n in names]
        decoded = [_decode(t) for t in tensors]
        if any(d is None for d in decoded):
            for t in tensors:  # the loader's float weight, in the model dtype
                _count(tally, t.tensor_type.name, False, int(np.prod(t.shape)) * model.dtype.itemsize)
            continue
        parts = []
        for name, d in zip(names, decoded, strict=True):
            part = d[1:]
            if (transform := model_files.row_transform(name)) is not None:  # as the loader does
                part = tuple(transform(t) for t in part)
            parts.append(part)
        kinds = {d[0] for d in decoded}
        if len(kinds) == 1:
            layer = _layer(decoded[0][0], [torch.cat(ts) for ts in zip(*parts, strict=True)])
        else:
            layer = ConcatLinear([_layer(d[0], list(p)) for d, p in zip(decoded, parts, strict=True)])
        layer.method = "gguf " + "+".join(sorted({t.tensor_type.name for t in tensors}))
        layers[desc] = layer
        share = layer.weight_bytes() / sum(t.n_bytes for t in tensors)
        for t in tensors:
            _count(tally, t.tensor_type.name, True, int(t.n_bytes * share))
    for (kind, native), (count, nbytes) in sorted(tally.items()):
        log = logger.info if native else logger.warning
        log("gguf: %d %s tensor(s) %s: %.1f MiB", count, kind,
            "computed from their blocks" if native else f"dequantized to {model.dtype} (no native kernel)",
            nbytes / 2**20)
    return layers

