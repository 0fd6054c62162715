"""Paged attention with the batch-invariant C++ kernel (tessera/kernels), the CPU default.

Every query row (a decode, a prefill chunk's token, a speculative verification row) attends to
its own context through the block table, in place (no gathered copy of the context), in fixed
16-position tiles with an fp32 online softmax. A row's output therefore does not depend on the
batch, on where a prefill chunk starts, or on whether its prefix came from the cache.

Sliding-window layers (Mistral, Gemma 3's local layers) pass their window to the kernel, which
reads only the keys inside each row's window (blocks behind it may be block 0). Quantized KV
caches (--kv-cache-dtype int8/fp8) are dequantized in the kernel as it reads them (codes times
the fp32 scale of their slot and KV head), so they are invariant too. Head dims the kernel has
no instance for, and non-CPU tensors, go through the plain torch backend this class extends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera import kernels
from tessera.attention.metadata import AttentionMetadata
from tessera.attention.torch_cpu import TorchCPUAttention
from tessera.quant.kv import is_quantized, write_quantized

_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


@dataclass
class _KernelPlan:
    metadata: AttentionMetadata
    block_tables: torch.Tensor  # [rows, max_blocks] int32: one row per decode, then per prefill span
    token_row: torch.Tensor  # [T] int32: each token's row of block_tables
    token_ctx: torch.Tensor  # [T] int32: context positions each token attends to (its own included)


def _kernel_plan(metadata: AttentionMetadata) -> _KernelPlan:
    """Block tables recovered from the metadata's slots (the first slot of each block, // block
    size), and each token's table row and context length."""
    block_size = metadata.block_size
    tables: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    ctxs: list[torch.Tensor] = []
    num_decodes = metadata.num_decode_tokens
    if num_decodes:
        slots = metadata.decode_slots
        tables.extend(slots[:, ::block_size] // block_size)
        rows.append(torch.arange(num_decodes, dtype=torch.int32))
        mask = metadata.decode_mask
        ctxs.append(mask.reshape(num_decodes, -1).sum(-1, dtype=torch.int32) if mask is not None
                    else torch.full((num_decodes,), slots.shape[1], dtype=torch.int32))
    for span in metadata.prefills:
        row = len(tables)
        tables.append(span.context_slots[: span.context_len : block_size] // block_size)
        rows.append(torch.full((span.query_len,), row, dtype=torch.int32))
        first = span.context_len - span.query_len + 1
        ctxs.append(torch.arange(first, first + span.query_len, dtype=torch.int32))
    width = max(t.numel() for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : t.numel()] = t
    return _KernelPlan(metadata, table, torch.cat(rows), torch.cat(ctxs))


class InvariantCPUAttention(TorchCPUAttention):
    name = "invariant"
    supports_quantized_kv = True

    def __init__(self) -> None:
        super().__init__()
        self._kernel_plan: _KernelPlan | None = None

    def begin_step(self, metadata: AttentionMetadata) -> None:
        super().begin_step(metadata)
        self._kernel_plan = None

    def forward(self, layer_idx, q, k, v, kv_cache, metadata, scale, sliding_window=None):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        quantized = is_quantized(kv_cache)
        if (q.shape[-1] not in _HEAD_DIMS or (k_cache.dtype != q.dtype and not quantized)
                or q.device.type != "cpu" or not kernels.available() or metadata.block_size is None):
            return super().forward(layer_idx, q, k, v, kv_cache, metadata, scale, sliding_window)
        if quantized:
            k_scales, v_scales = kv_cache[2], kv_cache[3]
            write_quantized(kv_cache, k, v, metadata.slot_mapping, q.dtype)  # codes + scales; reads dequantize
        else:
            k_scales = v_scales = None
            k_cache.index_copy_(0, metadata.slot_mapping, k)
            v_cache.index_copy_(0, metadata.slot_mapping, v)
        plan = self._kernel_plan
        if plan is None or plan.metadata is not metadata:
            plan = self._kernel_plan = _kernel_plan(metadata)
        return kernels.ops().paged_attention(q, k_cache, v_cache, plan.block_tables, plan.token_row,
                                             plan.token_ctx, metadata.block_size, scale, sliding_window or 0,
                                             k_scales, v_scales)
