"""A GGUF model in bf16 decodes from the file's own 4/5-bit blocks: the same bits from a third of the bytes.

Loaded in bf16 (the default), a GGUF model's linear weight is bf16(W), W the file's float32
dequantization, and a decode step is bound by reading those weights (the default model: 213 MB of
layer weights a step against 66 MB of its Q4_1 blocks). The KQ kernel (gguf_tiles.py,
csrc/invariant_qgemm.cpp `kqgemm`) computes with the blocks and rounds W to bf16 in registers:
the same B tiles as the bf16 kernel, the same tile products in the same order, so the same output
bits (tests/unit/test_gguf_codes.py checks it row count by row count), with the dequantization
in place of two thirds of the weight reads. That pays only where the reads are the step's bound:
up to max_rows() rows (decodes; the tiles' dequantization is done once per call and shared by its
rows only up to there). Larger calls (prefill chunks) keep the bf16 weight, so both stay in
memory (+66 MB for the default model).

Where: CPUs with AVX-512 BF16, AMX or not (both kernels take the machine's one arithmetic: AMX
tiles, or without AMX one VDPBF16PS chain per output over the k pairs in order), bf16 weights, slots
whose parts are all one of Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (the K-quants since session 43:
their W = fma(q, d sc, -dmin m) rounds once, as the file's float32 dequantization does, so
bf16(W) is the loader's weight; a Llama-3.2-1B-shaped model of random Q4_K layers decodes 1.3-1.9x
faster than from its bf16 weights on Zen 4, benchmarks/kquant_codes.py), calls
without a bias (a bias is added before the bf16 kernel's rounding and after kqgemm's), of up to
max_rows() rows: 32 on AMX, 8 without (the AVX-512 path makes each tile row in registers as it
multiplies it, compute-bound: the default model's 120 layer linears at 1 / 4 / 8 rows 5.2 / 6.1 /
7.7 ms from the blocks against 7.3 at 4 rows and 9.0 at 8 from bf16, AMD EPYC Zen 4, session 43;
docs/kernels.md). `TESSERA_GGUF_CODES=0` turns it off, for A/B runs (docs/kernels.md, session 27).

A Q8_0 lm_head (the default model's tied token_embd) reads its blocks the same way (qgemm's Q8_0
tiles, W = bf16(d q) the bf16 weight exactly): 28.7 MiB a step instead of 54, with the logits in
fp32 and greedy ids as the bf16 kernel gives them (qgemm_logits: from the store epilogue on AMX,
session 29; without AMX the bf16 output widened and its first maximum), up to max_rows(q8_0=True)
rows: 32 on AMX, 4 without.
"""

from __future__ import annotations

import logging
import os

import torch
from gguf import GGMLQuantizationType as Q

from tessera import memory

logger = logging.getLogger("tessera")

# Row counts up to these take the blocks. AMX: column_pair_small in csrc/invariant_qgemm.cpp handles
# 32 rows; above it the whole-K path loses to the bf16 weight (120 linears at 48 rows 29 ms against
# 25, at 32 13.5 against 17.6, Intel Xeon model 167). AVX-512 BF16 without AMX: the layers' KQ
# blocks up to 8 rows (kq_rows_direct, kKQDirectRows: the default model's 120 layer linears at 8
# rows 7.7 ms against 9.0 from bf16), a Q8_0 lm_head up to 4 (kSmallRows; at 5-8 rows 1.9-2.3 ms
# against 1.7-2.2), AMD EPYC Zen 4.
CODES_MAX_ROWS_AMX = 32
CODES_MAX_ROWS_AVX512 = 8
Q8_0_MAX_ROWS_AVX512 = 4
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def enabled() -> bool:
    """Whether a bf16 engine here reads the blocks: AVX-512 BF16 (AMX or not) with the quantized
    kernels built, not turned off."""
    from tessera.quant import invariant

    return os.environ.get("TESSERA_GGUF_CODES", "1") != "0" and invariant.available()


def max_rows(q8_0: bool = False) -> int:
    """The largest call (rows) that reads the blocks on this CPU: the layers' KQ blocks, or with
    `q8_0` a Q8_0 lm_head's."""
    from tessera.quant import invariant

    if invariant.cpu_has_amx():
        return CODES_MAX_ROWS_AMX
    return Q8_0_MAX_ROWS_AVX512 if q8_0 else CODES_MAX_ROWS_AVX512


@torch.no_grad()
def attach_gguf_codes(model, files) -> int:
    """Give each bf16 InvariantLinear whose GGUF parts are all one of TYPES its blocks in tile
    order; returns how many. Not a GGUF file, or not enabled here: 0."""
    from tessera.kernels.linear import InvariantLinear
    from tessera.model.gguf_loader import GGUFModelFiles
    from tessera.quant import invariant
    from tessera.quant.gguf_native import decode_q8_0, slot_block_rows
    from tessera.quant.gguf_tiles import KIND, KQTiles

    if not isinstance(files, GGUFModelFiles) or not enabled():
        return 0
    found, lm_head = [], None
    for slot in model.linear_slots(quantize_lm_head=True):
        w = getattr(slot.owner, slot.attr)
        if type(w) is not InvariantLinear or w.dtype != torch.bfloat16 or not slot.parts:
            continue
        if (found_rows := slot_block_rows(files, slot.parts, (*TYPES, Q.Q8_0))) is None:
            continue
        qtype, raw = found_rows
        if slot.attr == "lm_head" and qtype == Q.Q8_0:  # not in the decoder stack: called on its own
            codes, d = decode_q8_0(raw.numpy(), w.out_features)
            lm_head = (w, invariant.pack_tiles(codes), invariant.pack_blocks(d.to(torch.float16)))
        elif slot.attr != "lm_head" and qtype in TYPES:
            found.append((w, KQTiles.pack(raw, qtype), KIND[qtype]))
    # One huge-page buffer in call order, as the bf16 weights' (tessera.memory.Arena): a decode
    # streams it from layer to layer. Separate allocations ran the 120 linears no faster than bf16.
    parts = [t for _, tiles, _ in found for t in (tiles.codes, tiles.sup)] + list(lm_head[1:] if lm_head else [])
    copies = iter(memory.copies_in_order(parts, huge=True))
    rows = max_rows()
    for w, tiles, kind in found:
        tiles.codes, tiles.sup = next(copies), next(copies)
        w.attach_codes(tiles, kind, rows)
    nbytes = sum(tiles.nbytes() for _, tiles, _ in found)
    if lm_head:
        w, tiles, d = lm_head
        w.attach_q8_0(next(copies), next(copies), max_rows(q8_0=True))
        nbytes += tiles.numel() * tiles.element_size() + d.numel() * d.element_size()
    count = len(found) + (lm_head is not None)
    if count:
        logger.info("decode steps read %d linear weights from the GGUF blocks (%.1f MiB; the bf16 copies "
                    "serve prefill chunks, same bits either way)", count, nbytes / 2**20)
    return count
